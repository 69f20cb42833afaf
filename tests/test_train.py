"""``sbpflow train`` and ``sbpflow.apps.datasets``.

* Datasets: the Shakespeare play split (one edition per work, whole plays held out, no
  overlap), tokeniser round trips, text/image batches as pure functions of (seed, step),
  digits split sizes, an ImageFolder directory, text files and folders.
* The command, run as a user runs it (``python -m sbpflow.cli train``, which launches its
  ranks through torchrun) on a tiny GPT registered by ``tests/_train_models.py``
  (``--plugin``): DP=2 (with gradient accumulation), TP=2 and DP2 x TP2 on 4 ranks follow
  the one-process plain-PyTorch run of the same model, seed and data within 1e-3; a run
  killed with SIGKILL after a checkpoint and resumed gives the uninterrupted losses
  within 1e-6; the outputs (metrics.jsonl, loss.png, checkpoints, sample) exist;
  checkpoints by default every tenth of the run; SIGINT to the launcher (SIGTERM to a
  1-process run) saves the step it stops at (no second version of a step) and names the
  command that continues, which does.
* Bad arguments fail with messages that name the problem; so does everything that used
  to fail late or train on nonsense (a validation text shorter than one window, --lr inf,
  a negative --min-lr-ratio, --temperature 0, ...), before any rank starts; --resume
  with another seed, batch size, block size, tokenizer or model config than the
  checkpoint's fails before step 1 (in the launching process and in the trainer).
* Nothing lost, nothing silently wrong: the final checkpoint survives a failed final
  evaluation and --resume finishes the run; a torn last metrics line is dropped on
  resume; metrics.jsonl is standard JSON (null for a non-finite value); a NaN loss stops
  an fp32 run at once, an fp16 run after the GradScaler skipped several steps in a row;
  val_loss of the same weights does not change with --grad-accum; a run without a
  checkpoint is pointed to --overwrite, not told to --resume.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _procs import command_env, descendants, finish, kill_all

from sbpflow.apps import datasets as ds
from sbpflow.apps import train

REPO = Path(__file__).resolve().parents[1]
PLUGIN = str(REPO / "tests" / "_train_models.py")
RUN_TIMEOUT_S = 300.0

# The tiny GPT run the curve tests share: 10 steps, global batch 8 windows of 16 chars.
STEPS, BATCH, BLOCK, SEED, LR = 10, 8, 16, 3, 3e-3
RUN_ARGS = ["test-gpt", "--steps", str(STEPS), "--batch-size", str(BATCH), "--seed", str(SEED),
            "--lr", str(LR), "--warmup", "2", "--block-size", str(BLOCK), "--eval-every", "5",
            "--eval-batches", "2", "--sample-tokens", "20"]


# ----------------------------------------------------------------------------- helpers
def _env() -> dict[str, str]:
    return command_env()


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sbpflow.cli", "train", *args, "--plugin", PLUGIN,
            "--no-progress"]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(_cmd(args), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank it started."""
    kill_all([proc.pid, *descendants(proc.pid)])


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> str:
    out = finish(proc, timeout)
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
    # --pp: checked before any rank starts
    (["test-gpt", "--nproc-per-node", "3", "--pp", "2"],
     r"--pp 2 does not divide the world size 3; pick --pp among \[1, 3\]"),
    (["test-gpt", "--nproc-per-node", "4", "--pp", "2", "--dp", "2", "--tp", "2"],
     r"--dp 2 x --tp 2 x --pp 2 = 8 ranks, but the world has 4 .*make dp \* tp \* pp = 4"),
    (["test-gpt", "--nproc-per-node", "6", "--pp", "2", "--tp", "2"],
     r"--tp 2 does not divide the 3 ranks of a stage \(world 6 / --pp 2\)"),
    (["test-cnn", "--pp", "2"], r"--pp 2: test-cnn has no pipeline split .*models with one: "
                                r"\[.*'gpt-mini'.*'test-gpt'.*\]"),
    (["bert-mini", "--pp", "2"], r"--pp 2: bert-mini has no pipeline split"),
    (["test-gpt", "--pp", "3"], r"--pp 3: GPT: 2 blocks \(n_layer\) cannot fill 3 pipeline "
                                r"stages .*use at most 2 stages"),
    (["test-gpt", "--pp", "2", "--config", "n_layer=1"],
     r"--pp 2: GPT: 1 blocks \(n_layer\) cannot fill 2"),
    (["test-gpt", "--pp", "2", "--batch-size", "8", "--micro-batches", "3"],
     "not divisible by --grad-accum 3"),
    (["test-gpt", "--pp", "2", "--dp", "2", "--nproc-per-node", "4", "--batch-size", "8",
      "--micro-batches", "8"], r"a micro-batch of 1 samples cannot be split over --dp 2"),
    (["test-gpt", "--pp", "2", "--dp", "2", "--nproc-per-node", "4", "--batch-size", "12",
      "--micro-batches", "4"], r"each micro-batch of 3 samples must split evenly over --dp 2"),
    (["test-gpt", "--pp", "2", "--schedule", "interleaved", "--micro-batches", "2"],
     r"--pp 2 --virtual-stages 2: GPT: 2 blocks \(n_layer\) cannot fill 4 pipeline stages"),
    (["test-gpt", "--pp", "2", "--virtual-stages", "2"],
     r"--virtual-stages 2 is for --schedule interleaved"),
    (["test-gpt", "--pp", "2", "--schedule", "interleaved", "--micro-batches", "3",
      "--batch-size", "30", "--config", "n_layer=4"],
     r"--micro-batches 3 must be a multiple of --pp 2 .*e.g. --micro-batches 4"),
    (["test-gpt", "--schedule", "gpipe"], r"--schedule gpipe .*needs --pp 2 or more"),
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


