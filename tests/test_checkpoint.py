"""sbpflow.save / sbpflow.load: sharded safetensors + JSON, resharding on load (2x2 mesh ->
2 ranks -> 1 process), per-rank file sizes about the shard bytes, atomic commits under
SIGKILL at random points, and PyTorch/safetensors interchange."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch
from _pool import run_isolated

import sbpflow
from sbpflow import nn
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1 = split(0), split(1)


def _values(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w_rows": torch.randn(10, 6, generator=g) * scale,
            "w_cols": torch.randn(6, 9, generator=g) * scale,
            "w_rep": torch.randn(4, 4, generator=g) * scale,
            "w_part": torch.randn(7, 3, generator=g) * scale,
            "ids": torch.arange(12).reshape(3, 4) * int(scale)}


class _Model(nn.Module):
    def __init__(self, pl, layouts):
        super().__init__()
        for name, v in _values().items():
            t = sbpflow.tensor(v * 0, placement=pl, sbp=layouts[name])
            if name.startswith("w_") and name != "w_part":  # P: a buffer (not optimizable)
                setattr(self, name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)


LAYOUTS_2X2 = {"w_rows": (S0, S0), "w_cols": (B, S1), "w_rep": (B, B), "w_part": (P, S0),
               "ids": (S1, B)}
LAYOUTS_2 = {"w_rows": S1, "w_cols": B, "w_rep": S0, "w_part": S0, "ids": P}


def _save_2x2(path):
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    m = _Model(pl, LAYOUTS_2X2)
    m.load_state_dict(_values())
    opt = sbpflow.optim.AdamW(m.parameters(), lr=0.1)
    loss = sum((p * p).sum().to_global(sbp=(B, B)) for p in m.parameters())
    loss.backward()
    opt.step()
    sbpflow.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7,
                  "note": ("a", 1.5, None)}, path)
    expect = {k: v.numpy() for k, v in m.state_dict().items()}
    exp_avg = {i: st["exp_avg"].numpy() for i, st in opt.state_dict()["state"].items()}
    return expect, exp_avg


def _load_2(path, expect, exp_avg):
    pl = sbpflow.placement.all("cpu")
    m = _Model(pl, LAYOUTS_2)
    ck = sbpflow.load(path)
    assert ck["step"] == 7 and ck["note"] == ("a", 1.5, None)
    m.load_state_dict(ck["model"])
    for k, v in m.state_dict().items():
        assert v.sbp == ((LAYOUTS_2[k]),), k
        assert np.array_equal(v.numpy(), expect[k]), k
    opt = sbpflow.optim.AdamW(m.parameters(), lr=0.1)
    opt.load_state_dict(ck["optim"])
    for i, st in opt.state_dict()["state"].items():
        assert np.array_equal(st["exp_avg"].numpy(), exp_avg[i])
    return "ok"


def test_save_2x2_load_on_2_and_1(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    expect, exp_avg = dist_run(4, _save_2x2, path)[0]
    dist_run(2, _load_2, path, expect, exp_avg)
    # One process, no process group: whole values.
    ck = sbpflow.load(path)
    for k, v in ck["model"].items():
        assert np.array_equal(v.numpy(), expect[k]), k
    # Each rank's file holds about its shard bytes: (S0,S0) w_rows gives 10*6/4 rows...
    folder = os.path.join(path, open(os.path.join(path, "LATEST")).read().strip())
    sizes = [os.path.getsize(os.path.join(folder, f"rank-{r:05d}.safetensors"))
             for r in range(4)]
    meta = json.load(open(os.path.join(folder, "meta.json")))
    stored, whole = [0] * 4, 0
    for rec in meta["tensors"].values():
        item = torch.empty((), dtype=getattr(torch, rec["dtype"])).element_size()
        whole += item * int(np.prod(rec["shape"]))
        for piece in rec["pieces"]:
            stored[piece["rank"]] += item * int(np.prod([b - a for a, b in piece["ranges"]]))
    assert sum(stored) == whole  # every element written exactly once: B and P included
    for r in range(4):
        assert stored[r] <= sizes[r] <= stored[r] + 4096, (r, stored, sizes)
        assert stored[r] < 0.5 * sum(stored), stored  # nobody holds everything


# An EmbeddingBagCollection with two table-wise tables (each whole on one rank: rank 0
# and rank 1) and a row-split one whose ids all fall in its first rows (on 2 ranks the
# second shard, on 4 ranks three shards, get no id).
_EBC_TABLES = [dict(name="big", num_embeddings=40, embedding_dim=3, pooling="sum"),
               dict(name="t0", num_embeddings=10, embedding_dim=3, pooling="mean"),
               dict(name="t1", num_embeddings=8, embedding_dim=2, pooling="sum")]
_EBC_OPTS = {  # name: (optimizer, kwargs, sparse gradients)
    "sparse_adam": ("SparseAdam", dict(lr=0.05), True),
    "sparse_adamw": ("SparseAdamW", dict(lr=0.05, weight_decay=0.1), True),
    "sgd_momentum": ("SGD", dict(lr=0.1, momentum=0.9), True),
    "adagrad": ("Adagrad", dict(lr=0.1, lr_decay=0.5), True),  # lr_decay reads the step
    "adamw": ("AdamW", dict(lr=0.05), False),
}


def _ebc_train(opt_name, path, resume):
    """4 steps of a 4-bag global batch on 2 ranks, saving after step 2 (``resume``
    False), or loading that checkpoint and taking steps 3 and 4 on this world (True).
    Returns the tables' whole values (rank 0) and the plan."""
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    cls, kw, sparse = _EBC_OPTS[opt_name]
    torch.manual_seed(0)
    ebc = nn.EmbeddingBagCollection(_EBC_TABLES, pl, sparse=sparse, row_wise_min_bytes=480)
    opt = getattr(sbpflow.optim, cls)(ebc.parameters(), **kw)
    if resume:
        ck = sbpflow.load(path)
        ebc.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
    for step in range(2, 4) if resume else range(4):
        g = torch.Generator().manual_seed(step)
        ids = {"big": torch.randint(0, 10, (4, 2), generator=g),
               "t0": torch.randint(0, 10, (4, 3), generator=g),
               "t1": torch.randint(0, 8, (4, 2), generator=g)}
        out = ebc({f: x[rank * 4 // n:(rank + 1) * 4 // n] for f, x in ids.items()})
        loss = sum((o * o).sum() for o in out.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 and not resume:
            sbpflow.save({"model": ebc.state_dict(), "optim": opt.state_dict()}, path)
    whole = {k: v.numpy() for k, v in ebc.state_dict().items()}
    return whole, {k: (kind, list(p.rank_list)) for k, (kind, p) in ebc.plan.items()}


@pytest.mark.parametrize("opt_name", list(_EBC_OPTS))
def test_embedding_collection_with_table_wise_tables_resumes_on_4_ranks(dist_run, tmp_path,
                                                                       opt_name):
    # The state of a table held by one rank is a global tensor on that table's placement
    # (other ranks: empty shards, as they get an empty gradient), so every optimizer's
    # state saves and reshards; SGD's lazy momentum steps a shard that got no id.
    path = str(tmp_path / "ck")
    straight, plan2 = dist_run(2, _ebc_train, opt_name, path, False)[0]
    assert plan2 == {"big": ("row_wise", [0, 1]), "t0": ("table_wise", [0]),
                     "t1": ("table_wise", [1])}
    resumed, plan4 = dist_run(4, _ebc_train, opt_name, path, True)[0]
    assert plan4["big"] == ("row_wise", [0, 1, 2, 3])
    for k, v in straight.items():
        np.testing.assert_allclose(resumed[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def _save_versions(path, n):
    pl = sbpflow.placement.all("cpu")
    for step in range(n):
        m = _Model(pl, LAYOUTS_2)
        m.load_state_dict(_values(step + 1.0))
        sbpflow.save({"model": m.state_dict(), "step": step}, path, keep=2)
    return "ok"


def test_versions_and_keep(dist_run, tmp_path):
    path = str(tmp_path / "ck")
    dist_run(2, _save_versions, path, 3)
    assert sorted(d for d in os.listdir(path) if not d.startswith(".")) == [
        "LATEST", "v000002", "v000003"]
    ck = sbpflow.load(path)
    assert ck["step"] == 2
    assert np.array_equal(ck["model"]["w_rows"].numpy(), _values(3.0)["w_rows"].numpy())


def _save_then_die(path, victim, delay, big):
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    w = sbpflow.tensor(torch.randn(big, 64, generator=g), placement=pl, sbp=S0)
    sbpflow.save({"w": w, "step": 0}, path)
    if sbpflow.distributed.get_rank() == victim:
        def die():
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    for step in range(1, 200):
        sbpflow.save({"w": w * step, "step": step}, path)
    return "survived"


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_during_save_leaves_previous_loadable(tmp_path, seed):
    rng = random.Random(seed)
    path = str(tmp_path / "ck")
    victim, delay = rng.randrange(2), rng.uniform(0.0, 0.4)
    outcomes = run_isolated(2, _save_then_die, path, victim, delay, 20000, timeout=60,
                            env={"SBPFLOW_TIMEOUT": "3"})
    assert outcomes[victim].status != "ok", outcomes  # it really died mid-run
    ck = sbpflow.load(path)
    step = ck["step"]
    w0 = torch.randn(20000, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ck["w"].full(), w0 * max(step, 1)), step


def test_torch_and_safetensors_files(tmp_path):
    t = torch.nn.Linear(4, 3)
    torch.save(t.state_dict(), tmp_path / "m.pt")
    ck = sbpflow.load(tmp_path / "m.pt")
    assert torch.equal(ck["weight"].to_torch(), t.weight.detach())
    sd = {"a": sbpflow.ones(2, 3), "b": sbpflow.tensor([1, 2])}
    sbpflow.save(sd, tmp_path / "x.safetensors")
    back = sbpflow.load(tmp_path / "x.safetensors")
    assert torch.equal(back["a"].to_torch(), torch.ones(2, 3))
    sbpflow.save(sd, tmp_path / "x.pt")
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["b"], torch.tensor([1, 2]))
    with pytest.raises(FileNotFoundError, match="no complete sbpflow checkpoint"):
        os.makedirs(tmp_path / "empty")
        sbpflow.load(tmp_path / "empty")
    with pytest.raises(TypeError, match="cannot store a set"):
        sbpflow.save({"x": {1, 2}}, tmp_path / "bad")
    with pytest.raises(TypeError, match="flat dict of tensors"):
        sbpflow.save({"x": {"y": sbpflow.ones(1)}}, tmp_path / "nested.safetensors")


def test_torch_state_dict_into_sbpflow_module_and_back(tmp_path):
    torch.manual_seed(0)
    t = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    torch.save(t.state_dict(), tmp_path / "t.pt")
    s = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    s.load_state_dict(sbpflow.load(tmp_path / "t.pt"))
    x = torch.randn(2, 4)
    assert np.allclose(s(sbpflow.tensor(x)).numpy(), t(x).detach().numpy(), atol=1e-6)
    sbpflow.save(s.state_dict(), tmp_path / "s.safetensors")  # export back to torch
    t2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    from safetensors.torch import load_file

    t2.load_state_dict(load_file(tmp_path / "s.safetensors"))
    assert torch.equal(t2[0].weight, t[0].weight)


# ------------------------------------------------- matched by name, agreement, damage
def _layout_values() -> dict[str, torch.Tensor]:
    """Plain torch values of the tensors of :func:`_rank_state` (the oracle)."""
    g = torch.Generator().manual_seed(11)
    v = {name: torch.randn(5, 3, generator=g) for name in ("s0", "s1", "b1", "b2", "b3")}
    v["p1"] = torch.randn(5, 3, generator=g)
    v["p2"] = torch.randn(5, 3, generator=g)
    for k in ("p1", "p2"):  # the global value of a P tensor whose summands are x and 2x
        v[k] = v[k] + 2 * v[k]
    v["ids"] = torch.arange(6)
    v["local"] = torch.randn(2, 2, generator=g)
    return v


def _rank_state():
    """A state with S, B and P tensors (same shapes, so a mix-up cannot show as a shape
    error), nested dicts, int keys and a list, with the same keys on every rank but
    inserted in a rank-dependent order (as a dict built from a set would be)."""
    rank = sbpflow.distributed.get_rank()
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(11)
    raw = {name: torch.randn(5, 3, generator=g) for name in ("s0", "s1", "b1", "b2", "b3")}
    raw["p1"] = torch.randn(5, 3, generator=g)
    raw["p2"] = torch.randn(5, 3, generator=g)
    t = {"s0": sbpflow.tensor(raw["s0"], placement=pl, sbp=S0),
         "s1": sbpflow.tensor(raw["s1"], placement=pl, sbp=S1),
         **{k: sbpflow.tensor(raw[k], placement=pl, sbp=B) for k in ("b1", "b2", "b3")},
         **{k: sbpflow.tensor(raw[k] * (rank + 1)).to_global(pl, P) for k in ("p1", "p2")},
         "ids": sbpflow.tensor(torch.arange(6), placement=pl, sbp=S0),
         "local": sbpflow.tensor(_layout_values()["local"])}
    names = ["s0", "s1", "b1", "b2", "b3", "ids"]
    random.Random(rank).shuffle(names)
    model = {name: t[name] for name in names}
    state = [(1, {"p": t["p1"]}), (0, {"local": t["local"], "p": t["p2"]})]
    items = [("model", model), ("optim", {"state": dict(state), "groups": ["x", 3]}),
             ("step", 4)]
    if rank % 2:
        state.reverse()
        items.reverse()
        items[1] = ("optim", {"groups": ["x", 3], "state": dict(state)})
    return dict(items), names


def _flatten_loaded(ck) -> dict:
    out = dict(ck["model"])
    out["p1"], out["p2"] = ck["optim"]["state"][1]["p"], ck["optim"]["state"][0]["p"]
    out["local"] = ck["optim"]["state"][0]["local"]
    return out


def _save_in_rank_order(path):
    state, names = _rank_state()
    sbpflow.save(state, path)
    pl = sbpflow.placement.all("cpu")
    # read back on 2 ranks as another layout: this rank's S(1) (1-D: S(0)) shard of each
    return {n: st.to_global(pl, S1 if st.ndim == 2 else S0).to_local().to_torch()
            for n, st in _flatten_loaded(sbpflow.load(path)).items()}, names


def test_key_order_differing_per_rank_loads_back_exactly(dist_run, tmp_path):
    """Regression (issue 10, item 1): pieces were matched by position, so ranks that built
    the dict in different orders stored and read shards of different tensors."""
    path = str(tmp_path / "ck")
    (shards0, names0), (shards1, names1) = dist_run(2, _save_in_rank_order, path)
    assert names0 != names1  # the ranks really built their dicts in different orders
    want = _layout_values()
    assert len(shards0) == len(shards1) == len(want) == 9
    for rank, shards in enumerate((shards0, shards1)):
        for n, v in shards.items():
            nd = (S1,) if want[n].ndim == 2 else (S0,)
            sl = sbpflow.shard_slices(tuple(want[n].shape), (2,), nd, (rank,))
            assert torch.equal(v, want[n][tuple(sl)]), (rank, n)
    ck = sbpflow.load(path)  # one process, no process group: whole values
    for n, st in _flatten_loaded(ck).items():
        assert torch.equal(st.full(), want[n]), n
    assert ck["optim"]["groups"] == ["x", 3] and ck["step"] == 4


def test_paths_are_unambiguous(tmp_path):
    """Keys that would collide in a naive "a/b" or str(key) encoding get distinct paths."""
    tree = {"a": {"b": torch.tensor([1.0])}, "a/b": torch.tensor([2.0]),
            0: torch.tensor([3.0]), "0": torch.tensor([4.0]), None: torch.tensor([5.0]),
            (1, "x"): torch.tensor([6.0]), "": torch.tensor([7.0]),
            "#None": torch.tensor([8.0]), "l": [torch.tensor([9.0])], "%2F": torch.tensor([10.0]),
            "__metadata__": torch.tensor([11.0])}
    sbpflow.save(tree, tmp_path / "ck")
    meta = json.load(open(tmp_path / "ck" / "v000001" / "meta.json"))
    assert sorted(meta["tensors"]) == sorted(
        ["a/b", "a%2Fb", "0", "%30", "#None", "#(1, 'x')", "#''", "%23None", "l/0", "%252F",
                "%5F_metadata__"])
    back = sbpflow.load(tmp_path / "ck")
    flat = {"a.b": back["a"]["b"], "l.0": back["l"][0],
            **{k: v for k, v in back.items() if k not in ("a", "l")}}
    want = {"a.b": 1, "a/b": 2, 0: 3, "0": 4, None: 5, (1, "x"): 6, "": 7, "#None": 8,
            "l.0": 9, "%2F": 10, "__metadata__": 11}
    assert {k: float(v.full()) for k, v in flat.items()} == want


def _save_mismatched(path, case):
    """Save one good version, then a state that differs on rank 1 as ``case`` says;
    return (exception type, message) of the second save on this rank."""
    from sbpflow.checkpoint import CheckpointError

    rank = sbpflow.distributed.get_rank()
    pl = sbpflow.placement.all("cpu")
    good = {"w": sbpflow.zeros(4, 6, placement=pl, sbp=S0),
            "v": sbpflow.zeros(4, placement=pl, sbp=B), "step": 1}
    sbpflow.save(good, path)
    state = dict(good)
    if rank == 1:
        if case == "shape":
            state["w"] = sbpflow.zeros(4, 8, placement=pl, sbp=S0)
        elif case == "dtype":
            state["v"] = sbpflow.zeros(4, placement=pl, sbp=B, dtype=torch.float64)
        elif case == "sbp":
            state["w"] = sbpflow.zeros(4, 6, placement=pl, sbp=S1)
        elif case == "key":
            state["extra"] = sbpflow.zeros(2, placement=pl, sbp=B)
        elif case == "unstorable":
            state["bad"] = {1, 2}
    try:
        sbpflow.save(state, path)
    except (CheckpointError, TypeError) as e:
        return type(e).__name__, str(e)
    return None, "saved"


@pytest.mark.parametrize("case,names,words", [
    ("shape", ["'w'", "shape"], ["(4, 6)", "(4, 8)"]),
    ("dtype", ["'v'", "dtype"], ["float32", "float64"]),
    ("sbp", ["'w'", "sbp"], ["S(0)", "S(1)"]),
    ("key", ["'extra'", "only on ranks [1]"], ["missing on ranks [0]"]),
])
def test_save_raises_on_every_rank_when_ranks_disagree(dist_run, tmp_path, case, names, words):
    path = tmp_path / "ck"
    out = dist_run(2, _save_mismatched, str(path), case)
    for kind, msg in out:  # every rank raises, naming the path and what each rank has
        assert kind == "CheckpointMismatchError", out
        for w in names + words:
            assert w in msg, (w, msg)
    # nothing committed: LATEST still names the first version, no second one, no temp
    assert (path / "LATEST").read_text().strip() == "v000001"
    assert sorted(os.listdir(path)) == [".lock", "LATEST", "v000001"]


def test_save_unstorable_leaf_on_one_rank_raises_everywhere(dist_run, tmp_path):
    (k0, m0), (k1, m1) = dist_run(2, _save_mismatched, str(tmp_path / "ck"), "unstorable")
    assert "cannot store a set" in m1, m1
    assert k1 == "TypeError" and k0 == "CheckpointError" and "rank 1" in m0, (m0, m1)
    assert sorted(os.listdir(tmp_path / "ck")) == [".lock", "LATEST", "v000001"]


def _save_two_versions(path):
    pl = sbpflow.placement.all("cpu")
    for step in (1, 2):
        v = _values(float(step))
        state = {"model": {"w_rows": sbpflow.tensor(v["w_rows"], placement=pl, sbp=S0),
                           "w_rep": sbpflow.tensor(v["w_rep"], placement=pl, sbp=B),
                           "w_part": sbpflow.tensor(v["w_part"], placement=pl, sbp=S1)},
                 "step": step}
        sbpflow.save(state, path, keep=2)
    return "ok"


@pytest.fixture(scope="module")
def two_versions(dist_pools, tmp_path_factory):
    """A checkpoint saved by 2 ranks: v000001 (values * 1, step 1), v000002 (* 2, step 2)."""
    path = tmp_path_factory.mktemp("two") / "ck"
    dist_pools(2, _save_two_versions, str(path))
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _flip_data_bytes(file, n=64):
    raw = bytearray(open(file, "rb").read())
    start = 8 + int.from_bytes(raw[:8], "little")  # safetensors: header length, header, data
    assert len(raw) - start >= n + 16, len(raw)
    for i in range(start + 16, start + 16 + n):
        raw[i] ^= 0xFF
    open(file, "wb").write(bytes(raw))


def _check_values(ck, scale):
    assert ck["step"] == int(scale)
    for k, st in ck["model"].items():
        assert torch.equal(st.full(), _values(scale)[k]), k


def _damage(path, how):
    v2 = path / "v000002"
    if how == "flip":
        _flip_data_bytes(v2 / "rank-00001.safetensors")
        return "rank-00001.safetensors", "sha256"
    if how == "truncate":
        f = v2 / "rank-00000.safetensors"
        os.truncate(f, os.path.getsize(f) // 2)
        return "rank-00000.safetensors", "bytes"
    if how == "meta":
        raw = (v2 / "meta.json").read_bytes()
        (v2 / "meta.json").write_bytes(raw[:-7] + b"garbage")
        return "meta.json", "sha256"
    if how == "meta-unparsable":
        (v2 / "meta.json").write_bytes(b"{not json")
        (v2 / "meta.json.sha256").unlink()
        return "meta.json", "not valid JSON"
    if how == "missing-version":
        import shutil

        shutil.rmtree(v2)
        return "v000002", "missing"
    if how == "latest-garbage":
        (path / "LATEST").write_bytes(b"\x00\x13garbage")
        return "LATEST", "damaged"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flip", "truncate", "meta", "meta-unparsable",
                                 "missing-version", "latest-garbage"])
def test_damaged_newest_version_falls_back_with_warning(two_versions, tmp_path, how):
    """Regression (issue 10, item 5): flipped data bytes loaded silently, parse errors did
    not name the file, LATEST naming a missing version offered no fallback."""
    from sbpflow.checkpoint import CheckpointError, CheckpointFallbackWarning

    path = _copy(two_versions, tmp_path / "ck")
    _check_values(sbpflow.load(path), 2.0)  # intact: the newest version, no warning
    fname, what = _damage(path, how)
    # the newest intact version older than LATEST's; if LATEST itself is damaged, the
    # newest intact version (v000002 is intact then)
    used = "v000002" if how == "latest-garbage" else "v000001"
    with pytest.warns(CheckpointFallbackWarning) as rec:
        ck = sbpflow.load(path)
    msg = str(rec[0].message)
    assert fname in msg and what in msg and f"{used} instead" in msg, msg
    _check_values(ck, float(used[-1]))
    with pytest.raises(CheckpointError, match=fname) as exc:
        sbpflow.load(path, fallback=False)
    assert what in str(exc.value) and f"fallback=True would try {used}" in str(exc.value)


def _load_damaged_on_ranks(path):
    import warnings

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ck = sbpflow.load(path)
    pl = sbpflow.placement.all("cpu")
    w = ck["model"]["w_rows"].to_global(pl, S0)
    return int(ck["step"]), [str(r.message) for r in rec], w.numpy()


def test_damaged_version_same_decision_on_every_rank(dist_run, two_versions, tmp_path):
    path = _copy(two_versions, tmp_path / "ck")
    _flip_data_bytes(path / "v000002" / "rank-00000.safetensors")
    out = dist_run(2, _load_damaged_on_ranks, str(path))
    for step, msgs, w in out:
        assert step == 1 and len(msgs) == 1 and "rank-00000.safetensors" in msgs[0], msgs
        assert np.array_equal(w, _values(1.0)["w_rows"].numpy())


def test_no_intact_version_names_each(two_versions, tmp_path):
    from sbpflow.checkpoint import CheckpointError

    path = _copy(two_versions, tmp_path / "ck")
    _flip_data_bytes(path / "v000002" / "rank-00001.safetensors")
    os.truncate(path / "v000001" / "rank-00000.safetensors", 100)
    with pytest.raises(CheckpointError, match="no intact checkpoint version") as exc:
        sbpflow.load(path)
    msg = str(exc.value)
    assert "v000002: " in msg and "v000002/rank-00001.safetensors does not match" in msg, msg
    assert "v000001: " in msg and "v000001/rank-00000.safetensors has 100 bytes" in msg, msg


def test_damaged_single_files_name_the_file(tmp_path):
    from sbpflow.checkpoint import CheckpointError

    sd = {"a": sbpflow.ones(64, 3)}
    sbpflow.save(sd, tmp_path / "x.safetensors")
    sbpflow.save(sd, tmp_path / "x.pt")
    for name in ("x.safetensors", "x.pt"):
        f = tmp_path / name
        os.truncate(f, os.path.getsize(f) // 2)
        with pytest.raises(CheckpointError, match=re.escape(str(f))):
            sbpflow.load(f)


def test_held_lock_makes_save_raise(tmp_path):
    import fcntl

    from sbpflow.checkpoint import CheckpointLockedError

    path = tmp_path / "ck"
    sbpflow.save({"w": sbpflow.ones(3)}, path)
    with open(path / ".lock", "a+") as f:  # another job's save, mid-way
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("pid 4242 on elsewhere\n")
        f.flush()
        with pytest.raises(CheckpointLockedError, match=f"another save into '{path}'") as e:
            sbpflow.save({"w": sbpflow.zeros(3)}, path)
        assert "pid 4242 on elsewhere" in str(e.value)
    assert sorted(os.listdir(path)) == [".lock", "LATEST", "v000001"]
    sbpflow.save({"w": sbpflow.zeros(3)}, path)  # released: saves again
    assert torch.equal(sbpflow.load(path)["w"].full(), torch.zeros(3))


def _save_expect_locked(path):
    from sbpflow.checkpoint import CheckpointLockedError

    try:
        sbpflow.save({"w": sbpflow.ones(4, placement=sbpflow.placement.all("cpu"), sbp=S0)},
                     path)
    except CheckpointLockedError as e:
        return str(e)
    return "saved"


def test_held_lock_makes_every_rank_raise(dist_run, tmp_path):
    import fcntl

    path = tmp_path / "ck"
    os.makedirs(path)
    with open(path / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = dist_run(2, _save_expect_locked, str(path))
    for msg in out:
        assert f"another save into '{path}'" in msg, out
    assert sorted(os.listdir(path)) == [".lock"]


def test_format_1_checkpoint_still_loads(tmp_path):
    """A checkpoint as sbpflow wrote it before checksums (positional keys t0, t1...)."""
    from safetensors.torch import save_file

    v = _values()
    folder = tmp_path / "ck" / "v000001"
    os.makedirs(folder)
    save_file({"t0": v["w_rows"][:5].contiguous(), "t1": v["w_rep"]},
              str(folder / "rank-00000.safetensors"))
    save_file({"t0": v["w_rows"][5:].contiguous()}, str(folder / "rank-00001.safetensors"))
    meta = {"format": "sbpflow-checkpoint", "version": 1, "world_size": 2,
            "tree": {"__dict__": [["w", {"__tensor__": 0}], ["r", {"__tensor__": 1}],
                                  ["step", 3]]},
            "tensors": [{"shape": [10, 6], "dtype": "float32", "pieces": [
                {"rank": 0, "key": "t0", "ranges": [[0, 5], [0, 6]]},
                {"rank": 1, "key": "t0", "ranges": [[5, 10], [0, 6]]}]},
                {"shape": [4, 4], "dtype": "float32", "pieces": [
                    {"rank": 0, "key": "t1", "ranges": [[0, 4], [0, 4]]}]}]}
    (folder / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ck" / "LATEST").write_text("v000001\n")
    with pytest.warns(UserWarning, match="format 1.*no checksums"):
        ck = sbpflow.load(tmp_path / "ck")
    assert ck["step"] == 3
    assert torch.equal(ck["w"].full(), v["w_rows"]) and torch.equal(ck["r"].full(), v["w_rep"])
