"""Let sbpflow choose the layout: two MLPs written for one device, trained as
``nn.Graph`` steps with ``config.enable_auto_parallel()`` on every rank.

Run (2 ranks on one machine, gloo)::

    sbpflow launch --nproc-per-node 2 examples/auto_parallel.py

No layout is given: the model is laid out broadcast (``to_global(placement, B)``, what
one process would hold) and each batch is whole on every rank. At its first call each
graph prices the layouts it could run (data parallel, tensor parallel per Linear,
replicated; a few dozen logical graphs, a few seconds) on this machine's calibration
(measured once when none is cached), applies the cheapest to the parameters and prints
why it chose it. A wide MLP (a large weight, few samples) and a tall one (small weights,
many samples) get different layouts. Rank 0 prints each plan, the loss, and each
parameter's layout; the script exits 1 when a loss has not fallen.
"""

from __future__ import annotations

import sys

import torch

import sbpflow
import sbpflow.nn as nn
from sbpflow.sbp import broadcast

torch.set_num_threads(1)  # the ranks share this machine's cores
rank = sbpflow.distributed.get_rank()
pl = sbpflow.placement.all("cpu")  # 1-D mesh of every rank


class Step(nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_auto_parallel(True)  # OneFlow's switch

    def build(self, x, y):
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def train(name: str, widths: list[int], batch: int) -> bool:
    sbpflow.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers).to_global(pl, broadcast)  # no layout chosen
    step = Step(model, sbpflow.optim.AdamW(model.parameters(), lr=1e-3))
    x = sbpflow.randn(batch, widths[0], placement=pl, sbp=broadcast)
    y = x[:, :widths[-1]].sin()
    losses = [step(x, y).item() for _ in range(10)]
    if rank == 0:
        print(f"\n{name} MLP {widths}, batch {batch}:")
        print(step.auto_parallel_plan)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; layouts: "
              + ", ".join(f"{n} {p.sbp}" for n, p in model.named_parameters()
                          if n.endswith("weight")))
    return losses[-1] < losses[0]


ok = train("wide", [256, 8192, 256], 8) & train("tall", [32] * 9, 512)
sys.exit(0 if ok else 1)
