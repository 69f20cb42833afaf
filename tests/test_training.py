"""Training follows the single-process PyTorch loss curve: a small MLP and a small
transformer (the nanoGPT-style file, 2 layers, width 64) trained 30 steps with AdamW in
data parallel (2), tensor parallel (2), DP x TP on a 2x2 mesh, and ZeRO (S(0) gradient
and optimizer-state layout), within 1e-4 relative of plain torch on one process."""

from __future__ import annotations

import pytest
import torch
from _models import GPT_TP_PLAN, MLP_TP_PLAN, load_gpt, mlp, world_placement

import sbpflow
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

STEPS = 30


def _build(framework: str, model: str):
    lib = torch if framework == "torch" else sbpflow
    lib.manual_seed(0)
    if model == "mlp":
        return mlp(lib.nn)
    gpt = load_gpt(framework)
    return gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=2, n_head=4,
                                 n_embd=64, dropout=0.0))


def _batches(model: str):
    g = torch.Generator().manual_seed(1)
    if model == "mlp":
        return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))
                for _ in range(STEPS)]
    return [(torch.randint(0, 48, (8, 16), generator=g), torch.randint(0, 48, (8, 16),
                                                                         generator=g))
            for _ in range(STEPS)]


def _loss(model_name, m, x, y, F):
    if model_name == "mlp":
        return F.mse_loss(m(x), y)
    return m(x, y)[1]


def _torch_curve(model: str) -> list[float]:
    m = _build("torch", model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches(model):
        opt.zero_grad()
        loss = _loss(model, m, x, y, torch.nn.functional)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _sbpflow_curve(model: str, layout: str) -> list[float]:
    m = _build("sbpflow", model)
    pl = world_placement(layout)
    plan = (GPT_TP_PLAN if model == "gpt" else MLP_TP_PLAN) if layout in ("tp", "dp_tp") else {}
    parallelize_module(m, pl, plan, tp_axis=-1)
    if layout in ("tp", "dp_tp"):
        assert any(s.is_split() for p in m.parameters() for s in p.sbp)
    if layout == "zero":
        for p in m.parameters():
            p.set_grad_sbp(split(0))
    data_sbp = {"dp": split(0), "zero": split(0), "tp": B, "dp_tp": (split(0), B)}[layout]
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches(model):
        opt.zero_grad()
        xs = sbpflow.tensor(x, placement=pl, sbp=data_sbp)
        ys = sbpflow.tensor(y, placement=pl, sbp=data_sbp)
        with sbpflow.default_placement(pl):  # torch.arange in the model's forward: global
            loss = _loss(model, m, xs, ys, sbpflow.nn.functional)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("layout", ["dp", "tp", "zero", "dp_tp"])
def test_follows_torch_loss_curve(dist_run, model, layout):
    want = _torch_curve(model)
    got = dist_run(4 if layout == "dp_tp" else 2, _sbpflow_curve, model, layout,
                   timeout=600)[0]
    assert want[-1] < want[0]  # it trains
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-4 * abs(b), (layout, model, step, a, b)
