"""The recommendation models (DLRM, Wide & Deep) on MovieLens-100k: the data split, the
AUC function, 2-rank sbpflow training (tables split by rows, MLPs data parallel) against
the one-process PyTorch twin, and ``sbpflow train dlrm-ml100k``."""

from __future__ import annotations

import itertools

import pytest
import torch

import sbpflow
from sbpflow.apps import datasets
from sbpflow.apps.metrics import log_loss, roc_auc

STEPS = 20


@pytest.fixture(scope="module")
def ml100k():
    return datasets.load_movielens(0)


# ----------------------------------------------------------------------------- data
def test_movielens_split(ml100k):
    d = ml100k
    sizes = [len(d.train["label"]), len(d.val["label"]), len(d.test["label"])]
    assert sizes == [80_000, 10_000, 10_000]
    for part in (d.train, d.val, d.test):
        assert 0.53 < float(part["label"].mean()) < 0.58  # rating >= 4: 55.4% overall
        assert part["sparse"].shape[1] == len(d.sparse_names) == len(d.vocab_sizes)
        assert bool((part["sparse"] >= 0).all())
        assert bool((part["sparse"] < torch.tensor(d.vocab_sizes)).all())
        assert int(part["bag"].max()) < d.bag_vocab
        # the bag weights average the real genres and drop the padding
        torch.testing.assert_close(part["bag_weights"].sum(1), torch.ones(len(part["label"])))
        assert bool((part["bag_weights"][part["bag"] == d.bag_vocab - 1] == 0).all())
    assert d.vocab_sizes[:2] == (943, 1682)  # users, movies
    assert d.bag_vocab == 19 + 1  # genres + padding
    # a permutation of the ratings (one per user and movie): no pair in two splits
    keys = torch.cat([p["sparse"][:, 0] * 10_000 + p["sparse"][:, 1]
                      for p in (d.train, d.val, d.test)])
    assert keys.unique().numel() == 100_000


def test_movielens_missing():
    import importlib.util
    from unittest import mock

    with mock.patch.object(importlib.util, "find_spec", return_value=None), \
            pytest.raises(FileNotFoundError, match="pip install --no-deps recbole==1.2.1"):
        datasets.load_movielens()


def test_zipf_ids():
    ids = datasets.zipf_ids((20_000,), 1000, 1.1, seed=3)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 1000
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values.double()
    # rank 1 against rank 10 of a Zipf law with exponent 1.1: 10 ** 1.1 = 12.6
    assert 8 < float(counts[0] / counts[9]) < 18
    with pytest.raises(ValueError, match="vocab"):
        datasets.zipf_ids((3,), 0)


# ----------------------------------------------------------------------------- metrics
def _pairwise_auc(s, y):
    pos, neg = s[y == 1], s[y == 0]
    wins = sum(float(p > n) + 0.5 * float(p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_against_pairs(seed):
    g = torch.Generator().manual_seed(seed)
    n = 30 + 7 * seed
    scores = torch.randint(0, 6, (n,), generator=g).float()  # many ties
    if seed % 2:
        scores = scores + torch.rand(n, generator=g)  # no ties
    labels = torch.randint(0, 2, (n,), generator=g)
    labels[0], labels[1] = 0, 1
    assert roc_auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)


def test_roc_auc_and_log_loss_errors():
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="3 scores"):
        roc_auc(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="0 or 1"):
        log_loss(torch.zeros(2), torch.tensor([0, 2]))
    logits, labels = torch.randn(9), torch.randint(0, 2, (9,)).float()
    want = torch.nn.functional.binary_cross_entropy(torch.sigmoid(logits.double()),
                                                    labels.double())
    assert log_loss(logits, labels) == pytest.approx(float(want), rel=1e-9)


# ----------------------------------------------------------------------------- 2 ranks
def _batches(d, batch: int, steps: int):
    out = []
    for step in range(steps):
        idx = datasets.ctr_batch(len(d.train["label"]), batch, 0, step)
        out.append({k: v[idx] for k, v in d.train.items()})
    return out


def _torch_curve(name: str, batches) -> list[float]:
    import sbpflow.models as models

    spec = models.get(name)
    torch.manual_seed(0)
    m = spec.build_torch()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out = []
    for b in batches:
        opt.zero_grad()
        logits = m(b["dense"], b["sparse"], b["bag"], b["bag_weights"])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b["label"])
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _sbpflow_curve(name: str, batches):
    import sbpflow.models as models
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    spec = models.get(name)
    n = sbpflow.distributed.get_world_size()
    pl = sbpflow.placement("cpu", list(range(n)))
    sbpflow.manual_seed(0)
    m = spec.build()
    parallelize_module(m, pl, spec.plan("dp"))
    tables = [p for k, p in m.named_parameters() if "embedding_bags" in k]
    layouts = {p.sbp for p in tables}
    opt = sbpflow.optim.Adam(m.parameters(), lr=1e-2)
    out = []
    for i, b in enumerate(batches):
        g = {k: sbpflow.tensor(v, placement=pl, sbp=split(0)) for k, v in b.items()}
        opt.zero_grad()
        with sbpflow.distributed.CommRecorder() as rec:
            logits = m(g["dense"], g["sparse"], g["bag"], g["bag_weights"])
        loss = sbpflow.nn.functional.binary_cross_entropy_with_logits(logits, g["label"])
        loss.backward()
        opt.step()
        out.append(loss.item())
        if i == 0:  # every table in one exchange: 1 all-gather (counts), 2 all-to-alls
            kinds = sorted(r.kind for r in rec.records)
    local_rows = sum(p.to_local().shape[0] for p in tables)
    return out, layouts, local_rows, sum(p.shape[0] for p in tables), kinds