def test_resume_of_a_run_without_checkpoint_names_what_works(capsys, monkeypatch, tmp_path):
    """A folder holding a run that stopped before its first checkpoint: --resume names
    --overwrite (it said to start without --resume, which is refused), and so does a
    fresh run (it said to continue with --resume)."""
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    for extra in (["--resume"], []):
        with pytest.raises(SystemExit) as e:
            train.main(["test-gpt", "--plugin", PLUGIN, "--out", str(tmp_path), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "metrics.jsonl (to step 1)" in err, err
        assert "start it over with --overwrite" in err, err
        assert "start without --resume" not in err and "Continue it with --resume" not in err


def test_a_run_that_stopped_before_its_first_step_is_not_a_run(tmp_path):
    """A run that failed at its start (a bad plan file, a bad calibration) left its config
    and a metrics file without a step: nothing to lose, so the same command is not told to
    add --overwrite; one step recorded, or a checkpoint folder, is a run."""
    from sbpflow.apps import _runlock

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    assert _runlock.existing_run(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    assert "to step 1" in _runlock.existing_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "ckpt").mkdir()
    assert "ckpt" in _runlock.existing_run(tmp_path)


def test_checkpoints_by_default_every_tenth_of_the_run(small_run):
    """No --ckpt-every: a checkpoint every max(1, steps // 10) steps (SMALL: 2 steps, so
    each), not only at the end."""
    assert train.default_ckpt_every(500) == 50 and train.default_ckpt_every(5) == 1
    assert sorted(p.name for p in (small_run / "ckpt").iterdir() if p.name[0] == "v") == [
        "v000001", "v000002"]


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--nproc-per-node", "--dp", "--tp", "--pp", "--schedule", "--micro-batches",
                "--steps", "--batch-size", "--grad-accum",
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


@pytest.mark.exhaustive  # 4 ranks (about 35 s); DP x TP training is in test_training.py too
def test_dp2_tp2_on_4_ranks_follows_torch(tmp_path, torch_curve):
    out = tmp_path / "dp_tp"
    _run([*RUN_ARGS, "--nproc-per-node", "4", "--dp", "2", "--tp", "2", "--out", str(out)])
    _close([r["loss"] for r in _metrics(out)], torch_curve, 1e-3, "dp2 x tp2")
    assert json.loads((out / "config.json").read_text())["mesh"] == [2, 2]


@pytest.mark.exhaustive  # 18 s; kill + resume exactness also in test_supervision's restarts
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


def _with(args: list[str], **options: str) -> list[str]:
    """``args`` with ``--name value`` for each option (``ckpt_every="0"``: ``--ckpt-every
    0``), replacing a value given already."""
    args = list(args)
    for name, value in options.items():
        opt = "--" + name.replace("_", "-")
        if opt in args:
            args[args.index(opt) + 1] = value
        else:
            args += [opt, value]
    return args


def _interrupt(args: list[str], sig: int, after: int) -> tuple[int, str, Path]:
    """Start ``sbpflow train`` (in a session of its own, as a shell starts a job: its
    ranks are in sessions of their own), send ``sig`` to its first process once
    ``metrics.jsonl`` has ``after`` lines; (exit code, output, --out)."""
    import os

    out = Path(args[args.index("--out") + 1])
    proc = _start(args)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    path = out / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= after):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_run(proc)
            pytest.fail(f"no step {after}:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.02)
    os.kill(proc.pid, sig)
    text = finish(proc, 120)
    return proc.returncode, text, out


def test_ctrl_c_saves_a_checkpoint_and_resume_continues(dist_run, tmp_path):
    """SIGINT to the launcher of a 2-rank run without interval checkpoints (--ckpt-every
    0): it is forwarded to the ranks, which finish their step, save a checkpoint of it
    together and exit 130 naming the step and the command that continues; that command
    continues (it was: no checkpoint, and --resume said to start without it)."""
    args = _with(RUN_ARGS, nproc_per_node="2", steps="400", ckpt_every="0", eval_every="0",
                 sample_tokens="0", out=str(tmp_path / "run"))
    code, text, out = _interrupt(args, __import__("signal").SIGINT, after=2)
    assert code == 130, text[-4000:]
    done = len(_metrics(out))
    assert 2 <= done < 400
    import sbpflow

    assert int(sbpflow.load(out / "ckpt")["step"]) == done
    assert f"stopped by SIGINT after step {done} of 400; saved a checkpoint of step {done} " \
        f"in {out / 'ckpt'}; continue the run with: sbpflow train test-gpt" in text, text[-3000:]
    # the launcher's last line names the same command (also where no rank could: a
    # Ctrl-C while the ranks import, a second Ctrl-C)
    last = text.strip().splitlines()[-1]
    assert "stopped by SIGINT (forwarded to the ranks, which have exited); the newest " \
        f"checkpoint in {out / 'ckpt'} is kept; continue the run with: sbpflow train " \
        "test-gpt" in last, text[-3000:]
    assert text.count("--resume") == 2 and "--steps 400" in text and "--ckpt-every 0" in text
    # (in the pool's 1-rank world: the checkpoint reshards, as it would for 2 ranks)
    code, err = dist_run(1, _train_capture, [*_with(args, steps=str(done + 2)), "--resume"],
                         timeout=300)[0]
    assert code == 0, err
    assert [r["step"] for r in _metrics(out)] == list(range(1, done + 3))


def _ctrl_c_in_start_up(args: list[str], after_a_checkpoint: bool = False):
    """:func:`_train_capture` with Ctrl-C arriving while the trainer starts (or, with
    ``after_a_checkpoint``, once a checkpoint is committed: the final evaluation)."""
    saved = train._Trainer.run

    def run(self):
        if after_a_checkpoint:
            (self.out / "ckpt" / "v000001").mkdir(parents=True)
            (self.out / "ckpt" / "LATEST").write_text("v000001\n")
        raise KeyboardInterrupt

    train._Trainer.run = run
    try:
        return _train_capture(args)
    finally:
        train._Trainer.run = saved


def test_ctrl_c_outside_the_steps_prints_the_command_that_works(dist_run, tmp_path):
    """Found by a fresh-user trial: Ctrl-C before step 1 or after the last one (where it
    acts at once) printed a raw traceback. Now: exit 130, one line, no traceback, naming
    the command that works: the same command (+ --overwrite where the folder holds a run)
    without a checkpoint, the --resume command with one."""
    out = tmp_path / "run"
    args = _with(RUN_ARGS, out=str(out))
    code, err = dist_run(1, _ctrl_c_in_start_up, args)[0]
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted (SIGINT) before the run's first checkpoint" in err, err
    # (the pool's rank is a plain torchrun's: the user's own launch command is named)
    assert "start it again with: your launch command\n" in err, err
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    code, err = dist_run(1, _ctrl_c_in_start_up, [*args, "--overwrite"])[0]
    assert code == 130 and "your launch command with --overwrite added" not in err, err
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    code, err = dist_run(1, _ctrl_c_in_start_up, [*args, "--overwrite"], True)[0]
    assert code == 130 and "Traceback" not in err, err
    tail = err.split(f"the newest checkpoint in {out / 'ckpt'} is kept; continue the run "
                     f"with: your launch command with --resume added, e.g. ")[1]
    assert "-m sbpflow.apps.train test-gpt" in tail and "--resume" in tail, err
    assert "--overwrite" not in tail, err
    # a single process (no torchrun): the sbpflow train command itself
    msg = train._interrupt_message(out, "sbpflow train", args, 1, False)
    assert msg.endswith("continue the run with: " + " ".join(
        ["sbpflow", "train", *args, "--resume"])), msg
    (out / "ckpt" / "LATEST").unlink()
    (out / "ckpt" / "v000001").rmdir()
    msg = train._interrupt_message(out, "sbpflow train", args, 1, False)
    assert msg.endswith("start it again with: " + " ".join(
        ["sbpflow", "train", *args, "--overwrite"])), msg


def test_sigterm_to_a_single_process_run_keeps_the_checkpoint_of_its_step(tmp_path):
    """SIGTERM to a 1-process run (no launcher) that checkpoints every step: it stops at
    the step boundary, exit 143, and writes no second version of a step that has one
    (which would push the version before it out of save(keep=2))."""
    args = _with(RUN_ARGS, steps="400", ckpt_every="1", eval_every="0",
                 out=str(tmp_path / "run"))
    code, text, out = _interrupt(args, __import__("signal").SIGTERM, after=3)
    assert code == 143, text[-4000:]
    done = len(_metrics(out))
    import sbpflow

    assert int(sbpflow.load(out / "ckpt")["step"]) == done
    assert f"stopped by SIGTERM after step {done} of 400; the newest checkpoint is that of " \
        f"step {done}" in text, text[-3000:]
    versions = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("v"))
    assert versions == [f"v{done - 1:06d}", f"v{done:06d}"], versions


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


# ------------------------------------------------- checked up front, nothing lost at the end
# A 1-rank run of 2 steps: its checkpoint (step 2, the final one) is what the resume checks
# compare against.
SMALL = ["test-gpt", "--steps", "2", "--batch-size", "4", "--block-size", "16", "--seed", "3",
         "--lr", "3e-3", "--warmup", "1", "--eval-batches", "1", "--sample-tokens", "4"]


def _no_rank_env(monkeypatch) -> None:
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)


