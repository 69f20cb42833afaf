"""Shape and indexing ops (sbpflow/ops/_shape.py) against plain torch on one process:
every 1-D input layout on 2 and 4 ranks, a sample of 2x2 layouts (uneven dims), values and
gradients; a signature table of the communication that matters; setitem and its errors;
local mode."""

from __future__ import annotations

import _oracle as oracle
import pytest
import torch
from _oracle import Input, ints

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2 = split(0), split(1), split(2)


def _f(shape, layouts=None):
    """A float input; ``layouts`` restricts the 1-D SBPs tried (setitem targets: no P)."""
    return Input(lambda g, s=tuple(shape): torch.randn(s, generator=g), layouts=layouts)


def _perm_index(rows, cols, keep, layouts=None):
    """Per row, ``keep`` distinct column indices (no duplicates: scatter is then exact)."""
    return Input(lambda g: torch.argsort(torch.rand(rows, cols, generator=g), dim=1)[:, :keep],
                 grad=False, layouts=layouts)


def _ints(shape, high, layouts):
    return Input(lambda g: torch.randint(0, high, shape, generator=g), grad=False,
                 layouts=layouts)


def _cat(ts, dim):
    return (torch.cat if isinstance(ts[0], torch.Tensor) else sbpflow.cat)(ts, dim=dim)


def _weighted(pieces, dim):
    return _cat([p * (k + 1) for k, p in enumerate(pieces)], dim)


def _one_hot(i, n=-1):
    return (sbpflow.one_hot if isinstance(i, sbpflow.Tensor) else
            torch.nn.functional.one_hot)(i, n)


def _set(idx, scalar=None):
    """``y = a.clone(); y[idx] = v (or scalar); return y`` for torch and sbpflow alike."""
    def fn(a, v=None):
        y = a.clone()
        y[idx] = scalar if v is None else v
        return y
    return fn


def _set_index(a, i, v):
    y = a.clone()
    y[i] = v
    return y


def _set_mask(a):
    y = a.clone()
    y[a > 0.5] = -1.0
    return y


NO_P2 = (S0, S1, B)
NO_P3 = (S0, S1, S2, B)

# name -> (fn on torch and sbpflow tensors, inputs[, opts])
CASES = {
    "squeeze_dim": (lambda a: a.squeeze(1) * 2, [(7, 1, 5)]),
    "squeeze_all": (lambda a: a.squeeze(), [(1, 7, 1, 3)]),
    "squeeze_tuple": (lambda a: a.squeeze((0, -2)), [(1, 5, 1, 3)]),
    "unsqueeze": (lambda a: a.unsqueeze(1) + a.unsqueeze(-1).sum(-1).unsqueeze(0), [(7, 5)]),
    "expand": (lambda a: a.expand(3, 7, 5), [(7, 1)]),
    "expand_as": (lambda a, b: a.expand_as(b) * b, [(1, 5), (7, 5)]),
    "repeat": (lambda a: a.repeat(2, 1, 3), [(7, 5)]),
    "unflatten": (lambda a: a.unflatten(1, (2, -1)), [(7, 6)]),
    "split_int": (lambda a: _weighted(a.split(2, dim=1), 1), [(5, 7)]),
    "split_sizes": (lambda a: _weighted(a.split([3, 4], dim=0), 0), [(7, 5)]),
    "chunk": (lambda a: _weighted(a.chunk(3, dim=1), 1), [(5, 7)]),
    "narrow": (lambda a: a.narrow(1, -4, 3), [(5, 7)]),
    "getitem_slices": (lambda a: a[1:, ::2], [(7, 5)]),
    "getitem_int": (lambda a: a[-1, 2:] + a[0, :3], [(7, 5)]),
    "getitem_none_ellipsis": (lambda a: a[..., None] * a[None, 1].unsqueeze(-1), [(3, 7, 5)]),
    "getitem_keep_split": (lambda a: a[:, 1:3, :], [(3, 7, 5)]),
    "getitem_cols": (lambda a: a[:, 1:], [(7, 5)]),
    "getitem_tensor": (lambda a, i: a[i], [(7, 5), ints((4,), 7, -7)]),
    "getitem_tensor_2d": (lambda a, i: a[:, i], [(3, 5), ints((3, 2), 5)]),
    # Three-input cases try fewer layouts of their secondary inputs (runtime); every
    # layout that gives a local signature is kept.
    "getitem_tensors_apart": (lambda a, i, j: a[i, :, j], [_f((3, 4, 5), (S1, B, P)),
                                                            ints((2, 3), 3), ints((3,), 5)]),
    "getitem_list": (lambda a: a[[0, 2, -1], 1:], [(7, 5)]),
    "getitem_mask": (lambda a: a[a > 0.5], [(7, 5)]),
    "setitem_scalar": (_set((slice(1, 4), slice(None, None, 2)), 0.5), [_f((7, 5), NO_P2)]),
    "setitem_int_row": (_set(2), [_f((7, 5), NO_P2), (5,)]),
    "setitem_cols": (_set((slice(None), slice(1, 3))), [_f((7, 5), NO_P2), (7, 2)]),
    "setitem_step_bcast": (_set((slice(1, None, 3), 2)), [_f((7, 5), NO_P2), (1,)]),
    "setitem_3d": (_set((slice(None), 1, slice(2, 5))), [_f((3, 7, 5), NO_P3), (3, 3)]),
    "setitem_tensor": (_set_index, [_f((7, 5), (S1, B)), ints((3,), 7), (5,)]),
    "setitem_mask": (_set_mask, [_f((7, 5), NO_P2)]),
    "gather": (lambda a, i: a.gather(1, i), [(5, 7), ints((5, 4), 7)]),
    "gather_dim0": (lambda a, i: a.gather(0, i), [(7, 5), ints((3, 5), 7)]),
    "take_along_dim": (lambda a, i: a.take_along_dim(i, dim=1), [(5, 7), ints((1, 3), 7)]),
    "take_along_flat": (lambda a, i: a.take_along_dim(i), [(5, 3), ints((4,), 15)]),
    "index_select": (lambda a, i: a.index_select(0, i) * 2, [(7, 5), ints((4,), 7)]),
    "scatter": (lambda a, i, s: a.scatter(1, i, s), [(5, 7), _perm_index(5, 7, 4, (S0, B)),
                                                     _f((5, 4), (S0, S1, P))]),
    "scatter_value": (lambda a, i: a.scatter(1, i, 2.0), [(5, 7), _perm_index(5, 7, 3)]),
    "scatter_add": (lambda a, i, s: a.scatter_add(1, i, s), [(5, 7), _ints((5, 6), 7, (S1, B)),
                                                             _f((5, 6), (S1, P))]),
    "flip": (lambda a: a.flip(0, 2), [(3, 7, 5)]),
    "roll": (lambda a: a.roll(2, 1) + a.roll(3) + a.roll((1, -2), (0, 1)), [(7, 5)]),
    "tril_triu": (lambda a: a.tril(-1) + a.triu(1) * 2, [(3, 5, 4)]),
    "contiguous_clone": (lambda a: a.t().contiguous() + a.t().clone(), [(7, 5)]),
    "one_hot": (lambda i: _one_hot(i, 6), [ints((7, 3), 6)]),
    "one_hot_auto": (lambda i: _one_hot(i) * 2, [ints((5,), 4)]),
    "topk_dim1": (lambda a: a.topk(3, dim=1), [(5, 7)]),
    "topk_dim0_smallest": (lambda a: a.topk(4, dim=0, largest=False), [(7, 5)]),
    "sort": (lambda a: a.sort(dim=0, descending=True), [(7, 5)]),
    "sort_last": (lambda a: a.sort(), [(5, 7)]),
}