@pytest.mark.parametrize("name", [
    "dlrm-ml100k", pytest.param("wide-deep-ml100k", marks=pytest.mark.exhaustive)])
def test_two_ranks_follow_torch(dist_run, ml100k, name):
    batches = _batches(ml100k, 64, STEPS)
    want = _torch_curve(name, batches)
    got = dist_run(2, _sbpflow_curve, name, batches)
    for curve, layouts, local_rows, rows, kinds in got:
        assert layouts == {(sbpflow.sbp.split(0),)}
        assert kinds.count("all_to_all") == 2, kinds
        assert local_rows < rows * 0.51  # each rank holds about half of every table
        torch.testing.assert_close(torch.tensor(curve), torch.tensor(want), rtol=1e-4,
                                   atol=0)
    assert sum(want[-5:]) < sum(want[:5])  # it learns


# ----------------------------------------------------------------------------- sbpflow train
def _train_in_rank(args: list[str]) -> list[dict]:
    import json
    from pathlib import Path

    from sbpflow import distributed as sd
    from sbpflow.apps import train

    torch.set_num_threads(1)
    code = train.main([*args, "--no-progress"])
    if sd.get_rank() != 0:
        return [code]
    out = Path(args[args.index("--out") + 1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [code, rows, json.loads((out / "config.json").read_text()),
            (out / "loss.png").is_file()]


def test_train_cli_dlrm(dist_run, tmp_path):
    code, rows, cfg, png = dist_run(2, _train_in_rank, [
        "dlrm-ml100k", "--steps", "16", "--batch-size", "512", "--lr", "1e-2",
        "--eval-every", "0", "--out", str(tmp_path)], timeout=300)[0]
    assert code == 0 and png
    evals = [r for r in rows if "val_auc" in r]
    assert [r["step"] for r in evals] == [16]
    assert evals[0]["val_logloss"] == pytest.approx(evals[0]["val_loss"], rel=1e-5)
    # 16 steps of 512 (10% of an epoch) already rank clicks above chance
    assert 0.6 < evals[0]["val_auc"] <= 1.0
    assert evals[0]["val_logloss"] < 0.69  # below a constant prediction's ~0.688
    assert cfg["data"]["train_samples"] == 80_000 and cfg["dp"] == 2


def test_train_cli_dlrm_graph_follows_eager(dist_run, tmp_path):
    """--graph: the step as an nn.Graph, each row-split table looked up by the registered
    embedding_bag (P output) instead of the eager exchange: the same losses."""
    base = ["dlrm-ml100k", "--steps", "4", "--batch-size", "256", "--lr", "1e-2",
            "--eval-every", "0"]
    eager = dist_run(2, _train_in_rank, [*base, "--out", str(tmp_path / "e")],
                     timeout=300)[0]
    graph = dist_run(2, _train_in_rank, [*base, "--graph", "--out", str(tmp_path / "g")],
                     timeout=300)[0]
    assert eager[0] == graph[0] == 0
    want, got = [r["loss"] for r in eager[1]], [r["loss"] for r in graph[1]]
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-5), (got, want)
    assert "-> (P,)" in (tmp_path / "g" / "graph.txt").read_text()


def _train_in_rank_profiled(cache: str, args: list[str]) -> list:
    """:func:`_train_in_rank` with ``$SBPFLOW_CACHE`` at ``cache``, which holds the
    checked-in 2-rank profile as this machine's calibration (no calibration run), with the
    fields a calibration must have at their defaults (no step term, no wait)."""
    import json
    import os

    from sbpflow.planner import calibrate

    os.environ["SBPFLOW_CACHE"] = cache
    try:
        path = calibrate.cache_path(2)
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            with open(os.path.join(os.path.dirname(__file__), "data",
                                   "cpu-2ranks-example.json")) as f:
                profile = json.load(f)
            with open(path, "w") as f:
                json.dump({**profile, "step_seconds": 0.0, "collective_wait": []}, f)
        return _train_in_rank(args)
    finally:
        os.environ.pop("SBPFLOW_CACHE", None)


def test_train_cli_plan_auto_and_an_edited_plan(dist_run, tmp_path):
    """``--plan auto`` trains DLRM as a graph (every table's layout a decision) and its
    evaluation runs eagerly in the chosen layouts; the plan edited by hand (tables by
    rows, by columns and replicated at once) trains and evaluates as given."""
    import json

    cache = str(tmp_path / "cache")
    base = ["dlrm-ml100k", "--steps", "16", "--batch-size", "512", "--lr", "1e-2",
            "--eval-every", "0"]
    code, rows, _, _ = dist_run(2, _train_in_rank_profiled, cache,
                                [*base, "--plan", "auto", "--out", str(tmp_path / "a")],
                                timeout=600)[0]
    assert code == 0 and 0.6 < rows[-1]["val_auc"] <= 1.0, rows[-1]
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    tables = "model.embeddings.tables.collection.embedding_bags."
    for name, layout in (("f0", "S(0)"), ("f1", "S(1)"), ("bag", "S(0)")):
        plan["parameters"][f"{tables}{name}.weight"] = layout
    (tmp_path / "mixed.json").write_text(json.dumps(plan))
    code, mixed, _, _ = dist_run(2, _train_in_rank_profiled, cache,
                                 [*base, "--plan", str(tmp_path / "mixed.json"), "--out",
                                  str(tmp_path / "m")], timeout=600)[0]
    assert code == 0
    # the same model and data in other layouts: the same training, to rounding
    assert mixed[-1]["val_auc"] == pytest.approx(rows[-1]["val_auc"], abs=1e-4)
    assert mixed[-1]["loss"] == pytest.approx(rows[-1]["loss"], rel=1e-4)
    text = (tmp_path / "m" / "graph.txt").read_text()
    for line in ("nn.embedding_bag ((S(0),), (S(0),)) boxed to ((B,), (S(0),)) -> (P,)",
                 "nn.embedding_bag ((S(0),), (S(1),)) boxed to ((B,), (S(1),)) -> (S(1),)",
                 "nn.embedding_bag ((S(0),), (B,)) -> (S(0),)"):
        assert line in text, text[:3000]


@pytest.mark.exhaustive
def test_train_cli_reaches_auc(dist_run, tmp_path):
    """A shortened default run (200 of the 400 steps) already passes AUC 0.75."""
    code, rows, _, _ = dist_run(2, _train_in_rank, [
        "wide-deep-ml100k", "--steps", "200", "--eval-every", "0", "--out", str(tmp_path)],
        timeout=900)[0]
    assert code == 0 and rows[-1]["val_auc"] > 0.75


def test_bad_features():
    import sbpflow.models as models

    m = models.get("dlrm-ml100k").build_torch()
    dense, ids = torch.zeros(3, 2), torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*6 tables"):
        m(dense, ids, torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6))
    with pytest.raises(ValueError, match="no bag ids"):
        m(dense, torch.zeros(3, 6, dtype=torch.long))
    sm = models.get("dlrm-ml100k").build()
    bad = torch.zeros(3, 6, dtype=torch.long)
    bad[1, 0] = 943  # one past the user table
    with pytest.raises((IndexError, RuntimeError), match="943"):  # local: torch's error
        sm(sbpflow.from_torch(dense), sbpflow.from_torch(bad),
           sbpflow.from_torch(torch.zeros(3, 6, dtype=torch.long)),
           sbpflow.from_torch(torch.zeros(3, 6)))


