"""Pipeline parallelism: GPT split into stages inside an nn.Graph gives the one-process
PyTorch losses, with each schedule."""

from __future__ import annotations

import pytest
import torch
from _models import load_gpt
from test_graph import _batches

import sbpflow
from sbpflow.graph import GraphModule
from sbpflow.sbp import broadcast as B

STEPS = 5


def _gpt(framework: str, n_layer: int = 2, dropout: float = 0.0):
    gpt = load_gpt(framework)
    (sbpflow if framework == "sbpflow" else torch).manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=n_layer, n_head=4,
                                 n_embd=64, dropout=dropout))


def _torch_losses(n_layer=2, steps=STEPS):
    torch.set_num_threads(1)
    m = _gpt("torch", n_layer)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches(steps):
        opt.zero_grad()
        loss = m(x, y)[1]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


class _Train(sbpflow.nn.Graph):
    def __init__(self, m, opt, first):
        super().__init__()
        self.model, self.first = m, first
        self.add_optimizer(opt)

    def build(self, x, y):
        with sbpflow.default_placement(self.first):
            loss = self.model(x, y)[1]
        loss.backward()
        return loss


def _stage_of(i: int, n_layer: int, p: int) -> int:
    return i * p // n_layer


def _pipeline_losses(p: int, schedule: str, micro: int, n_layer: int = 2, steps=STEPS):
    torch.set_num_threads(1)
    m = _gpt("sbpflow", n_layer)
    pls = [sbpflow.placement("cpu", [s]) for s in range(p)]
    m.to_global(pls[0], B)
    t = m.transformer
    for mod in (t.wte, t.wpe, t.drop):
        mod.to(GraphModule).set_stage(0, pls[0])
    for i, blk in enumerate(t.h):
        s = _stage_of(i, n_layer, p)
        blk.to(GraphModule).set_stage(s, pls[s])
    for mod in (t.ln_f, m.lm_head):
        mod.to(GraphModule).set_stage(p - 1, pls[-1])
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    g = _Train(m, opt, pls[0])
    g.config.set_gradient_accumulation_steps(micro)
    g.config.set_pipeline_schedule(schedule)
    out = []
    for x, y in _batches(steps):
        xs = sbpflow.tensor(x, placement=pls[0], sbp=B)
        ys = sbpflow.tensor(y, placement=pls[-1], sbp=B)
        out.append(g(xs, ys).item())
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_follow_torch(dist_run, schedule):
    got = dist_run(2, _pipeline_losses, 2, schedule, 4)[0]
    want = _torch_losses()
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * abs(b), (got, want)
