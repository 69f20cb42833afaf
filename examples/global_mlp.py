"""Train a global MLP with the library alone (``pip install -e .``, no extra): tensor
parallel over every rank, a regression task on synthetic data, AdamW.

Run (2 ranks on one machine, gloo)::

    sbpflow launch --nproc-per-node 2 examples/global_mlp.py

The first Linear is split by output features (weight ``S(0)``, column parallel), the second
by input features (weight ``S(1)``, row parallel): its output is ``P``, summed once per
forward (an all-reduce) and once in backward. The batch ``(256, 16)`` is the same on every
rank (``B``). Rank 0 prints the loss every 10 steps and the layouts; the script exits 1
when the loss has not fallen to a quarter of its first value in 60 steps.
"""

from __future__ import annotations

import sys

import torch

import sbpflow
import sbpflow.nn as nn
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from sbpflow.sbp import broadcast

STEPS = 60

torch.set_num_threads(1)  # the ranks share this machine's cores
rank = sbpflow.distributed.get_rank()
pl = sbpflow.placement.all("cpu")  # 1-D mesh of every rank
sbpflow.manual_seed(0)  # the same parameters as one process would draw
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
parallelize_module(model, pl, {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-2)

x = sbpflow.randn(256, 16, placement=pl, sbp=broadcast)  # (batch, features)
w = sbpflow.randn(16, 1, placement=pl, sbp=broadcast)
y = (x @ w).sin()  # (batch, 1): the target

losses = []
for step in range(1, STEPS + 1):
    loss = (model(x) - y).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())  # collective: every rank reads it
    if rank == 0 and (step == 1 or step % 10 == 0):
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)

if rank == 0:
    print(f"world {sbpflow.distributed.get_world_size()}: layer 0 weight "
          f"{model[0].weight.sbp}, layer 2 weight {model[2].weight.sbp}; loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
sys.exit(0 if losses[-1] < losses[0] / 4 else 1)