def _main_error(args: list[str], capsys) -> str:
    """Run ``train.main`` in this process; it must stop with exit code 2: the message."""
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--plugin", PLUGIN, "--no-progress"])
    assert e.value.code == 2
    return capsys.readouterr().err


def _strict_json(line: str) -> dict:
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token} in {line!r}")

    return json.loads(line, parse_constant=refuse)


def _train_capture(args: list[str], patch_evaluate: bool = False) -> tuple[object, str]:
    """``sbpflow train`` as the one rank of a 1-rank world: (the exit code, or the text of
    the exception it raised; what it printed to stderr). ``patch_evaluate``: the
    evaluation raises, as a failure at the end of a run would."""
    import contextlib
    import io

    err = io.StringIO()
    saved = train._Trainer.evaluate
    if patch_evaluate:
        def evaluate(self):
            raise RuntimeError("injected failure in the final evaluation")

        train._Trainer.evaluate = evaluate
    try:
        with contextlib.redirect_stderr(err):
            code = train.main([*args, "--plugin", PLUGIN, "--no-progress"])
    except Exception as e:  # noqa: BLE001 - reported to the test
        code = f"{type(e).__name__}: {e}"
    finally:
        train._Trainer.evaluate = saved
    return code, err.getvalue()


def _resume_bypassing_parent_check(args: list[str]) -> tuple[object, str]:
    """As :func:`_train_capture`, with the parent's --resume check switched off, so that
    the trainer's own check (the one a restart or a torchrun launch relies on) answers."""
    saved = train._check_resume_args
    train._check_resume_args = lambda *a, **k: None
    try:
        return _train_capture(args)
    finally:
        train._check_resume_args = saved


@pytest.fixture(scope="module")
def small_run(dist_pools, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small_run")
    code, err = dist_pools(1, _train_capture, [*SMALL, "--out", str(out)], timeout=300)[0]
    assert code == 0, err
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("args, match", [
    (["--lr", "inf"], r"--lr inf: the learning rate must be a finite number > 0"),
    (["--lr", "0"], r"--lr 0.0: the learning rate must be a finite number > 0"),
    (["--min-lr-ratio", "-0.5"], r"--min-lr-ratio -0.5: .*give a number in \[0, 1\]"),
    (["--min-lr-ratio", "nan"], r"--min-lr-ratio nan: .*give a number in \[0, 1\]"),
    (["--weight-decay", "-1"], r"--weight-decay -1.0: give a finite number >= 0"),
    (["--grad-clip", "inf"], r"--grad-clip inf: give a finite number >= 0"),
    (["--warmup", "50", "--steps", "10"], r"--warmup 50 is longer than the run \(--steps 10\)"),
    (["--temperature", "0"], r"--temperature 0.0: sampling divides the logits by it; give a "
                             r"finite number > 0.*or --sample-tokens 0"),
    (["--temperature", "-1"], r"--temperature -1.0: .*finite number > 0"),
    (["--eval-batches", "0"], r"--eval-batches 0: .*give --eval-batches 1 or more"),
    (["--prompt", "snow\u2603man"], r"--prompt .*the characters \['\u2603'\] do not occur in "
                                    r"the training text.*--tokenizer byte"),
    (["--config", "vocab_size=10"], r"--config vocab_size=10: vocab_size is set from the data"),
    (["--config", "n_layer=two"], r"--config n_layer='two': expected int"),
    (["--config", "block_size=8", "--block-size", "16"],
     r"--block-size 16 is longer than --config block_size=8"),
    (["--seed", str(2 ** 64)], r"--seed 18446744073709551616: give an integer in"),
    (["--synthetic", "--data", __file__], r"--synthetic and --data .* exclude each other"),
])
def test_bad_values_fail_before_training(args, match, capsys, monkeypatch, tmp_path):
    _no_rank_env(monkeypatch)
    err = _main_error(["test-gpt", *args, "--out", str(tmp_path / "out")], capsys)
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "out").exists()  # stopped before any rank started


@pytest.mark.parametrize("model, item, match", [
    ("gpt-mini", "n_head=5", r"GPT: n_embd 128 is not divisible by n_head 5"),
    ("bert-mini", "n_head=3", r"BERT: hidden 128 is not divisible by n_head 3"),
    ("resnet18-digits", "block=dense", r"ResNet: block must be 'basic' or 'bottleneck'")])
def test_a_config_the_model_refuses_fails_before_training(model, item, match, capsys,
                                                          monkeypatch, tmp_path):
    """The config's own checks run in the launcher (rc 2, no rank started)."""
    _no_rank_env(monkeypatch)
    err = _main_error([model, "--config", item, "--out", str(tmp_path / "out")], capsys)
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "out").exists()


