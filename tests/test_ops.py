"""Op registry and eager dispatch: every case against plain torch on one process, for
every input layout on 1-D meshes of 2 and 4 ranks and a sample of 2x2 layouts, values and
gradients; plus a table of chosen signatures written independently of the rules."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2 = split(0), split(1), split(2)


def _cat(ts, dim):
    return (torch.cat if isinstance(ts[0], torch.Tensor) else sbpflow.cat)(ts, dim=dim)


def _stack(ts, dim):
    return (torch.stack if isinstance(ts[0], torch.Tensor) else sbpflow.stack)(ts, dim=dim)

# name -> (function usable on torch and sbpflow tensors, input shapes)
CASES = {
    "add": (lambda a, b: a + b, [(7, 5), (7, 5)]),
    "add_broadcast": (lambda a, b: a + b, [(7, 5), (5,)]),
    "sub": (lambda a, b: a - b, [(7, 5), (1, 5)]),
    "mul": (lambda a, b: a * b, [(7, 5), (7, 5)]),
    "div": (lambda a, b: a / (b * b + 1), [(7, 5), (7, 5)]),
    "scalars": (lambda a: 3 - (2 * a + 1) / 4, [(7, 5)]),
    "neg_exp": (lambda a: (-a).exp(), [(7, 5)]),
    "relu_tanh": (lambda a: a.relu() + a.tanh(), [(7, 5)]),
    "unary_mix": (lambda a: a.sigmoid() + a.sin() * abs(a) + (a * a + 1).sqrt().log()
                  + a.square().log1p() - a.cos().exp() + a.erf(), [(7, 5)]),
    "compare_max": (lambda a, b: a.maximum(b) + a.minimum(b) * 2 + (a > b) * 1.0
                    + a.pow(2) + (a ** 2) * (b <= a), [(7, 5), (5,)]),
    "matmul": (lambda a, b: a @ b, [(7, 5), (5, 6)]),
    "matmul_batched": (lambda a, b: a @ b, [(3, 7, 5), (5, 6)]),
    "matvec": (lambda a, b: a @ b, [(7, 5), (5,)]),
    "sum_all": (lambda a: a.sum(), [(7, 5)]),
    "sum_dim": (lambda a: a.sum(dim=1), [(7, 5)]),
    "sum_keepdim": (lambda a: a.sum(dim=0, keepdim=True), [(7, 5)]),
    "mean_all": (lambda a: a.mean(), [(7, 5)]),
    "mean_dim": (lambda a: a.mean(dim=0), [(7, 5)]),
    "mean_dims": (lambda a: a.mean(dim=(0, 2), keepdim=True), [(3, 7, 5)]),
    "permute": (lambda a: a.permute(2, 0, 1) * 2, [(3, 7, 5)]),
    "transpose_t": (lambda a, b: a.transpose(0, 1) @ b.t(), [(7, 5), (3, 7)]),
    "reshape_merge_tail": (lambda a: a.reshape(3, 35), [(3, 7, 5)]),
    "reshape_split_tail": (lambda a: a.reshape(7, 5, 1, 1) + 1, [(7, 5)]),
    "view_flatten": (lambda a: a.view(-1, 5).flatten(), [(3, 7, 5)]),
    "reshape_heads": (lambda a: a.reshape(2, 3, 4, 2).transpose(1, 2) * 1, [(2, 3, 8)]),
    "reshape_odd_heads": (lambda a: a.reshape(2, 3, 3, 2), [(2, 3, 6)]),
    "reshape_merge_lead": (lambda a: a.reshape(24, 5) + 1, [(4, 6, 5)]),
    "cat_dim1": (lambda a, b: _cat([a, b * 2], dim=1), [(7, 5), (7, 3)]),
    "cat_dim0": (lambda a, b: _cat([a, b], dim=0) + 1, [(7, 5), (2, 5)]),
    "stack": (lambda a, b: _stack([a, b], dim=1).sum(dim=1), [(7, 5), (7, 5)]),
    "amax_dim": (lambda a: a.amax(dim=0) * 2, [(7, 5)]),
    "amin_all": (lambda a: a.amin(), [(7, 5)]),
    "amax_keep": (lambda a: a - a.amax(dim=1, keepdim=True), [(7, 5)]),
    "amax_ties": (lambda a: (a * 0).amax(dim=1) + a.relu().amin(dim=0).sum(), [(7, 5)]),
}


def _sweep_1d(names):
    return oracle.sweep_1d(CASES, names)


@pytest.mark.parametrize("world", [2, 4])
def test_ops_every_1d_layout_match_torch(dist_run, world):
    results = dist_run(world, _sweep_1d, sorted(CASES))
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2(names, per_case):
    return oracle.sweep_2x2(CASES, names, per_case)


def test_ops_2x2_sampled_layouts_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), 12)
    assert results[0] == [], "\n".join(results[0])


@pytest.mark.exhaustive
def test_ops_2x2_every_layout_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), None, timeout=1800)
    assert results[0] == [], "\n".join(results[0])


# (case, input nd-SBPs) -> (output SBP, collectives that may run). Written from the
# math, not from the rules: a local signature exists for each, so nothing may be gathered.
SIGNATURE_TABLE = [
    ("matmul", (S0, B), S0, []),
    ("matmul", (B, S1), S1, []),
    ("matmul", (S1, S0), P, []),
    ("add", (S0, S0), S0, []),
    ("add", (S1, S1), S1, []),
    ("add", (P, P), P, []),
    ("add_broadcast", (S0, B), S0, []),
    ("mul", (P, B), P, []),
    ("relu_tanh", (S1,), S1, []),
    ("relu_tanh", (B,), B, []),
    ("sum_dim", (S0,), S0, []),
    ("sum_dim", (S1,), P, []),
    ("sum_keepdim", (S1,), S1, []),
    ("scalars", (S0,), S0, []),
    ("mean_dim", (S0,), P, []),
    ("mean_dim", (S1,), S0, []),
    ("permute", (S0,), S1, []),
    ("transpose_t", (S0, S1), P, []),  # a.T is S(1), b.t() is S(0): contracted k
    ("reshape_merge_tail", (S0,), S0, []),
    ("reshape_heads", (S2,), S1, []),  # C = 4 heads x 2 split over heads, then transposed
    ("reshape_merge_lead", (S0,), S0, []),  # 4 x 6 rows merged: shards line up
    ("cat_dim1", (S0, S0), S0, []),
    ("stack", (S1, S1), S1, []),  # stacked on dim 1, then summed over it
]


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want, want_comms in SIGNATURE_TABLE:
        fn, shapes = CASES[name]
        xs = [sbpflow.ones(*s, placement=pl, sbp=sb) for s, sb in zip(shapes, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


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


def _extremum_runs_one_max_all_reduce():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.randn(7, 5, placement=pl, sbp=S0)
    with CommRecorder() as rec:
        m = x.amax(dim=0)
    # A local max, then an all-reduce MAX (and one SUM of the tie counts, for backward).
    assert m.sbp == (B,) and [r.kind for r in rec.records] == ["all_reduce", "all_reduce"]
    with CommRecorder() as rec:
        k = x.amax(dim=1)
    assert k.sbp == (S0,) and rec.kinds() == []
    return "ok"


def test_extremum_collectives(dist_run):
    dist_run(2, _extremum_runs_one_max_all_reduce)


def test_megatron_mlp_one_all_reduce_each_way(dist_run):
    dist_run(2, _megatron_mlp_forward_backward)


def test_local_ops_and_errors():
    x = sbpflow.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = (x @ x + 2 * x - 1).relu().sum()
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    u = (t @ t + 2 * t - 1).relu().sum()
    y.backward()
    u.backward()
    assert y.item() == u.item() and torch.equal(x.grad.to_torch(), t.grad)
    g = sbpflow.ones(2, 2, placement=sbpflow.placement("cpu", [0]), sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        x + g
    with pytest.raises(TypeError, match="expected an sbpflow.Tensor"):
        sbpflow.ops.dispatch("add", x, torch.ones(2))


def _dropout_bit_exact(world_layouts):
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(7, 5)
    for layout in world_layouts:
        sbpflow.manual_seed(11)
        x = sbpflow.tensor(xv, placement=pl, sbp=layout, requires_grad=True)
        y = sbpflow.ops.dropout(x, p=0.3)
        y.backward(sbpflow.ones(7, 5, placement=pl, sbp=y.sbp))
        xr = xv.clone().requires_grad_(True)
        torch.manual_seed(11)
        yr = torch.nn.functional.dropout(xr, 0.3, True)
        yr.sum().backward()
        assert y.sbp == (layout,)
        assert np.array_equal(y.numpy(), yr.detach().numpy()), layout  # bit for bit
        assert np.array_equal(x.grad.numpy(), xr.grad.numpy()), layout
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dropout_layout_invariant_bit_exact(dist_run, world):
    dist_run(world, _dropout_bit_exact, [S0, S1, B, P])


def test_dropout_local_and_errors():
    torch.manual_seed(2)
    a = sbpflow.ops.dropout(sbpflow.ones(4, 4), 0.5).to_torch()
    torch.manual_seed(2)
    assert torch.equal(a, torch.nn.functional.dropout(torch.ones(4, 4), 0.5, True))
    x = sbpflow.ones(3)
    assert sbpflow.ops.dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match="between 0 and 1"):
        sbpflow.ops.dropout(x, 1.5)