def _sweep_1d(names):
    return oracle.sweep_1d(CASES, names)


def _sweep_2x2(names, per_case):
    return oracle.sweep_2x2(CASES, names, per_case)


@pytest.mark.parametrize("world", [2, 4])
def test_shape_ops_every_1d_layout_match_torch(dist_run, world):
    results = dist_run(world, _sweep_1d, sorted(CASES), timeout=600)
    assert results[0] == [], "\n".join(results[0])


def test_shape_ops_2x2_sampled_layouts_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), 6, timeout=600)
    assert results[0] == [], "\n".join(results[0])


@pytest.mark.exhaustive
def test_shape_ops_2x2_every_layout_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), None, timeout=3600)
    assert results[0] == [], "\n".join(results[0])


def _where_sbpflow():
    return sbpflow.__file__


def test_ranks_import_this_worktree(dist_run):
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert all(f.startswith(here) for f in dist_run(2, _where_sbpflow))


# (case, input nd-SBPs on 2 ranks) -> (output SBP, collectives that may run), from the
# math: each has a signature that needs no gather of the input.
SIGNATURE_TABLE = [
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


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want, want_comms in SIGNATURE_TABLE:
        fn, inputs = CASES[name][:2]
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


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


def _topk_split_dim_moves_only_candidates():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(4, 1000)
    x = sbpflow.tensor(xv, placement=pl, sbp=S1, requires_grad=True)
    with CommRecorder() as rec:
        v, i = x.topk(3, dim=1)
    # Values and indices of 3 candidates per row per shard; never the (4, 1000) input.
    assert rec.kinds() == ["all_gather", "all_gather"], rec.kinds()
    assert rec.total_bytes() == 4 * 3 * (4 + 8), rec.total_bytes()
    assert v.sbp == (B,) and i.sbp == (B,)
    rv, ri = xv.topk(3, dim=1)
    assert torch.equal(torch.from_numpy(v.numpy()), rv)
    assert torch.equal(torch.from_numpy(i.numpy()), ri)
    with CommRecorder() as rec:
        k = x.topk(2, dim=0)
    assert rec.kinds() == [] and k.values.sbp == (S1,)
    # Unsqueeze keeps the split, renumbered, without communication.
    with CommRecorder() as rec:
        u = x.unsqueeze(0)
    assert u.sbp == (S2,) and rec.kinds() == []
    return "ok"


def test_topk_split_dim_gathers_candidates_only(dist_run):
    dist_run(2, _topk_split_dim_moves_only_candidates)
    dist_run(4, _topk_split_dim_moves_only_candidates)


def _setitem_errors():
    pl = sbpflow.placement.all("cpu")
    out = []
    x = sbpflow.ones(6, 4, placement=pl, sbp=P)
    try:
        x[0] = 1.0
    except ValueError as e:
        out.append(str(e))
    y = sbpflow.ones(6, 4, placement=pl, sbp=S0)
    try:
        y[torch.tensor([0, 5])] = 2.0
    except ValueError as e:
        out.append(str(e))
    try:
        sbpflow.ones(6, 4, placement=pl, sbp=S1)[torch.tensor([0, 5]), 1:] = 2.0
    except ValueError as e:
        out.append(str(e))
    # Allowed: a basic slice along the split dim is intersected with each shard.
    with CommRecorder() as rec:
        y[1:5:2, 1] = sbpflow.full((2,), 3.0, placement=pl, sbp=B)
        y[:, 0] = torch.arange(6.0)
    full = torch.ones(6, 4)
    full[1:5:2, 1] = 3.0
    full[:, 0] = torch.arange(6.0)
    out.append(bool(torch.equal(torch.from_numpy(y.numpy()), full)) and rec.kinds() == [])
    z = sbpflow.ones(6, 4, placement=pl, sbp=S1)
    z[torch.tensor([0, 5])] = 2.0  # the indexed dim 0 is whole: fine
    out.append(float(z.sum().item()))
    return out


def test_setitem_layouts_and_errors(dist_run):
    msgs = dist_run(2, _setitem_errors)[0]
    assert "partial-sum (P)" in msgs[0] and "to_global(sbp=(B,))" in msgs[0], msgs[0]
    assert "whole on each rank" in msgs[1] and "to_global(sbp=(B,))" in msgs[1], msgs[1]
    assert "mixes tensor indices" in msgs[2], msgs[2]
    assert msgs[3] is True
    assert msgs[4] == 6 * 4 + 2 * 4


def test_local_mode_matches_torch():
    torch.manual_seed(0)
    t = torch.randn(4, 1, 6)
    x = sbpflow.from_torch(t.clone())
    checks = [
        (x.squeeze(1), t.squeeze(1)), (x.unsqueeze(0), t.unsqueeze(0)),
        (x.expand(2, 4, 3, 6), t.expand(2, 4, 3, 6)), (x.repeat(1, 2, 1), t.repeat(1, 2, 1)),
        (x[1:, 0, ::2], t[1:, 0, ::2]), (x[[0, 3]], t[[0, 3]]), (x[x > 0], t[t > 0]),
        (x.flip(2), t.flip(2)), (x.roll(1, 0), t.roll(1, 0)),
        (x.squeeze().tril(1), t.squeeze().tril(1)), (x.narrow(2, 1, 3), t.narrow(2, 1, 3)),
        (sbpflow.sort(x, dim=2).values, t.sort(dim=2).values),
        (x.topk(2, dim=2).indices, t.topk(2, dim=2).indices),
        (sbpflow.one_hot(sbpflow.tensor([0, 2])), torch.nn.functional.one_hot(
            torch.tensor([0, 2]))),
    ]
    for got, want in checks:
        assert torch.equal(got.to_torch(), want)
    assert [p.shape for p in x.split(2, dim=2)] == [p.shape for p in t.split(2, dim=2)]
    assert isinstance(x.topk(1), torch.return_types.topk)
    y = sbpflow.zeros(3, 4)
    y[1, 1:] = sbpflow.tensor([1.0, 2.0, 3.0])
    y[y > 2] = 9.0
    assert y.to_torch().tolist() == [[0, 0, 0, 0], [0, 1, 2, 9], [0, 0, 0, 0]]


def test_local_errors():
    x = sbpflow.zeros(3, 4)
    with pytest.raises(IndexError, match="out of range"):
        x.squeeze(3)
    with pytest.raises(ValueError, match="k=5 is out of range"):
        x.topk(5)
    with pytest.raises(IndexError, match="do not fit"):
        x.narrow(1, 2, 3)
    with pytest.raises(ValueError, match="at least 2 dims"):
        sbpflow.zeros(3).tril()
    with pytest.raises(TypeError, match="only applicable to index tensors"):
        sbpflow.one_hot(x)
    with pytest.raises(ValueError, match="same length"):
        x.roll((1, 2), 0)
    g = sbpflow.ones(2, placement=sbpflow.placement("cpu", [0]), sbp=B)
    with pytest.raises(TypeError, match="x is local and v is global"):
        x[0, :2] = g


def _global_index_errors():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.zeros(3, 4, placement=pl, sbp=S0)
    out = []
    for bad in [lambda: x[3], lambda: x[0, 0, 0], lambda: x[::-1], lambda: x["a"]]:
        try:
            bad()
        except (IndexError, ValueError, TypeError) as e:
            out.append(type(e).__name__)
    return out


def test_global_index_errors(dist_run):
    assert dist_run(2, _global_index_errors)[0] == ["IndexError", "IndexError", "ValueError",
                                                   "TypeError"]