def test_temperature_is_not_checked_without_a_sample(monkeypatch, capsys, tmp_path):
    """--temperature matters only when a sample is generated: with --sample-tokens 0 the
    same value passes, and validation goes on to the next problem (a short text)."""
    _no_rank_env(monkeypatch)
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i} of the text\n" for i in range(100)))
    args = ["test-gpt", "--temperature", "0", "--data", str(text), "--block-size", "256",
            "--out", str(tmp_path / "out")]
    assert "error: --temperature 0.0" in _main_error([*args, "--sample-tokens", "4"], capsys)
    err = _main_error([*args, "--sample-tokens", "0"], capsys)
    assert "error: the validation text of" in err, err


def test_short_validation_split_fails_up_front(monkeypatch, capsys, tmp_path):
    _no_rank_env(monkeypatch)
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i} of the text\n" for i in range(100)))  # 2000 chars
    out = tmp_path / "out"
    err = _main_error(["test-gpt", "--data", str(text), "--block-size", "256", "--out",
                       str(out)], capsys)
    assert ("the validation text of " + str(text) + " has 200 tokens, fewer than one window "
            "of --block-size + 1 = 257; give --block-size 199 or less, or more text") in err, err
    assert not out.exists()
    err = _main_error(["test-gpt", "--data", str(text), "--block-size", "5000", "--out",
                       str(out)], capsys)
    assert "the training text of" in err and "1790 tokens" in err, err


def test_json_line_writes_null_for_non_finite():
    line = train._json_line({"step": 3, "loss": float("nan"), "val_loss": float("inf"),
                             "lr": 1e-3})
    assert _strict_json(line) == {"step": 3, "loss": None, "val_loss": None, "lr": 1e-3}
    assert line.endswith("\n") and "NaN" not in line and "Infinity" not in line


def test_read_metrics_torn_last_line_and_damage(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    records, torn = train._read_metrics(path)
    assert records == [{"step": 1, "loss": 2.0}] and torn == '{"step": 2, "lo'
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')  # newline: not torn
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        train._read_metrics(path)
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON .*'garbage'"):
        train._read_metrics(path)
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"line 1: not a metrics record"):
        train._read_metrics(path)


def test_resume_problems_what_may_change():
    rec = {"model": "m", "task": "lm", "seed": 0, "batch_size": 8, "block_size": 16,
           "tokenizer": {"kind": "char", "chars": "abc"}, "config": {"n_layer": 2,
                                                                     "vocab_size": 4},
           "data": {"source": "shakespeare", "digest": "01"}, "layout": "tp",
           "grad_accum": 1}
    # the layout and gradient accumulation may change (the data stream does not)
    assert train._resume_problems(rec, {**rec, "layout": "dp", "grad_accum": 4}) == []
    # the data are compared by content (a moved file is the same data)
    assert train._resume_problems(rec, {**rec, "data": {"source": "x.txt", "digest": "01"}}) \
        == []
    # an older checkpoint records model, seed, batch size and layout only
    old = {"model": "m", "seed": 0, "batch_size": 8, "layout": "tp"}
    assert train._resume_problems(old, rec) == []
    assert train._resume_problems(old, {**rec, "seed": 5}) == [
        "--seed 0 (this run: --seed 5); pass --seed 0"]
    got = train._resume_problems(rec, {**rec, "tokenizer": {"kind": "byte"},
                                       "config": {"n_layer": 2, "vocab_size": 256},
                                       "data": {"source": "my.txt", "digest": "02"}})
    assert got == ["--tokenizer char (this run: --tokenizer byte); pass --tokenizer char",
                   "training data shakespeare (this run: my.txt); drop --data and "
                   "--synthetic"], got


@pytest.mark.parametrize("args, want", [
    (["--seed", "4"], "--seed 3 (this run: --seed 4); pass --seed 3"),
    (["--batch-size", "8"], "--batch-size 4 (this run: --batch-size 8); pass --batch-size 4"),
    (["--block-size", "8"], "--block-size 16 (this run: --block-size 8); pass --block-size 16"),
    (["--tokenizer", "byte"], "--tokenizer char (this run: --tokenizer byte); pass "
                              "--tokenizer char"),
    (["--config", "n_layer=1"], "model config n_layer=2 (this run: n_layer=1); pass the same "
                                "--config"),
    (["--steps", "1"], "the run in {out} is finished: its last step is 2 (final checkpoint, "
                       "val_loss "),
])
def test_resume_with_changed_run_fails(small_run, args, want, monkeypatch, capsys):
    _no_rank_env(monkeypatch)
    before = (small_run / "metrics.jsonl").read_text()
    cmd = [*SMALL, "--out", str(small_run), "--resume"]
    for i in range(0, len(args), 2):  # replace the option's value, or add it
        if args[i] in cmd:
            cmd[cmd.index(args[i]) + 1] = args[i + 1]
        else:
            cmd += args[i:i + 2]
    err = _main_error(cmd, capsys)
    assert want.format(out=small_run) in err, err
    if args[0] != "--steps":
        assert f"this run does not match the checkpoint in {small_run / 'ckpt'} (step 2)" in err
        assert "start a new run with another --out" in err
    assert (small_run / "metrics.jsonl").read_text() == before  # nothing touched


@pytest.mark.parametrize("steps", ["2", "1"])
def test_resume_of_a_finished_run_fails_up_front(small_run, steps, monkeypatch, capsys):
    """--resume of a run that finished (final checkpoint, final val_loss line, plot and
    sample all there): exit 2 before any rank starts, naming the last step and the --steps
    given; nothing in the folder changes."""
    _no_rank_env(monkeypatch)
    before = {p.name: p.read_bytes() for p in small_run.iterdir() if p.is_file()}
    cmd = [*SMALL, "--out", str(small_run), "--resume"]
    cmd[cmd.index("--steps") + 1] = steps
    monkeypatch.setattr(train._Trainer, "run", lambda self: pytest.fail("the run started"))
    err = _main_error(cmd, capsys)
    val = _metrics(small_run)[-1]["val_loss"]
    assert f"error: --resume: the run in {small_run} is finished: its last step is 2 (final " \
        f"checkpoint, val_loss {val:.4f}, plot), and --steps {steps} is not past it, so " \
        f"there is nothing to train; --steps must exceed the last step: give --steps 4 " \
        f"(or any number > 2) to train on" in err, err
    assert {p.name: p.read_bytes() for p in small_run.iterdir() if p.is_file()} == before


