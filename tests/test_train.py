"""``sbpflow train`` and ``sbpflow.datasets``.

* Datasets: the Shakespeare play split (one edition per work, whole plays held out, no
  overlap), tokeniser round trips, text/image batches as pure functions of (seed, step),
  digits split sizes, an ImageFolder directory, text files and folders.
* The command, run as a user runs it (``python -m sbpflow.cli train``, which launches its
  ranks through torchrun) on a tiny GPT registered by ``tests/_train_models.py``
  (``--plugin``): DP=2 (with gradient accumulation), TP=2 and DP2 x TP2 on 4 ranks follow
  the one-process plain-PyTorch run of the same model, seed and data within 1e-3; a run
  killed with SIGKILL after a checkpoint and resumed gives the uninterrupted losses
  within 1e-6; the outputs (metrics.jsonl, loss.png, checkpoints, sample) exist.
* Bad arguments fail with messages that name the problem.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sbpflow import datasets as ds
from sbpflow import train

REPO = Path(__file__).resolve().parents[1]
PLUGIN = str(REPO / "tests" / "_train_models.py")
RUN_TIMEOUT_S = 300.0
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")

# The tiny GPT run the curve tests share: 10 steps, global batch 8 windows of 16 chars.
STEPS, BATCH, BLOCK, SEED, LR = 10, 8, 16, 3, 3e-3
RUN_ARGS = ["test-gpt", "--steps", str(STEPS), "--batch-size", str(BATCH), "--seed", str(SEED),
            "--lr", str(LR), "--warmup", "2", "--block-size", str(BLOCK), "--eval-every", "5",
            "--eval-batches", "2", "--sample-tokens", "20"]


# ----------------------------------------------------------------------------- helpers
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["SBPFLOW_TIMEOUT"] = "60"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sbpflow.cli", "train", *args, "--plugin", PLUGIN,
            "--no-progress"]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(_cmd(args), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Process ids of every descendant of ``pid`` (torchrun starts each rank in a session
    of its own, so killing the launcher's process group does not reach the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank it started."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_run(proc)
        out, _ = proc.communicate()
        pytest.fail(f"sbpflow train did not finish within {timeout:.0f}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-6000:]}"
    return out


def _run(args: list[str]) -> str:
    return _finish(_start(args))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


@functools.lru_cache
def _torch_curve(accum: int = 1, steps: int = STEPS) -> tuple[float, ...]:
    """The oracle: the same GPT, data, AdamW groups, LR schedule and clipping in plain
    PyTorch on one process; the global batch in ``accum`` micro-batches (with dropout the
    masks are drawn per micro-batch, so the split matters)."""
    sys.path.insert(0, str(REPO / "tests"))
    import _train_models

    from sbpflow import models

    text = ds.load_text()
    tok = ds.make_tokenizer("char", text.train)
    tokens = tok.encode(text.train)
    torch.manual_seed(SEED)
    cfg = models.get("test-gpt").config
    m = _train_models.build("gpt", type(cfg)(**{**cfg.__dict__, "vocab_size": tok.vocab_size,
                                                 "block_size": BLOCK}), "torch")
    decay = [p for p in m.parameters() if p.ndim >= 2]
    rest = [p for p in m.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: train.lr_lambda(s, 2, steps, 0.1))
    out = []
    for step in range(steps):
        x, y = ds.text_batch(tokens, BATCH, BLOCK, SEED, "train", step)
        losses = []
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            _, loss = m(xm, ym)
            (loss / accum).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(sum(losses) / accum)
    return tuple(out)


@pytest.fixture(scope="module")
def torch_curve() -> tuple[float, ...]:
    return _torch_curve()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Path:
    """The uninterrupted TP=2 run (checkpoints every 2 steps), shared by two tests."""
    out = tmp_path_factory.mktemp("tp_run")
    _run([*RUN_ARGS, "--nproc-per-node", "2", "--ckpt-every", "2", "--out", str(out)])
    return out


def _close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {step}: {a} vs {b}\n{got}\n{want}"


# ----------------------------------------------------------------------------- datasets
def test_shakespeare_split_whole_plays_no_overlap():
    works = ds.shakespeare_works()
    assert len(works) == 42 and not any(n.endswith("_f") for n in works)
    text = ds.load_text()
    assert set(text.train_parts).isdisjoint(text.val_parts)
    assert set(text.val_parts) == set(ds.SHAKESPEARE_VAL_PLAYS)
    assert set(text.train_parts) | set(text.val_parts) == set(works)
    frac = len(text.val) / (len(text.train) + len(text.val))
    assert 0.08 < frac < 0.12, frac
    # a line of each held-out play is in validation only
    for line in ("To be, or not to be", "Out, damned spot", "such stuff\nAs dreams are made on",
                 "If music be the food of love"):
        assert line in text.val and line not in text.train, line
    assert "PROJECT GUTENBERG" not in text.train.upper()


def test_strip_gutenberg():
    raw = ("The Project Gutenberg EBook of X\r\nlicence\r\n*** START OF THIS PROJECT GUTENBERG "
           "EBOOK X ***\r\nACT I.\r\nWords.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
           "more licence\r\n")
    assert ds.strip_gutenberg(raw) == "ACT I.\nWords.\n"
    assert ds.strip_gutenberg("no markers\n\n") == "no markers\n"


def test_tokenizers_round_trip():
    text = ds.load_text()
    tok = ds.make_tokenizer("char", text.train)
    assert tok.vocab_size == len(set(text.train)) + 1 and tok.unk_id == tok.vocab_size - 1
    part = text.train[:5000]
    ids = tok.encode(part)
    assert ids.dtype == torch.int64 and ids.shape == (len(part),)
    assert tok.decode(ids) == part
    assert tok.encode("a\u00e9b").tolist()[1] == tok.unk_id  # unseen character
    byte = ds.make_tokenizer("byte", "")
    s = "Fair is foul, \u00e9t\u00e9 \u2014 and foul is fair\n"
    assert byte.vocab_size == 256 and byte.decode(byte.encode(s)) == s
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'"):
        ds.make_tokenizer("bpe", "")


def test_text_batch_is_a_function_of_seed_and_step():
    tokens = torch.arange(1000)
    x, y = ds.text_batch(tokens, 6, 10, 0, "train", 5)
    x2, y2 = ds.text_batch(tokens, 6, 10, 0, "train", 5)
    assert x.shape == y.shape == (6, 10) and torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert not torch.equal(x, ds.text_batch(tokens, 6, 10, 0, "train", 6)[0])
    assert not torch.equal(x, ds.text_batch(tokens, 6, 10, 1, "train", 5)[0])
    with pytest.raises(ValueError, match="fewer than a window"):
        ds.text_batch(torch.arange(5), 2, 10, 0, "val", 0)


def test_mask_tokens():
    x = torch.randint(0, 50, (64, 128), generator=torch.Generator().manual_seed(0))
    inp, labels = ds.mask_tokens(x, 50, 50, seed=7)
    picked = labels != -100
    assert 0.13 < picked.float().mean() < 0.17
    assert torch.equal(labels[picked], x[picked]) and torch.equal(inp[~picked], x[~picked])
    masked = (inp == 50).float().sum() / picked.sum()
    assert 0.75 < masked < 0.85
    again = ds.mask_tokens(x, 50, 50, seed=7)
    assert torch.equal(again[0], inp) and torch.equal(again[1], labels)


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"line {i} of the text\n" for i in range(100)))
    s = ds.load_text(f)
    assert s.train + s.val == f.read_text() and s.val.startswith("line 90")
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(12):
        (folder / f"f{i:02d}.txt").write_text(f"file {i} " * 20 + "\n")
    s = ds.load_text(folder)
    assert s.val_parts == ("f11.txt",) and len(s.train_parts) == 11
    with pytest.raises(FileNotFoundError, match="no such file"):
        ds.load_text(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt file"):
        ds.load_text(tmp_path / "empty")


def test_digits_split():
    d = ds.load_digits()
    assert d.train_x.shape == (1497, 1, 8, 8) and d.val_x.shape == (300, 1, 8, 8)
    assert d.train_y.shape == (1497,) and d.num_classes == 10
    assert abs(float(d.train_x.mean())) < 1e-4 and abs(float(d.train_x.std()) - 1) < 1e-2
    # fixed split: the same on every call, and no image is in both parts
    assert torch.equal(ds.load_digits().val_x, d.val_x)
    tr = {tuple(r) for r in d.train_x.flatten(1).numpy().round(4).tolist()}
    va = {tuple(r) for r in d.val_x.flatten(1).numpy().round(4).tolist()}
    assert len(tr & va) < 5  # sklearn's digits hold a few pixel-identical scans
    idx = ds.image_batch(1497, 64, 0, 0)
    assert idx.shape == (64,) and torch.equal(idx, ds.image_batch(1497, 64, 0, 0))
    epoch = torch.cat([ds.image_batch(1497, 64, 0, s) for s in range(1497 // 64)])
    assert len(set(epoch.tolist())) == len(epoch)  # an epoch draws without replacement


def test_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for i in range(12):
            arr = rng.integers(0, 255, (10, 14, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / c / f"{i:02d}.png")
    s = ds.load_image_folder(tmp_path, size=8)
    assert s.classes == ("cat", "dog")
    assert s.train_x.shape == (22, 3, 8, 8) and s.val_x.shape == (2, 3, 8, 8)
    assert s.val_y.tolist() == [0, 1]
    with pytest.raises(FileNotFoundError, match="no such folder"):
        ds.load_image_folder(tmp_path / "nope")


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("args, match", [
    (["nope"], "no model 'nope'; known models"),
    (["test-gpt", "--nproc-per-node", "2", "--dp", "2", "--tp", "2"],
     r"--dp 2 x --tp 2 = 4 ranks, but the world has 2"),
    (["test-gpt", "--nproc-per-node", "4", "--tp", "3"], "--tp 3 does not divide"),
    (["test-gpt", "--data", "/no/such/path"], "--data '/no/such/path': no such file"),
    (["test-gpt", "--batch-size", "10", "--grad-accum", "3"], "not divisible by --grad-accum"),
    (["test-cnn", "--tp", "2"], "has no tensor-parallel plan"),
    (["test-cnn", "--data", __file__], "give an ImageFolder directory"),
    (["test-gpt", "--steps", "0"], "expected a positive integer"),
    (["test-gpt", "--config", "nlayer"], "expected KEY=VALUE"),
])
def test_bad_arguments(args, match, capsys, monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--plugin", PLUGIN, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert __import__("re").search(match, err), err


def test_resume_without_checkpoint(capsys, monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit):
        train.main(["test-gpt", "--plugin", PLUGIN, "--out", str(tmp_path), "--resume"])
    assert "--resume: no checkpoint in" in capsys.readouterr().err


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--nproc-per-node", "--dp", "--tp", "--steps", "--batch-size", "--grad-accum",
                "--lr", "--warmup", "--weight-decay", "--amp", "--seed", "--data", "--out",
                "--eval-every", "--ckpt-every", "--resume"):
        assert opt in out, opt


def test_lr_schedule():
    lrs = [train.lr_lambda(s, 10, 100, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[99] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


# ----------------------------------------------------------------------------- the command
def test_dp2_with_grad_accum_follows_torch_and_writes_outputs(tmp_path):
    out = tmp_path / "dp"
    log = _run([*RUN_ARGS, "--nproc-per-node", "2", "--dp", "2", "--grad-accum", "2",
                "--ckpt-every", "5", "--out", str(out)])
    rows = _metrics(out)
    _close([r["loss"] for r in rows], _torch_curve(accum=2), 1e-3, "dp2 accum2")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(r) >= {"step", "loss", "lr", "samples_per_s"} and r["samples_per_s"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [5, 10]
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "ckpt" / "LATEST").read_text().strip() == "v000002"
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["dp"], cfg["tp"], cfg["grad_accum"], cfg["data"]["source"]) == (
        2, 1, 2, "shakespeare")
    assert len((out / "sample.txt").read_text()) >= 20
    assert "--- sample" in log and "val_loss" in log


def test_tp2_follows_torch(tp_run, torch_curve):
    _close([r["loss"] for r in _metrics(tp_run)], torch_curve, 1e-3, "tp2")
    assert json.loads((tp_run / "config.json").read_text())["tp"] == 2


def test_dp2_tp2_on_4_ranks_follows_torch(tmp_path, torch_curve):
    out = tmp_path / "dp_tp"
    _run([*RUN_ARGS, "--nproc-per-node", "4", "--dp", "2", "--tp", "2", "--out", str(out)])
    _close([r["loss"] for r in _metrics(out)], torch_curve, 1e-3, "dp2 x tp2")
    assert json.loads((out / "config.json").read_text())["mesh"] == [2, 2]


def test_sigkill_after_checkpoint_then_resume_is_exact(tp_run, tmp_path):
    out = tmp_path / "killed"
    args = [*RUN_ARGS, "--nproc-per-node", "2", "--ckpt-every", "2", "--out", str(out)]
    proc = _start(args)
    latest = out / "ckpt" / "LATEST"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not latest.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_run(proc)
            pytest.fail(f"no checkpoint appeared:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.02)
    alive = proc.poll() is None
    _kill_run(proc)  # the launcher and both ranks, mid-run
    proc.communicate()
    assert alive, "the run finished before it could be killed"
    done = len(_metrics(out))
    assert done < STEPS
    _run([*args, "--resume"])
    want = [r["loss"] for r in _metrics(tp_run)]
    got = [r["loss"] for r in _metrics(out)]
    _close(got, want, 1e-6, f"resumed (killed after step {done})")
    assert [r["step"] for r in _metrics(out)] == list(range(1, STEPS + 1))


# ----------------------------------------------------------------------------- in a rank
def _train_in_rank(args: list[str]) -> list[dict]:
    """``sbpflow train`` as one rank of the pool's world (RANK/WORLD_SIZE are set, so it
    runs in place, launching nothing); returns rank 0's metrics."""
    from sbpflow import distributed as sd

    train.main([*args, "--plugin", PLUGIN, "--no-progress"])
    if sd.get_rank() != 0:
        return []
    out = Path(args[args.index("--out") + 1])
    return _metrics(out)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp(dist_run, tmp_path, amp):
    rows = dist_run(1, _train_in_rank, ["test-gpt", "--steps", "4", "--batch-size", "4",
                                        "--block-size", "16", "--amp", amp, "--sample-tokens",
                                        "0", "--out", str(tmp_path)], timeout=300)[0]
    assert len(rows) == 4 and all(np.isfinite(r["loss"]) for r in rows)
    ref = _torch_curve()[:1]  # same init and data: the first loss agrees to AMP precision
    assert abs(rows[0]["loss"] - ref[0]) < 0.05 * ref[0]


