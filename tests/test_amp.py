"""AMP: torch.autocast on sbpflow's local kernels, and a GradScaler whose inf/nan verdict
agrees across ranks (a rank with an overflowing shard makes every rank skip)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split


def _autocast_matmul():
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = a @ b
    with sbpflow.autocast("cpu", dtype=torch.bfloat16):
        out = sbpflow.tensor(a, placement=pl, sbp=split(0)) @ sbpflow.tensor(
            b, placement=pl, sbp=B)
    assert out.dtype == torch.bfloat16 and ref.dtype == torch.bfloat16
    whole = out.to_global(sbp=B).to_local().to_torch()
    assert torch.equal(whole, ref)
    return "ok"


@pytest.mark.parametrize("world", [1, 2])
def test_autocast_bf16_matches_torch(dist_run, world):
    dist_run(world, _autocast_matmul)


def _scaler_steps(poison_rank):
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(1)
    wv, xv = torch.randn(4, 3, generator=g), torch.randn(5, 4, generator=g)
    w = nn.Parameter(sbpflow.tensor(wv, placement=pl, sbp=split(0)))  # each rank a shard
    x = sbpflow.tensor(xv, placement=pl, sbp=B)
    tw = torch.nn.Parameter(wv.clone())
    opt, topt = sbpflow.optim.SGD([w], lr=0.1), torch.optim.SGD([tw], lr=0.1)
    scaler = sbpflow.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    tscaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(4):
        opt.zero_grad()
        topt.zero_grad()
        scaler.scale((x @ w).square().mean()).backward()
        tscaler.scale((xv @ tw).square().mean()).backward()
        if step == 1:  # an overflow in one rank's shard only
            if sbpflow.distributed.get_rank() == poison_rank:
                w.grad._local[0, 0] = float("inf")
            with torch.no_grad():
                tw.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        tscaler.step(topt)
        tscaler.update()
        assert scaler.get_scale() == tscaler.get_scale(), step
        assert np.allclose(w.numpy(), tw.detach().numpy(), rtol=1e-6, atol=1e-7), step
    return scaler.get_scale()


def test_grad_scaler_agrees_across_ranks(dist_run):
    scales = dist_run(2, _scaler_steps, 1)
    assert scales[0] == scales[1] == 2.0 ** 9  # one backoff, no growth in 4 steps


def test_grad_scaler_local():
    assert _scaler_steps(0) == 2.0 ** 9