def test_finished_means_every_final_output(small_run, tmp_path):
    """A run is finished when the final step's line has a val_loss, the plot exists and, for
    a sampling run, the sample; anything less is completed by a resume at the end."""
    out = _copy_run(small_run, tmp_path / "run")

    def msg(sampled=True, steps=2):
        return train._finished_message(out, 2, steps, True, sampled)

    assert msg() and "its last step is 2" in msg() and "--steps 2 is not past it" in msg()
    assert msg(steps=1) and "--steps 1 is not past it" in msg(steps=1)
    assert msg(steps=3) is None  # more steps: an ordinary resume
    assert "--steps 2 (the default) is not past it" in train._finished_message(out, 2, 2,
                                                                               False, True)
    (out / "sample.txt").unlink()
    assert msg() is None and msg(sampled=False)  # no sample wanted: finished
    (out / "loss.png").unlink()
    assert msg(sampled=False) is None
    (out / "loss.png").write_bytes(b"x")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    last.pop("val_loss")
    (out / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    assert msg(sampled=False) is None  # the final evaluation did not run
    (out / "metrics.jsonl").unlink()
    assert msg(sampled=False) is None


def test_finished_run_check_in_the_trainer(small_run, dist_run, tmp_path):
    """The trainer refuses a finished run too (ranks started by torchrun), exit 2, before
    step 1 and without touching the outputs."""
    out = _copy_run(small_run, tmp_path / "run")
    before = (out / "metrics.jsonl").read_text()
    png = (out / "loss.png").read_bytes()
    code, err = dist_run(1, _resume_bypassing_parent_check,
                         [*SMALL, "--out", str(out), "--resume"], timeout=300)[0]
    assert code == 2, (code, err)
    assert f"error: --resume: the run in {out} is finished: its last step is 2" in err, err
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "loss.png").read_bytes() == png


def test_resume_check_in_the_trainer(small_run, dist_run, tmp_path):
    """The trainer checks too (for ranks started by torchrun or restarted): with the
    launching process's check off, a changed --seed still stops before step 1, exit 2."""
    out = _copy_run(small_run, tmp_path / "run")
    before = (out / "metrics.jsonl").read_text()
    cmd = [*SMALL, "--out", str(out), "--resume"]
    cmd[cmd.index("--seed") + 1] = "4"
    code, err = dist_run(1, _resume_bypassing_parent_check, cmd, timeout=300)[0]
    assert code == 2, (code, err)
    assert "error: --resume: this run does not match" in err and \
        "--seed 3 (this run: --seed 4); pass --seed 3" in err, err
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_drops_a_torn_last_metrics_line(small_run, dist_run, tmp_path, monkeypatch,
                                               capsys):
    out = _copy_run(small_run, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # a crash in the middle of writing step 3
    cmd = [*SMALL, "--out", str(out), "--resume"]
    cmd[cmd.index("--steps") + 1] = "3"
    cmd[cmd.index("--lr") + 1] = "1e-3"  # may change on resume: holds from the next step
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 0, err
    assert "dropped a torn last line" in err, err
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["loss"] != 4.1
    assert rows[2]["lr"] == pytest.approx(1e-3 * train.lr_lambda(2, 1, 3, 0.1), rel=1e-12)
    # damage elsewhere is named (file and line) and stops the resume before it starts
    _no_rank_env(monkeypatch)
    (out / "metrics.jsonl").write_text("garbage\n" + (small_run / "metrics.jsonl").read_text())
    err = _main_error(cmd, capsys)
    assert f"{out / 'metrics.jsonl'}, line 1: not JSON" in err, err


def test_resume_with_more_steps_follows_the_new_schedule(small_run, dist_run, tmp_path):
    """Found by the fresh-user trial: a run extended with ``--resume --steps N`` kept the
    checkpoint's cosine schedule (torch's LambdaLR load wrote its attributes into this
    run's schedule object) and trained at the minimum learning rate."""
    out = _copy_run(small_run, tmp_path / "run")
    cmd = [*SMALL, "--out", str(out), "--resume"]
    cmd[cmd.index("--steps") + 1] = "4"
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 0, err
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs[2] == pytest.approx(3e-3 * train.lr_lambda(2, 1, 4, 0.1), rel=1e-12), lrs
    assert lrs[3] == pytest.approx(3e-3 * train.lr_lambda(3, 1, 4, 0.1), rel=1e-12), lrs
    assert lrs[2] > 1.5 * lrs[3]  # mid-cosine, not the minimum


def test_a_torn_line_of_the_checkpoints_step_comes_back_from_the_checkpoint(
        small_run, dist_run, tmp_path):
    out = _copy_run(small_run, tmp_path / "run")
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text[:-30])  # the last line (step 2, checkpointed) torn
    cmd = [*SMALL, "--out", str(out), "--resume"]
    cmd[cmd.index("--steps") + 1] = "3"
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 0, err
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    original = [_strict_json(line) for line in text.splitlines()]
    assert rows[1]["loss"] == original[1]["loss"]


def test_resume_without_latest_falls_back_to_the_newest_version(small_run, dist_run, tmp_path):
    out = _copy_run(small_run, tmp_path / "run")
    (out / "ckpt" / "LATEST").unlink()  # lost; the version folders are intact
    cmd = [*SMALL, "--out", str(out), "--resume"]
    cmd[cmd.index("--steps") + 1] = "3"
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 0, err
    assert "LATEST" in err, err  # the fallback is named in a warning, once
    assert err.count("loading the newest intact") == 1, err
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize("accum", ["4", "2"])
def test_val_loss_does_not_depend_on_grad_accum(small_run, dist_run, tmp_path, accum):
    """The final evaluation of the same weights (a resume at the end of small_run) with
    --grad-accum 4 or 2 scores the same validation windows as the run without it: its
    val_loss within float tolerance (it scored --eval-batches x the micro-batch)."""
    out = _copy_run(small_run, tmp_path / "run")
    (out / "loss.png").unlink()  # not finished: a resume at the end evaluates again
    code, err = dist_run(1, _train_capture, [*SMALL, "--out", str(out), "--resume",
                                             "--grad-accum", accum], timeout=300)[0]
    assert code == 0, err
    want, got = _metrics(small_run)[-1]["val_loss"], _metrics(out)[-1]["val_loss"]
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_non_finite_loss_stops_the_run_and_metrics_stay_standard_json(dist_run, tmp_path):
    out = tmp_path / "diverged"
    cmd = ["test-gpt", "--steps", "6", "--batch-size", "4", "--block-size", "16", "--warmup",
           "0", "--lr", "1e30", "--grad-clip", "0", "--ckpt-every", "1", "--sample-tokens",
           "0", "--out", str(out)]
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 1, (code, err)
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["loss"] is None and all(np.isfinite(r["loss"]) for r in rows[:-1]), rows
    assert len(rows) < 6
    assert (f"error: step {last['step']}: the training loss is nan; training stopped before "
            f"this step's update") in err, err
    assert "lower --lr (this run: 1e+30)" in err and "clip with --grad-clip 1.0" in err, err