def test_images_digits_dp(dist_run, tmp_path):
    rows = dist_run(2, _train_in_rank, ["test-cnn", "--steps", "6", "--batch-size", "32",
                                        "--eval-every", "3", "--out", str(tmp_path)],
                    timeout=300)[0]
    evals = [r for r in rows if "val_acc" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(0.0 <= r["val_acc"] <= 1.0 for r in evals)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["data"]["source"] == "sklearn digits" and cfg["data"]["train_images"] == 1497


def _autocast_mixed_matmul():
    import sbpflow
    from sbpflow.sbp import split

    pl = sbpflow.placement.all("cpu")
    a = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    b = torch.randn(4, 8, 5, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = a @ b
    ga = sbpflow.tensor(a, placement=pl, sbp=split(0))
    gb = sbpflow.tensor(b, placement=pl, sbp=split(0))
    with sbpflow.autocast("cpu", dtype=torch.bfloat16):
        got = ga @ gb
    assert got.dtype == torch.bfloat16
    assert torch.equal(torch.as_tensor(got.float().numpy()), want.float())


def test_autocast_matmul_of_mixed_float_dtypes_on_global_tensors(dist_run):
    """Regression (found by ``--amp bf16``: attention's fp32 probabilities @ bf16 values):
    the global op's meta inference must accept what autocast accepts."""
    dist_run(2, _autocast_mixed_matmul)


def _save_tied(path):
    import sbpflow
    from sbpflow.sbp import split

    pl = sbpflow.placement.all("cpu")
    w = sbpflow.randn(6, 4, placement=pl, sbp=split(0))
    sbpflow.save({"wte.weight": w, "lm_head.weight": w, "local": w.to_local()}, path)
    back = sbpflow.load(path)
    want = w.numpy()
    for k in ("wte.weight", "lm_head.weight"):
        assert np.array_equal(back[k].numpy(), want), k


def test_checkpoint_of_tied_weights(dist_run, tmp_path):
    """Regression: a tensor under two names (GPT's tied embedding and head) shares memory,
    which safetensors refuses; sbpflow.save writes each name its own copy."""
    dist_run(2, _save_tied, str(tmp_path / "ckpt"))


# ------------------------------------------------------- the zoo's gpt-mini, 50 steps
ZOO_STEPS, ZOO_BLOCK, ZOO_LR = 50, 32, 1e-3
ZOO_ARGS = ["gpt-mini", "--steps", str(ZOO_STEPS), "--batch-size", str(BATCH), "--seed",
            str(SEED), "--lr", str(ZOO_LR), "--warmup", "2", "--block-size", str(ZOO_BLOCK),
            "--eval-every", "25", "--eval-batches", "1", "--sample-tokens", "8"]


@functools.lru_cache
def _zoo_torch_curve() -> tuple[float, ...]:
    """``gpt-mini`` as plain torch (the same model file, ``spec.build_torch``), same data,
    AdamW groups, schedule and clipping as ``sbpflow train``, on one process."""
    from sbpflow import models

    text = ds.load_text()
    tok = ds.make_tokenizer("char", text.train)
    tokens = tok.encode(text.train)
    torch.manual_seed(SEED)
    m = models.get("gpt-mini").build_torch(vocab_size=tok.vocab_size)  # block 128, used 32
    decay = [p for p in m.parameters() if p.ndim >= 2]
    rest = [p for p in m.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=ZOO_LR,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: train.lr_lambda(s, 2, ZOO_STEPS, 0.1))
    out = []
    for step in range(ZOO_STEPS):
        x, y = ds.text_batch(tokens, BATCH, ZOO_BLOCK, SEED, "train", step)
        _, loss = m(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(loss.item())
    return tuple(out)


@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", [("2", "2", "1"), ("2", "1", "2"), ("4", "2", "2")])
def test_zoo_gpt_mini_50_steps_follow_torch(tmp_path, layout):
    nproc, dp, tp = layout
    out = tmp_path / f"dp{dp}tp{tp}"
    args = [a for a in ZOO_ARGS if a != "--plugin"]
    cmd = [sys.executable, "-m", "sbpflow.cli", "train", *args, "--no-progress",
           "--nproc-per-node", nproc, "--dp", dp, "--tp", tp, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _finish(proc, timeout=900)
    _close([r["loss"] for r in _metrics(out)], list(_zoo_torch_curve()), 1e-3,
           f"gpt-mini dp{dp} x tp{tp}")