# ----------------------------------------------------------------------------- bench
def _bench_in_rank(args: list[str]):
    import json
    from pathlib import Path

    from sbpflow.apps.bench import dlrm as bench_dlrm

    torch.set_num_threads(1)
    code = bench_dlrm.main(args)
    if sbpflow.distributed.get_rank() != 0:
        return code
    return code, json.loads((Path(args[args.index("--out") + 1]) / "bench.json").read_text())


@pytest.mark.exhaustive
def test_bench_dlrm(dist_run, tmp_path):
    # cap 15 MiB: at 1e5 rows PyTorch's replicated tables + Adagrad state need 24.4 MiB
    # per rank (does not fit), sbpflow's row-split half 12.2 MiB (fits)
    code, rep = dist_run(2, _bench_in_rank, [
        "--vocab", "1e3", "1e5", "--batch-size", "64", "--warmup", "1", "--steps", "1",
        "--repeats", "1", "--mem-cap", str(15 / 1024), "--out", str(tmp_path)],
        timeout=300)[0]
    assert code == 0 and rep["synthetic_data"] and rep["ranks"] == 2
    small, big = rep["results"]
    s, t = small["runners"]["sbpflow"], small["runners"]["torch-ddp"]
    # exact bytes: V rows x 16 columns x 2 tables x 4 bytes x (weight + Adagrad sum), and
    # Adagrad's step counter (one float32 per table)
    assert t["table_bytes"] == 1000 * 16 * 2 * 4 * 2 + 2 * 4
    assert s["table_bytes"] == 500 * 16 * 2 * 4 * 2 + 2 * 4
    assert s["collectives_per_step"]["all_to_all"]["count"] == 4  # one exchange, 2 + 2
    assert abs(s["first_loss"] - 0.69) < 0.05 and s["step_ms_median"] > 0
    assert big["runners"]["torch-ddp"]["does_not_fit"]
    assert big["runners"]["torch-ddp"]["table_bytes"] == 100_000 * 16 * 2 * 4 * 2
    assert big["runners"]["sbpflow"]["table_bytes"] == 50_000 * 16 * 2 * 4 * 2 + 2 * 4
    assert (tmp_path / "bench.md").read_text().count("does not fit") == 1