def test_fp16_non_finite_losses_are_skipped_then_stop(dist_run, tmp_path):
    """With fp16 the GradScaler skips a step whose loss (and so gradients) is not finite;
    the run goes on, and stops after train._FP16_NONFINITE_LIMIT such steps in a row."""
    out = tmp_path / "fp16"
    cmd = ["test-gpt", "--steps", "20", "--batch-size", "4", "--block-size", "16", "--warmup",
           "0", "--lr", "1e30", "--grad-clip", "0", "--amp", "fp16", "--sample-tokens", "0",
           "--out", str(out)]
    code, err = dist_run(1, _train_capture, cmd, timeout=300)[0]
    assert code == 1, (code, err)
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    limit = train._FP16_NONFINITE_LIMIT
    assert [r["loss"] for r in rows[-limit:]] == [None] * limit, rows
    assert rows[-limit - 1]["loss"] is not None and len(rows) < 20, rows
    assert f"error: {limit} steps in a row up to step {rows[-1]['step']} had a non-finite " \
        f"fp16 loss" in err, err


def test_final_checkpoint_survives_a_failed_final_evaluation(small_run, dist_run, tmp_path):
    """The final checkpoint is written before the final evaluation: when that fails, the
    training is kept; --resume (start == steps) then finishes the run (the final line,
    loss.png, the sample) exactly as the uninterrupted run did."""
    import sbpflow

    out = tmp_path / "run"
    code, err = dist_run(1, _train_capture, [*SMALL, "--out", str(out)], True, timeout=300)[0]
    assert code == "RuntimeError: injected failure in the final evaluation", (code, err)
    assert int(sbpflow.load(out / "ckpt")["step"]) == 2
    assert [r["step"] for r in _metrics(out)] == [1]  # the final line waits for the eval
    assert not (out / "loss.png").exists() and not (out / "sample.txt").exists()
    code, err = dist_run(1, _train_capture, [*SMALL, "--out", str(out), "--resume"],
                         timeout=300)[0]
    assert code == 0, err
    want, got = _metrics(small_run), _metrics(out)
    assert [r["step"] for r in got] == [1, 2] and "val_loss" in got[1]
    for key in ("loss", "lr", "val_loss"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sample.txt").read_text() == (small_run / "sample.txt").read_text()


# ----------------------------------------------------------------------------- --graph
GRAPH_ARGS = ["test-gpt", "--steps", "4", "--batch-size", str(BATCH), "--seed", str(SEED),
              "--lr", str(LR), "--warmup", "2", "--block-size", str(BLOCK), "--eval-every",
              "0", "--sample-tokens", "0", "--dp", "2", "--ckpt-every", "2"]


def test_graph_with_grad_accum_gives_the_eager_losses(dist_run, tmp_path):
    """--graph --grad-accum 2 (dropout 0.1 in test-gpt: the graph's micro-batches and
    their masks are the eager loop's) gives the eager run's losses, and torch's."""
    args = [*GRAPH_ARGS, "--grad-accum", "2"]
    eager = dist_run(2, _train_in_rank, [*args, "--out", str(tmp_path / "e")], timeout=600)[0]
    graph = dist_run(2, _train_in_rank, [*args, "--graph", "--out", str(tmp_path / "g")],
                     timeout=600)[0]
    _close([r["loss"] for r in graph], [r["loss"] for r in eager], 1e-5, "graph vs eager")
    _close([r["loss"] for r in graph], list(_torch_curve(accum=2, steps=4)), 1e-3, "vs torch")
    assert "all_reduce" in (tmp_path / "g" / "graph.txt").read_text()


def _train_in_rank_cached(cache: str, args: list[str]) -> list[dict]:
    """:func:`_train_in_rank` with ``$SBPFLOW_CACHE`` at ``cache`` (a calibration made
    there, not in the user's home)."""
    import os

    os.environ["SBPFLOW_CACHE"] = cache
    try:
        return _train_in_rank(args)
    finally:
        os.environ.pop("SBPFLOW_CACHE", None)


def test_plan_auto_searches_calibrates_and_follows_torch(dist_run, tmp_path):
    """--plan auto (no layout given): the ranks measure this machine's profile once (none
    cached; it is cached after), search, train as the one-process curve, and leave the
    plan in plan.json and its explanation in graph.txt; --plan FILE runs that plan again
    to the same losses."""
    import json
    import os

    i = GRAPH_ARGS.index("--dp")
    args = GRAPH_ARGS[:i] + GRAPH_ARGS[i + 2:]
    cache = str(tmp_path / "cache")
    rows = dist_run(2, _train_in_rank_cached, cache,
                    [*args, "--plan", "auto", "--out", str(tmp_path / "a")], timeout=600)[0]
    _close([r["loss"] for r in rows], list(_torch_curve(steps=4)), 1e-3, "vs torch")
    assert any(n.startswith("calibration-") for n in os.listdir(cache))
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["mesh"] == [2] and plan["parameters"]
    assert "auto-parallel plan of TrainStep" in (tmp_path / "a" / "graph.txt").read_text()
    again = dist_run(2, _train_in_rank_cached, cache,
                     [*args, "--plan", str(tmp_path / "a" / "plan.json"), "--out",
                      str(tmp_path / "f")], timeout=600)[0]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]


def _train_code_in_rank(args: list[str]) -> int:
    """``sbpflow train``'s return code as one rank of the pool's world."""
    return train.main([*args, "--plugin", PLUGIN, "--no-progress"])


def test_a_plan_file_of_another_model_is_one_line(dist_run, tmp_path, capfd):
    """--plan FILE naming a parameter the model does not have: every rank stops at the
    first step with the launcher's reported exit, rank 0 having said why in one line
    (the plan, the parameter, the model's own names), no traceback."""
    import json

    from sbpflow.distributed.launch import REPORTED_EXIT

    i = GRAPH_ARGS.index("--dp")
    args = GRAPH_ARGS[:i] + GRAPH_ARGS[i + 2:]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": [2], "parameters": {"m.inp.weight": "B"}}))
    codes = dist_run(2, _train_code_in_rank, [*args, "--plan", str(plan), "--out",
                                              str(tmp_path / "r")], timeout=300)
    assert codes == [REPORTED_EXIT, REPORTED_EXIT]
    err = capfd.readouterr().err
    assert f"error: --plan {plan}: auto-parallel plan {plan}: none of its 1 parameters " \
        f"(such as 'm.inp.weight')" in err and "made for another model" in err and \
        "Traceback" not in err, err


