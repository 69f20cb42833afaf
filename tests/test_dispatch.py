"""Dispatch and the chooser across op families: tables of the signatures chosen (and the
collectives that run) for cases of the family files, written from the math; errors of
mixed and invalid inputs; eager dispatch of local tensors."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, S1, S2

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def _all_cases():
    """The cases the tables below name, from their family files."""
    return oracle.all_cases("pointwise", "matmul", "reduce", "view", "index", "scan", "sort")


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
        fn, shapes = _all_cases()[name][:2]
        xs = [sbpflow.ones(*s, placement=pl, sbp=sb) for s, sb in zip(shapes, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


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
        sbpflow.ops.apply("add", x, torch.ones(2))


# ------------------------------------------------------------------ errors (issue 3 item 7)
def _error_messages():
    pl = sbpflow.placement.all("cpu")
    sub = sbpflow.placement("cpu", [0])
    x = sbpflow.ones(7, 5, placement=pl, sbp=S0)
    with pytest.raises(ValueError, match="different placements"):
        x + sbpflow.ones(7, 5, placement=sub, sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        x * sbpflow.ones(7, 5)
    with pytest.raises(ValueError, match=r"S\(2\) splits dim 2, but the tensor has 2 dims"):
        sbpflow.ones(7, 5).to_global(pl, split(2))
    with pytest.raises(ValueError, match=r"S\(-3\) splits dim -3"):
        sbpflow.tensor(np.ones((7, 5)), placement=pl, sbp=split(-3))
    with pytest.raises(ValueError, match=r"add: invalid inputs of global shapes \(7, 5\), "
                                         r"\(3,\) laid out \(S\(0\),\), \(B,\)"):
        x + sbpflow.ones(3, placement=pl, sbp=B)
    with pytest.raises(ValueError, match=r"matmul: invalid inputs of global shapes"):
        x @ sbpflow.ones(3, 2, placement=pl, sbp=B)
    with pytest.raises(ValueError, match="clamp: at least one"):
        x.clamp()
    with pytest.raises(ValueError, match="rounding_mode"):
        x.div(2, rounding_mode="round")
    with pytest.raises(ValueError, match="0-dimensional value tensor"):
        x.masked_fill(x > 0, sbpflow.ones(2, placement=pl, sbp=B))
    with pytest.raises(ValueError, match="to_global"):
        x.to("cuda")
    assert x.to("cpu") is x and x.to(torch.float32) is x
    return "ok"


def test_error_messages(dist_run):
    dist_run(2, _error_messages)


# ------------------------------------------------------------------ signature table
def _ones_f32(shape, sbp, pl):
    return sbpflow.ones(*shape, placement=pl, sbp=sbp)


# ------------------------------------------------------------------ errors
def _elementwise_global_errors():
    pl = sbpflow.placement.all("cpu")
    x = _ones_f32((4, 3), P, pl) * 1
    with pytest.raises(ValueError, match="no exact signature"):
        x.expm1_()
    with pytest.raises(TypeError, match="global but an argument is local"):
        _ones_f32((4, 3), S0, pl).atan2_(sbpflow.ones(4, 3))
    return "ok"


def test_global_errors(dist_run):
    assert dist_run(2, _elementwise_global_errors) == ["ok", "ok"]


# (case, input nd-SBPs, output SBP). Written from the math: each has a local signature,
# so no collective may run.
NO_COLLECTIVE_TABLE = [
    ("ri_heads", (S1,), S1),  # GQA: each rank repeats its own heads
    ("ri_heads", (S0,), S0),
    ("ri_int_dim1", (S0,), S0),
    ("index_add_0", (S1, B, S1), S1),
    ("index_add_0", (P, S0, S0), P),  # each rank adds its part of the source
    ("index_add_0", (P, B, P), P),
    ("index_fill_1", (S0, B), S0),
    ("cumprod_0", (S1,), S1),
    ("diagonal_batch", (S0,), S0),
    ("diag_embed", (S0,), S0),
    ("cdist", (S0, B), S0),
    ("cdist", (B, S0), S1),
    ("bucketize", (S1, B), S1),
    ("addmm", (P, S1, S0), P),  # a contracted split: P plus a P input
]


def _no_collective_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want in NO_COLLECTIVE_TABLE:
        fn, inputs = _all_cases()[name][:2]
        values, _ = oracle._values(name, inputs)
        xs = [sbpflow.tensor(v, placement=pl, sbp=s) for v, s in zip(values, ins)]
        with CommRecorder() as rec:
            out = oracle._first(fn(*xs))
        if out.sbp != (want,) or rec.kinds() != []:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want}")
    # GQA shapes: (batch, kv heads, seq, head size) with the heads split over the ranks.
    k = sbpflow.randn(2, 4, 6, 8, placement=pl, sbp=S1, requires_grad=True)
    with CommRecorder() as rec:
        out = k.repeat_interleave(2, dim=1)
        out.backward(sbpflow.ones(*out.shape, placement=pl, sbp=S1))
    if out.sbp != (S1,) or rec.kinds() != []:
        problems.append(f"GQA repeat: {out.sbp} with {rec.kinds()}")
    return problems


def test_no_collective_table(dist_run):
    results = dist_run(2, _no_collective_table)
    assert results[0] == [], "\n".join(results[0])


def _where_sbpflow():
    return sbpflow.__file__


def test_ranks_import_this_worktree(dist_run):
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert all(f.startswith(here) for f in dist_run(2, _where_sbpflow))


# (case, input nd-SBPs on 2 ranks) -> (output SBP, collectives that may run), from the
# math: each has a signature that needs no gather of the input.
SHAPE_INDEX_TABLE = [
    ("getitem_cols", (S0,), S0, []),             # x[:, 1:] on S(0): a local slice
    ("getitem_keep_split", (S0,), S0, []),
    # x[1:, ::2] slices the split dim: gathered once (the chooser never pads a shard into
    # a P summand, whose all-reduce downstream would cost more).
    ("getitem_slices", (S1,), B, ["all_gather"]),
    ("getitem_tensor", (S1, B), S1, []),
    ("getitem_tensor", (B, S0), S0, []),         # a split index splits the output
    ("squeeze_dim", (S2,), S1, []),               # renumbered
    ("unsqueeze", (S1,), S2, []),                 # a.unsqueeze(1) + ...: S(1) -> S(2)
    ("expand", (S0,), S1, []),
    ("repeat", (S0,), S1, []),
    ("flip", (S1,), S1, []),
    ("tril_triu", (S0,), S0, []),
    ("gather", (S0, S0), S0, []),
    ("index_select", (B, S0), S0, []),
    ("index_select", (S1, B), S1, []),
    ("scatter", (S0, S0, S0), S0, []),
    ("contiguous_clone", (S0,), S1, []),
    ("one_hot", (S1,), S1, []),
]


def _shape_index_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want, want_comms in SHAPE_INDEX_TABLE:
        fn, inputs = _all_cases()[name][:2]
        values, _ = oracle._values(name, inputs)
        xs = [sbpflow.tensor(v, placement=pl, sbp=sb) for v, sb in zip(values, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want} "
                            f"with {want_comms}")
    # scatter_add with the index and source split along dim: P, no communication.
    x = sbpflow.zeros(5, 7, placement=pl, sbp=B)
    i = sbpflow.tensor(torch.randint(0, 7, (5, 6)), placement=pl, sbp=S1)
    s = sbpflow.ones(5, 6, placement=pl, sbp=S1)
    with CommRecorder() as rec:
        out = x.scatter_add(1, i, s)
    if out.sbp != (P,) or rec.kinds():
        problems.append(f"scatter_add split dim: {out.sbp} with {rec.kinds()}")
    return problems


def test_shape_index_table(dist_run):
    results = dist_run(2, _shape_index_table)
    assert results[0] == [], "\n".join(results[0])
