"""torch's functions that are not Tensor methods (sbpflow/ops/torch_functions): shape
helpers, contractions, numerical calculus and small things through the op oracle (every
layout); creation, replicated and random functions against torch directly.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import Input, lib

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def _shapes(a, v):
    L = lib(a)
    return (a + L.broadcast_tensors(a, v)[1] + L.atleast_3d(a).squeeze(-1)
            + L.dstack([a, a]).sum(-1) + L.row_stack([a, v])[:7] * 2
            + L.atleast_2d(v) + L.meshgrid(a[:, 0], v, indexing="ij")[1],
            L.column_stack([v, v]), L.meshgrid(v, v[:3], indexing="xy")[0])


def _contractions(a, b):
    L = lib(a)
    return (L.tensordot(a, b, 1) + L.chain_matmul(a, b) + L.frobenius_norm(a, (0, 1))
            + L.nuclear_norm(a) * 0.1,
            L.tensordot(a, a, dims=([0], [0])), L.norm_except_dim(a, 2, 1))


def _calculus(y, x):
    L = lib(y)
    return (L.trapezoid(y, x) + L.trapz(y) + L.trapezoid(y, dx=0.5),
            L.cumulative_trapezoid(y, dim=0), L.cumulative_trapezoid(y, x),
            L.gradient(y, spacing=0.5)[1], L.gradient(y, dim=0)[0])


def _small(v):
    L = lib(v)
    w = v.detach()  # torch's vander is not differentiable (an in-place cumprod_)
    return (L.vander(w, 4) + L.vander(w, 4, increasing=True) * 2
            + L.rsub(v, 2.0, alpha=3).unsqueeze(1) + L.fill(v, 1.5).unsqueeze(1),
            L.unravel_index((v.abs() * 10).long(), (3, 4))[1])


CASES = {
    **oracle.policy({
        "shape_functions": (_shapes, [(7, 5), (5,)]),
        "contractions": (_contractions, [(7, 5), (5, 3)], {"rtol": 1e-4, "atol": 1e-5}),
        "calculus": (_calculus, [(7, 5), Input(lambda g: torch.rand(5, generator=g).cumsum(0),
                                               layouts=(split(0), B, P))]),
        "vander_rsub_fill_unravel": (_small, [(5,)]),
    }, local="close", sample_2x2=1, full_2x2_max=36),  # exhaustive: 2x2 up to 36, else covering
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


# ------------------------------------------------------------------ not through the oracle
def _created():
    pl = sbpflow.placement.all("cpu")
    out = []
    for name, args in (("hann_window", (8,)), ("kaiser_window", (6,)),
                       ("logspace", (0, 2, 5)), ("scalar_tensor", (3.5,))):
        want = getattr(torch, name)(*args)
        sbp = B if want.ndim == 0 else split(0)
        got = getattr(sbpflow, name)(*args, placement=pl, sbp=sbp)
        local = getattr(sbpflow, name)(*args)
        out.append((name, got.is_global and np.array_equal(got.numpy(), want.numpy())
                    and np.array_equal(local.numpy(), want.numpy())))
    r = sbpflow.range(1, 4, 0.5, placement=pl, sbp=split(0))
    out.append(("range", np.array_equal(r.numpy(), torch.range(1, 4, 0.5).numpy())))
    e = sbpflow.empty_strided((4, 3), (1, 4), placement=pl, sbp=split(0))
    out.append(("empty_strided", tuple(e.shape) == (4, 3) and e.sbp == (split(0),)))
    v = torch.tensor([1, 5, 2, 7, 5, 3])
    x = sbpflow.tensor(v, placement=pl, sbp=split(0))
    t = sbpflow.tensor(torch.tensor([5, 3]), placement=pl, sbp=B)
    isin = sbpflow.isin(x, t)
    out.append(("isin", isin.sbp == (split(0),) and
                np.array_equal(isin.numpy(), torch.isin(v, torch.tensor([5, 3])).numpy())))
    probs = torch.full((6, 4), 0.3)
    for sbp in (split(0), split(1), B):
        torch.manual_seed(5)
        b = sbpflow.binomial(sbpflow.tensor(torch.full((6, 4), 10.0), placement=pl, sbp=sbp),
                             sbpflow.tensor(probs, placement=pl, sbp=sbp))
        torch.manual_seed(5)
        want = torch.binomial(torch.full((6, 4), 10.0), probs)
        out.append((f"binomial {sbp}", np.array_equal(b.numpy(), want.numpy())))
    bd = sbpflow.block_diag(x.reshape(2, 3), t.reshape(1, 2))
    out.append(("block_diag", np.array_equal(
        bd.numpy(), torch.block_diag(v.reshape(2, 3), torch.tensor([[5, 3]])).numpy())))
    return out


def test_creation_replicated_and_random_functions_on_global_tensors(dist_run):
    for rows in dist_run(2, _created):
        bad = [r for r in rows if not r[1]]
        assert not bad, bad


def test_local_functions_follow_torch():
    v = torch.tensor([1.0, 2.0, 3.0])
    x = sbpflow.tensor(v)
    assert torch.equal(sbpflow.asarray([1, 2]).to_torch(), torch.asarray([1, 2]))
    assert sbpflow.asarray(x) is x and sbpflow.asarray(x, copy=True) is not x
    assert sbpflow.numel(x) == 3 and sbpflow.is_signed(x)
    y = sbpflow.tensor(v, requires_grad=True) * 2
    sbpflow.detach_(y)
    assert not y.requires_grad
    assert sbpflow.empty_strided((2, 3), (1, 2)).stride() == (1, 2)
    with pytest.raises(RuntimeError, match="one-dimensional"):
        sbpflow.vander(sbpflow.tensor(torch.ones(2, 2)))
    with pytest.raises(ValueError, match="indexing"):
        sbpflow.meshgrid(x, x, indexing="ji")