@pytest.mark.exhaustive  # four ranks training (about a minute)
def test_a_plan_file_on_a_2x2_mesh_with_zero_follows_torch(dist_run, tmp_path):
    """--plan FILE whose mesh is 2 x 2 and whose ZeRO stage is 1 (what `sbpflow plan`
    may choose on 4 ranks): train lays the ranks out on the file's mesh, turns ZeRO on,
    and trains as the one-process curve; plan.json keeps both."""
    import json

    i = GRAPH_ARGS.index("--dp")
    args = GRAPH_ARGS[:i] + GRAPH_ARGS[i + 2:]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": [2, 2], "zero_stage": 1,
                                "inputs": {"0": "[S(0), B]", "1": "[S(0), B]"}}))
    rows = dist_run(4, _train_in_rank, [*args, "--plan", str(plan), "--out",
                                        str(tmp_path / "r")], timeout=900)[0]
    _close([r["loss"] for r in rows], list(_torch_curve(steps=4)), 1e-3, "vs torch")
    kept = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert kept["mesh"] == [2, 2] and kept["zero_stage"] == 1


def _cut_at_step_2(src: Path, dst: Path) -> None:
    """A copy of finished run ``src`` as if it had stopped after its step-2 checkpoint."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "ckpt" / "LATEST").write_text("v000001\n")
    shutil.rmtree(dst / "ckpt" / "v000002")
    lines = (dst / "metrics.jsonl").read_text().splitlines()[:2]
    (dst / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for name in ("loss.png", "sample.txt"):
        (dst / name).unlink(missing_ok=True)


def test_graph_and_eager_resume_each_others_checkpoints(dist_run, tmp_path):
    runs = {}
    for mode in ("eager", "graph"):
        flag = ["--graph"] if mode == "graph" else []
        runs[mode] = dist_run(2, _train_in_rank, [*GRAPH_ARGS, *flag, "--out",
                                                  str(tmp_path / mode)], timeout=600)[0]
    for first, then in (("eager", "graph"), ("graph", "eager")):
        cut = tmp_path / f"{first}-then-{then}"
        _cut_at_step_2(tmp_path / first, cut)
        flag = ["--graph"] if then == "graph" else []
        rows = dist_run(2, _train_in_rank, [*GRAPH_ARGS, *flag, "--resume", "--out",
                                            str(cut)], timeout=600)[0]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        _close([r["loss"] for r in rows], [r["loss"] for r in runs[then]], 1e-5,
               f"{first} checkpoint resumed by {then}")


# ----------------------------------------------------------------------------- --pp
# test-gpt (2 blocks, dropout 0.1) in 2 stages; 2 micro-batches of 4 windows (the graph's
# trace, most of a run's time here, grows with the micro-batches; test_pipeline.py runs
# 1F1B's steady state, F B F B, with 4); evaluation (eager: the stages one after another)
# at steps 2 and 4; a sample of 8 tokens.
PP_ARGS = ["test-gpt", "--steps", "4", "--batch-size", str(BATCH), "--seed", str(SEED),
           "--lr", str(LR), "--warmup", "2", "--block-size", str(BLOCK), "--eval-every", "2",
           "--eval-batches", "1", "--sample-tokens", "8", "--micro-batches", "2",
           "--ckpt-every", "2"]


def test_gpt_pipeline_split():
    """GPT's stages: embeddings and the first blocks on stage 0, the blocks spread evenly,
    ln_f and lm_head on the last; every name is a module of the model; models without a
    split (and too many stages) are refused naming what would work."""
    from sbpflow import models

    spec = models.get("gpt-mini")  # 4 blocks
    emb, head = ["transformer.wte", "transformer.wpe", "transformer.drop"], \
        ["transformer.ln_f", "lm_head"]
    h = [f"transformer.h.{i}" for i in range(6)]
    assert spec.pipeline_stages(1) == [emb + h[:4] + head]
    assert spec.pipeline_stages(2) == [emb + h[:2], h[2:4] + head]
    assert spec.pipeline_stages(3) == [emb + h[:2], h[2:3], h[3:4] + head]
    assert spec.pipeline_stages(4) == [emb + h[:1], h[1:2], h[2:3], h[3:4] + head]
    assert spec.pipeline_stages(3, n_layer=6) == [emb + h[:2], h[2:4], h[4:6] + head]
    model = spec.build(n_layer=6)
    for names in spec.pipeline_stages(3, n_layer=6):
        for name in names:
            model.get_submodule(name)
    with pytest.raises(ValueError, match=r"GPT: 4 blocks \(n_layer\) cannot fill 5 pipeline "
                                         r"stages .*use at most 4 stages, or n_layer >= 5"):
        spec.pipeline_stages(5)
    with pytest.raises(ValueError, match=r"resnet18 \(resnet\) has no pipeline split; models "
                                         r"with one: \[.*'gpt-mini'"):
        models.get("resnet18").pipeline_stages(2)


@pytest.fixture(scope="module")
def pp_run(dist_pools, tmp_path_factory) -> Path:
    """The uninterrupted ``--pp 2`` run on 2 ranks (1F1B; checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("pp_run")
    dist_pools(2, _train_in_rank, [*PP_ARGS, "--pp", "2", "--out", str(out)], timeout=600)
    return out


def _curve(rows: list[dict], key: str = "loss") -> list[float]:
    return [r[key] for r in rows if key in r]


def test_pp2_gives_the_losses_of_the_run_without_pipeline_and_torch(pp_run, dist_run,
                                                                    tmp_path):
    """``--pp 2`` (one rank a stage, 1F1B over 2 micro-batches, dropout 0.1) gives the
    losses of the same run without pipeline (eager data parallel, the same 2
    micro-batches) within 1e-5, training and validation (the evaluation runs the stages
    eagerly), the same sample (generated tokens come back to stage 0), and torch's."""
    ref = dist_run(2, _train_in_rank, [*PP_ARGS, "--dp", "2", "--out", str(tmp_path / "dp")],
                   timeout=600)[0]
    pp = _metrics(pp_run)
    assert [r["step"] for r in pp] == [1, 2, 3, 4]
    _close(_curve(pp), _curve(ref), 1e-5, "pp2 vs dp2 (eager)")
    _close(_curve(pp, "val_loss"), _curve(ref, "val_loss"), 1e-5, "pp2 vs dp2: val_loss")
    _close(_curve(pp), list(_torch_curve(accum=2, steps=4)), 1e-3, "pp2 vs torch")
    sample = (pp_run / "sample.txt").read_text()
    assert len(sample) == 9 and sample == (tmp_path / "dp" / "sample.txt").read_text()
    cfg = json.loads((pp_run / "config.json").read_text())
    assert (cfg["pp"], cfg["schedule"], cfg["dp"], cfg["tp"], cfg["grad_accum"]) == (
        2, "1f1b", 1, 1, 2)
    assert cfg["stages"] == [
        {"ranks": [0], "modules": ["transformer.wte", "transformer.wpe", "transformer.drop",
                                   "transformer.h.0"]},
        {"ranks": [1], "modules": ["transformer.h.1", "transformer.ln_f", "lm_head"]}]
    assert "send_recv" in (pp_run / "graph.txt").read_text()  # the stages' transfers


@pytest.mark.exhaustive
def test_interleaved_pp2_gives_the_losses_of_the_run_without_pipeline(dist_run, tmp_path):
    """``--pp 2 --schedule interleaved`` (4 blocks cut into 4 stages, two per rank, 4
    micro-batches, dropout 0.1) gives the losses of eager data parallel over the same
    micro-batches within 1e-5; config.json lists stage s on rank s % 2."""
    args = [*PP_ARGS, "--config", "n_layer=4", "--micro-batches", "4"]
    ref = dist_run(2, _train_in_rank, [*args, "--dp", "2", "--out", str(tmp_path / "dp")],
                   timeout=900)[0]
    out = tmp_path / "il"
    got = dist_run(2, _train_in_rank, [*args, "--pp", "2", "--schedule", "interleaved",
                                       "--out", str(out)], timeout=900)[0]
    _close(_curve(got), _curve(ref), 1e-5, "interleaved pp2 vs dp2 (eager)")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["schedule"], cfg["virtual_stages"]) == ("interleaved", 2)
    assert [st["ranks"] for st in cfg["stages"]] == [[0], [1], [0], [1]]


