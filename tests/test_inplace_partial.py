"""In-place ops on layouts they cannot keep compute the logical value (issue 9, item 6).

``s = x.sum(0)`` of a split ``x`` is a pending sum (P); ``clamp_``/``relu_`` are not linear,
so no signature keeps P: sbpflow computes the value (all-reduce), writes it back in ``s``'s
own layout (the rank at coordinate 0 of each P axis holds it) and autograd sees the op.
``add_``/``mul_`` keep P (a number is counted once). Values and gradients are compared with
one-process torch, on 2 and 4 ranks and a 2x2 mesh, for a pending sum and a P matmul result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

OPS = {
    "clamp_": lambda t, o: t.clamp_(max=0.5),
    "clamp_min_max_": lambda t, o: t.clamp_(-0.3, 0.4),
    "relu_": lambda t, o: t.relu_(),
    "add_number": lambda t, o: t.add_(1.5),
    "add_tensor": lambda t, o: t.add_(o),
    "mul_number": lambda t, o: t.mul_(-2.0),
    "mul_tensor": lambda t, o: t.mul_(o),
    "chain": lambda t, o: t.add_(0.25).clamp_(max=0.6).mul_(o).relu_(),
}


def _program(lib, x, w, o_s, o_m, op):
    """A pending sum and a matmul result, each changed in place by ``op``, then a loss
    that weighs every element differently."""
    s = x.sum(0)  # (4,): P when x is split on dim 0
    m = x.t() @ w  # (4, 3): P when x and w are split on the contracted dim 0
    OPS[op](s, o_s)
    OPS[op](m, o_m)
    c_s = lib.arange(1, 5, dtype=lib.float32) / 4
    c_m = lib.arange(1, 13, dtype=lib.float32).reshape(4, 3) / 12
    return s, m, (s * c_s).sum() + (m * c_m).sum()


def _check(mesh, op):
    torch.manual_seed(0)
    x0, w0 = torch.randn(6, 4), torch.randn(6, 3)
    os0, om0 = torch.randn(4), torch.randn(4, 3)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    s_t, m_t, loss_t = _program(torch, x, w, os0, om0, op)
    loss_t.backward()

    pl = sbpflow.placement("cpu", mesh)
    nd = (split(0),) * pl.ndim
    bb = (sbpflow.sbp.broadcast,) * pl.ndim
    xg = sbpflow.tensor(x0, placement=pl, sbp=nd, requires_grad=True)
    wg = sbpflow.tensor(w0, placement=pl, sbp=nd, requires_grad=True)
    osg = sbpflow.tensor(os0, placement=pl, sbp=bb)
    omg = sbpflow.tensor(om0, placement=pl, sbp=bb)
    with sbpflow.default_placement(pl):
        s, m, loss = _program(sbpflow, xg, wg, osg, omg, op)
    assert s.sbp == (P,) * pl.ndim and m.sbp == (P,) * pl.ndim, (s.sbp, m.sbp)
    loss.backward()
    for got, want in ((s, s_t), (m, m_t), (loss, loss_t), (xg.grad, x.grad), (wg.grad, w.grad)):
        np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    return "ok"


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("mesh", [[0, 1], [0, 1, 2, 3], [[0, 1], [2, 3]]],
                         ids=["2", "4", "2x2"])
def test_inplace_on_partial_matches_torch(dist_run, mesh, op):
    n = int(np.asarray(mesh).size)
    assert dist_run(n, _check, mesh, op) == ["ok"] * n


def _storage_kept():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.ones(4, 3, placement=pl, sbp=split(0))
    s = x.sum(0)  # a pending sum of 4 per element
    local = s.to_local().to_torch()
    out = s.clamp_(max=2)
    assert out is s and s.sbp == (P,) and s.to_local().to_torch() is local
    return s.numpy().tolist()


def test_clamp_of_pending_sum_reads_the_clamped_value(dist_run):
    assert dist_run(2, _storage_kept) == [[2.0, 2.0, 2.0]] * 2
