"""Property test: random chains of 5-10 ops on random input layouts (2 ranks) give
torch's values and gradients. Hypothesis draws the chain and layouts in the pytest
process; the ranks replay the same concrete chain."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

# Each step takes the running value x and the second input w (both (6, 4)).
STEPS = {
    "add_w": lambda x, w: x + w,
    "mul_w": lambda x, w: x * w,
    "sub_w": lambda x, w: w - x,
    "max_w": lambda x, w: x.maximum(w),
    "relu": lambda x, w: x.relu(),
    "tanh": lambda x, w: x.tanh(),
    "sigmoid": lambda x, w: x.sigmoid(),
    "scale": lambda x, w: x * 0.5 + 1,
    "neg_square": lambda x, w: -(x.square()),
    "col_mean": lambda x, w: x - x.mean(dim=0, keepdim=True),
    "row_sum": lambda x, w: x * x.sum(dim=1, keepdim=True),
    "gram": lambda x, w: (x @ w.t()) @ w * 0.1,
    "transpose_twice": lambda x, w: x.t().t(),
}
LAYOUTS = {"S0": split(0), "S1": split(1), "B": B, "P": P}


def _replay(steps, x, w):
    for name in steps:
        x = STEPS[name](x, w)
    return x


def _chain_body(steps, lx, lw):
    import torch

    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(len(steps) * 7 + 1)
    xv, wv = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    xr, wr = xv.clone().requires_grad_(True), wv.clone().requires_grad_(True)
    ref = _replay(steps, xr, wr)
    weight = torch.randn(ref.shape, generator=g)
    (ref * weight).sum().backward()
    x = sbpflow.tensor(xv, placement=pl, sbp=LAYOUTS[lx], requires_grad=True)
    w = sbpflow.tensor(wv, placement=pl, sbp=LAYOUTS[lw], requires_grad=True)
    out = _replay(steps, x, w)
    out.backward(sbpflow.tensor(weight, placement=pl, sbp=out.sbp))
    problems = []
    pairs = [("value", out, ref.detach())]
    for what, mine, theirs in [("x.grad", x.grad, xr.grad), ("w.grad", w.grad, wr.grad)]:
        if (mine is None) != (theirs is None):  # an unused input has no gradient in both
            problems.append(f"{what}: sbpflow {mine is not None}, torch {theirs is not None}")
        elif mine is not None:
            pairs.append((what, mine, theirs))
    for what, mine, theirs in pairs:
        got, want = mine.numpy(), theirs.numpy()
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            problems.append(f"{what} differs (max {np.abs(got - want).max():.3g})")
    return problems


@settings(max_examples=60, deadline=None, derandomize=True)
@given(steps=st.lists(st.sampled_from(sorted(STEPS)), min_size=5, max_size=10),
       lx=st.sampled_from(sorted(LAYOUTS)), lw=st.sampled_from(sorted(LAYOUTS)))
def test_random_op_chains_match_torch(dist_pools, steps, lx, lw):
    results = dist_pools(2, _chain_body, steps, lx, lw)
    assert results[0] == [], f"{steps} x={lx} w={lw}: {results[0]}"
