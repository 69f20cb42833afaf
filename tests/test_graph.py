"""nn.Graph: a compiled step gives the eager step's losses and parameters (and so the
one-process PyTorch run's), in every layout and with each pass; bad use raises a clear
error; the passes do what they say on the program.

The model is the nanoGPT-style file (2 layers, width 64) as in test_training.py; eager
sbpflow is the oracle for the graph (1e-5 relative on losses, parameters within 1e-5 of
their scale), plain torch on one process for both (test_training.py and here for DP).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from _models import GPT_TP_PLAN, load_gpt, world_placement

import sbpflow
from sbpflow.graph import GraphError, GraphTraceError, passes
from sbpflow.nn.graph import GraphModule
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

STEPS = 5


def _model(dropout: float = 0.0):
    sbpflow.manual_seed(0)
    gpt = load_gpt("sbpflow")
    return gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=2, n_head=4,
                                 n_embd=64, dropout=dropout))


def _batches(n=STEPS, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 48, (batch, 16), generator=g),
             torch.randint(0, 48, (batch, 16), generator=g)) for _ in range(n)]


_DATA = {"dp": split(0), "tp": B, "dp_tp": (split(0), B), "one": B}


def _setup(layout: str, dropout: float = 0.0):
    m = _model(dropout)
    pl = world_placement("dp" if layout == "one" else layout)
    parallelize_module(m, pl, GPT_TP_PLAN if layout in ("tp", "dp_tp") else {}, tp_axis=-1)
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return m, pl, opt


class _Train(sbpflow.nn.Graph):
    def __init__(self, m, opt, pl, sch=None):
        super().__init__()
        self.model = m
        self.pl = pl
        self.add_optimizer(opt, lr_sch=sch)

    def build(self, x, y):
        with sbpflow.default_placement(self.pl):
            loss = self.model(x, y)[1]
        loss.backward()
        return loss


def _params(m) -> dict:
    return {k: v.numpy() for k, v in m.state_dict().items()}


def _run(layout: str, mode: str, opts: dict | None = None):
    """Train STEPS steps; ``mode`` "eager" or "graph"; ``opts``: acc, zero, ckpt, amp
    ("bf16"/"fp16"), dropout, sched. Returns (losses, params, print(graph))."""
    torch.set_num_threads(1)
    o = opts or {}
    acc, zero, ckpt, amp = o.get("acc", 1), o.get("zero", 0), o.get("ckpt"), o.get("amp")
    dropout, sched = o.get("dropout", 0.0), o.get("sched", False)
    m, pl, opt = _setup(layout, dropout)
    sch = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched else None
    data = _DATA[layout]
    scaler = sbpflow.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp == "fp16" else None
    g = None
    if mode == "graph":
        g = _Train(m, opt, pl, sch)
        g.config.set_gradient_accumulation_steps(acc)
        if zero:
            g.config.enable_zero(True, stage=zero, shard_min_size=1)
        if amp:
            g.config.enable_amp(True, dtype=torch.float16 if amp == "fp16" else torch.bfloat16)
        if scaler is not None:
            g.set_grad_scaler(scaler)
        if ckpt:
            for blk in m.transformer.h:
                blk.to(GraphModule).activation_checkpointing = True
    losses = []
    for x, y in _batches():
        xs = sbpflow.tensor(x, placement=pl, sbp=data)
        ys = sbpflow.tensor(y, placement=pl, sbp=data)
        if g is not None:
            loss = g(xs, ys)
        elif acc > 1:  # eager gradient accumulation over the graph's micro-batches
            loss = _eager_accumulate(m, opt, pl, xs, ys, acc)
        else:
            opt.zero_grad()
            with sbpflow.autocast("cpu", dtype=torch.float16 if amp == "fp16" else
                                  torch.bfloat16, enabled=amp is not None), \
                    sbpflow.default_placement(pl):
                loss = m(xs, ys)[1]
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if sch is not None:
                sch.step()
        losses.append(loss.item())
    text = str(g) if g is not None else ""
    return losses, _params(m), text


def _eager_accumulate(m, opt, pl, xs, ys, acc: int):
    """Eager gradient accumulation over the micro-batches nn.Graph forms (each rank's
    shard cut into ``acc`` parts, no data moved), loss scaled by ``1/acc``."""
    opt.zero_grad()
    total = 0.0
    for k, (args, _) in enumerate(passes.micro_batches((xs, ys), {}, acc)):
        ctx = sbpflow.no_sync() if k < acc - 1 else contextlib.nullcontext()
        with ctx, sbpflow.default_placement(pl):
            loss = m(*args)[1]
            (loss * (1.0 / acc)).backward()
        total += loss.item() / acc
    opt.step()
    return torch.tensor(total)


def _close(got, want, rtol=1e-5):
    """Losses within ``rtol``; each parameter within ``rtol`` of its largest entry. The
    attention key biases are left out: their gradient is zero in exact arithmetic (softmax
    ignores a shift of a query's scores), so AdamW turns rounding noise into lr-sized
    steps of either sign in any two runs that round differently."""
    lg, pg, _ = got
    lw, pw, _ = want
    for i, (a, b) in enumerate(zip(lg, lw)):
        assert abs(a - b) <= rtol * abs(b), (i, a, b)
    for k in pw:
        if k.endswith("attn.k.bias"):
            continue
        scale = max(float(np.abs(pw[k]).max()), 1e-3)
        assert float(np.abs(pg[k] - pw[k]).max()) <= rtol * scale, k


def _torch_losses(batches) -> list[float]:
    torch.manual_seed(0)
    gpt = load_gpt("torch")
    m = gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=2, n_head=4, n_embd=64,
                              dropout=0.0))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = m(x, y)[1]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


# ====================================================================== equivalence


@pytest.mark.parametrize("layout", ["dp", "tp", "dp_tp"])
def test_graph_gives_the_eager_losses_and_parameters(dist_run, layout):
    n = 4 if layout == "dp_tp" else 2
    eager = dist_run(n, _run, layout, "eager", timeout=600)[0]
    graph = dist_run(n, _run, layout, "graph", timeout=600)[0]
    _close(graph, eager)
    want = _torch_losses(_batches())
    for a, b in zip(graph[0], want):
        assert abs(a - b) <= 1e-4 * abs(b)
    text = graph[2]
    assert "logical graph" in text and "per rank: parameters" in text
    if layout == "tp":  # the Megatron all-reduces are in the program and printed
        assert "all_reduce axis 0" in text


def test_gradient_accumulation_gives_the_whole_batch_step(dist_run):
    """4 micro-batches inside the graph, one update: the eager accumulation loop's step
    (same micro-batches, same sums), and the whole batch's losses (the summation order
    differs there: losses within 1e-5; AdamW amplifies rounding in the parameters)."""
    whole = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    eager = dist_run(2, _run, "dp", "eager", dict(acc=4), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(acc=4), timeout=600)[0]
    _close(graph, eager)
    for a, b in zip(graph[0], whole[0]):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_give_the_data_parallel_step(dist_run, stage):
    eager = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(zero=stage), timeout=600)[0]
    _close(graph, eager)


def test_activation_checkpointing_recomputes_with_the_forward_dropout_masks(dist_run):
    """Dropout 0.1: the recomputed blocks draw the forward's masks (the generator state is
    replayed), so the losses and parameters are the eager ones."""
    eager = dist_run(2, _run, "tp", "eager", dict(dropout=0.1), timeout=600)[0]
    graph = dist_run(2, _run, "tp", "graph", dict(ckpt=True, dropout=0.1), timeout=600)[0]
    _close(graph, eager)


def test_amp_bf16_graph_follows_eager_autocast(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(amp="bf16"), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(amp="bf16"), timeout=600)[0]
    _close(graph, eager, rtol=2e-2)


def test_amp_fp16_with_loss_scaling_follows_eager(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(amp="fp16"), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(amp="fp16"), timeout=600)[0]
    _close(graph, eager, rtol=2e-2)


def test_lr_scheduler_steps_with_the_graph(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(sched=True), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(sched=True), timeout=600)[0]
    _close(graph, eager)