def test_pp2_checkpoint_resumes_with_pp1_and_another_layout(pp_run, dist_run, tmp_path):
    """The step-2 checkpoint of the ``--pp 2`` run, resumed without pipeline on a TP=2
    layout (the checkpoint reshards: two placements to one mesh), continues with the
    uninterrupted run's losses (1e-5)."""
    import sbpflow

    cut = tmp_path / "cut"
    _cut_at_step_2(pp_run, cut)
    run = sbpflow.load(cut / "ckpt")["run"]
    assert (run["layout"], run["pp"], run["schedule"], run["grad_accum"]) == (
        "pp2", 2, "1f1b", 2)
    rows = dist_run(2, _train_in_rank, [*PP_ARGS, "--tp", "2", "--resume", "--out",
                                        str(cut)], timeout=600)[0]
    want = _metrics(pp_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    _close(_curve(rows), _curve(want), 1e-5, "pp2 checkpoint resumed with tp2")
    _close(_curve(rows, "val_loss"), _curve(want, "val_loss"), 1e-5, "resumed: val_loss")
    assert json.loads((cut / "config.json").read_text())["pp"] == 1


@pytest.mark.exhaustive  # 4 ranks, and a second 2-rank pipeline run
@pytest.mark.parametrize("nproc, extra", [
    ("2", ["--schedule", "gpipe"]),
    ("2", ["--schedule", "zero_bubble"]),
    ("4", ["--dp", "2"]),
    ("4", ["--tp", "2"]),
], ids=["pp2-gpipe", "pp2-zero-bubble", "pp2xdp2", "pp2xtp2"])
def test_pp2_schedules_and_layouts_give_the_same_losses(pp_run, dist_run, tmp_path, nproc,
                                                        extra):
    rows = dist_run(int(nproc), _train_in_rank, [*PP_ARGS, "--pp", "2", *extra, "--out",
                                                 str(tmp_path / "run")], timeout=900)[0]
    want = _metrics(pp_run)
    _close(_curve(rows), _curve(want), 1e-5, f"pp2 {extra} vs pp2")
    _close(_curve(rows, "val_loss"), _curve(want, "val_loss"), 1e-5, f"pp2 {extra}: val")
    assert (tmp_path / "run" / "sample.txt").read_text() == \
        (pp_run / "sample.txt").read_text()


@pytest.mark.exhaustive
def test_pp1_checkpoint_resumes_with_pp2(pp_run, dist_run, tmp_path):
    """The other way: a checkpoint without pipeline (TP=2) resumed with ``--pp 2``."""
    first = tmp_path / "tp"
    dist_run(2, _train_in_rank, [*PP_ARGS, "--tp", "2", "--out", str(first)], timeout=600)
    cut = tmp_path / "cut"
    _cut_at_step_2(first, cut)
    rows = dist_run(2, _train_in_rank, [*PP_ARGS, "--pp", "2", "--schedule", "gpipe",
                                        "--resume", "--out", str(cut)], timeout=600)[0]
    _close(_curve(rows), _curve(_metrics(first)), 1e-5, "tp2 checkpoint resumed with pp2")


@pytest.mark.exhaustive  # 8 ranks on this machine, oversubscribed (minutes)
def test_pp2_dp2_tp2_on_8_ranks_follows_torch(tmp_path):
    """The command of the issue, ``--pp 2 --dp 2 --tp 2 --micro-batches 4`` (8 ranks
    launched by the command), follows torch; its checkpoint resumes with ``--pp 1`` on
    2 ranks."""
    out = tmp_path / "pp_dp_tp"
    args = [*PP_ARGS, "--micro-batches", "4"]  # the last value counts
    log = _finish(_start([*args, "--pp", "2", "--dp", "2", "--tp", "2", "--out", str(out)]),
                  timeout=1500)
    assert "pipeline: 2 stages of 4 ranks, 4 micro-batches, schedule 1f1b" in log, log
    rows = _metrics(out)
    _close(_curve(rows), list(_torch_curve(accum=4, steps=4)), 1e-3, "pp2 x dp2 x tp2")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mesh"] == [2, 2] and [s["ranks"] for s in cfg["stages"]] == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    cut = tmp_path / "cut"
    _cut_at_step_2(out, cut)
    _run([*args, "--nproc-per-node", "2", "--dp", "2", "--resume", "--out", str(cut)])
    _close(_curve(_metrics(cut)), _curve(rows), 1e-5, "pp2 x dp2 x tp2 resumed with dp2")
