"""Matrix products (sbpflow/ops/matmul): matmul, mm, bmm, addmm, addmv, baddbmm, addbmm,
cross, cdist, dist, linear.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import torch
from _oracle import S0, S1, S2, _floats, lib, nnf

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P

CASES = {
    # Swept more densely: 6 sampled 2x2 combinations per case (3 for the others).
    **oracle.policy({
        "matmul": (lambda a, b: a @ b, [(7, 5), (5, 6)]),
        "matmul_batched": (lambda a, b: a @ b, [(3, 7, 5), (5, 6)]),
        "matvec": (lambda a, b: a @ b, [(7, 5), (5,)]),
        "transpose_t": (lambda a, b: a.transpose(0, 1) @ b.t(), [(7, 5), (3, 7)]),
    }, sample_2x2=6),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "cross": (lambda a, b: a.cross(b, dim=1), [(7, 3), (7, 3)]),
        "cross_bcast": (lambda a, b: a.cross(b, dim=-1), [(7, 3), _floats((1, 3), (B, P))]),
        "addmm": (lambda x, a, b: x.addmm(a, b, beta=0.5, alpha=2),
                  [_floats((7, 6), (B, P)), _floats((7, 5), (S0, S1, B)),
                   _floats((5, 6), (S0, S1, B))]),
        "addmm_bcast": (lambda x, a, b: lib(a).addmm(x, a, b),
                        [_floats((6,), (B,)), (7, 5), _floats((5, 6), (S1, B))]),
        "addmv": (lambda x, a, v: x.addmv(a, v, alpha=3),
                  [_floats((7,), (B, P)), _floats((7, 5), (S0, S1, B)), _floats((5,), (S0, B))]),
        "baddbmm": (lambda x, a, b: x.baddbmm(a, b, beta=2), [_floats((3, 7, 4), (S0, B)),
                                                             _floats((3, 7, 5), (S0, S2, B)),
                                                             _floats((3, 5, 4), (S0, S1, B))]),
        "addbmm": (lambda x, a, b: x.addbmm(a, b),
                   [_floats((7, 4), (B, P)), _floats((3, 7, 5), (S0, S2, B)),
                    _floats((3, 5, 4), (S0, S1, B))]),
        "cdist": (lambda a, b: lib(a).cdist(a, b), [(7, 5), (3, 5)], {"rtol": 1e-4, "atol": 1e-5}),
        "cdist_batched_p1": (lambda a, b: lib(a).cdist(a, b, p=1),
                             [_floats((2, 7, 5), (S0, S1, B)), _floats((2, 3, 5), (S0, S1, B))]),
        "dist": (lambda a, b: a.dist(b), [(7, 5), _floats((7, 5), (S0, B, P))]),
        "dist_p3": (lambda a, b: lib(a).dist(a, b, 3), [(7, 5), (5,)]),
    }, full_2x2_max=36, local="values"),
    # Large products: a covering sample of 1-D layouts (all of them when exhaustive),
    # 3 sampled 2x2, a 2x2 covering set when exhaustive; local gradients weighted.
    **oracle.policy({
        "linear": (lambda x, w_, b: nnf(x).linear(x, w_, b), [(3, 7, 5), (6, 5), (6,)]),
        "linear_nobias": (lambda x, w_: nnf(x).linear(x, w_), [(7, 5), (6, 5)]),
    }, sample_1d={2: 6, 4: 4}, sample_2x2=3, full_2x2_max=0, covering_extra=8,
    local_atol=1e-5, local_weighted=True),
    # Swept on 1-D meshes only (and a 2x2 covering set when exhaustive).
    **oracle.policy({
        "einsum": (lambda a, b: oracle.lib(a).einsum("bij,jk->bik", a, b), [(2, 5, 4), (4, 3)]),
        "einsum_ellipsis": (lambda a, b: oracle.lib(a).einsum("...j,jk->...k", a, b),
                            [(5, 4), (4, 3)]),
        "mm_outer": (lambda a, b: a.mm(b) + oracle.lib(a).outer(a[:, 0], b[0]), [(5, 4), (4, 3)]),
    }, sample_2x2=0, full_2x2_max=36, local_atol=1e-5),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def _megatron_mlp_forward_backward():
    # Column-parallel then row-parallel linear (x @ W with W (in, out): S(1) then S(0)):
    # exactly one all-reduce of activations forward (P -> B of the block output) and one
    # backward (its dual, P -> B of the output gradient). The input x is data here; in a
    # stack of blocks its P gradient would feed the previous block's boundary instead.
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    x_t, w1_t, w2_t = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8)
    x = sbpflow.tensor(x_t, placement=pl, sbp=B)
    w1 = sbpflow.tensor(w1_t, placement=pl, sbp=S1, requires_grad=True)
    w2 = sbpflow.tensor(w2_t, placement=pl, sbp=S0, requires_grad=True)
    with CommRecorder() as fwd:
        h = (x @ w1).relu()
        y = (h @ w2).to_global(sbp=B)
    assert h.sbp == (S1,) and fwd.kinds() == ["all_reduce"], fwd.kinds()
    with CommRecorder() as bwd:
        y.backward(sbpflow.ones(4, 8, placement=pl, sbp=B))
    # Sharded weights: their gradients are already in their own layout (no sync).
    assert bwd.kinds() == ["all_reduce"], bwd.kinds()
    w1r, w2r = (t.clone().requires_grad_(True) for t in (w1_t, w2_t))
    ((x_t @ w1r).relu() @ w2r).sum().backward()
    for a, b in [(w1, w1r), (w2, w2r)]:
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-5)
    return "ok"


def test_megatron_mlp_one_all_reduce_each_way(dist_run):
    dist_run(2, _megatron_mlp_forward_backward)
