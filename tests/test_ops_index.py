"""Indexing ops (sbpflow/ops/index): getitem/setitem, gather, scatter(_add), index_select/
add/copy/fill, take_along_dim, one_hot.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, S1, S2, Input, _floats, ints

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


def _perm(n, k, layouts=(S0, B)):
    """``k`` distinct int64 indices below ``n`` (index_copy needs distinct ones)."""
    return Input(lambda g: torch.randperm(n, generator=g)[:k], grad=False, layouts=layouts)


def _idx(shape, high, layouts=(S0, B)):
    base = ints(shape, high)
    return Input(base.make, grad=False, layouts=layouts)


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


CASES = {
    "getitem_slices": (lambda a: a[1:, ::2], [(7, 5)]),
    "getitem_int": (lambda a: a[-1, 2:] + a[0, :3], [(7, 5)]),
    "getitem_none_ellipsis": (lambda a: a[..., None] * a[None, 1].unsqueeze(-1), [(3, 7, 5)]),
    "getitem_keep_split": (lambda a: a[:, 1:3, :], [(3, 7, 5)]),
    "getitem_cols": (lambda a: a[:, 1:], [(7, 5)]),
    "getitem_tensor": (lambda a, i: a[i], [(7, 5), ints((4,), 7, -7)]),
    "getitem_tensor_2d": (lambda a, i: a[:, i], [(3, 5), ints((3, 2), 5)]),
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
    "one_hot": (lambda i: _one_hot(i, 6), [ints((7, 3), 6)]),
    "one_hot_auto": (lambda i: _one_hot(i) * 2, [ints((5,), 4)]),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "index_add_0": (lambda x, i, s: x.index_add(0, i, s, alpha=2),
                        [(7, 5), _idx((4,), 7), _floats((4, 5), (S0, S1, P))]),
        "index_add_1": (lambda x, i, s: x.index_add(1, i, s),
                        [(7, 5), _idx((3,), 5, (B,)), (7, 3)]),
        "index_add_inplace": (lambda x, i, s: (x * 1).index_add_(0, i, s),
                              [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S1, B, P)),
                               _idx((4,), 7), (4, 5)]),
        "index_copy_0": (lambda x, i, s: x.index_copy(0, i, s),
                         [(7, 5), _perm(7, 4), _floats((4, 5), (S1, P))]),
        "index_copy_inplace": (lambda x, i, s: (x * 1).index_copy_(1, i, s),
                               [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S0, B, P)),
                                _perm(5, 3, (B,)), (7, 3)]),
        "index_fill_1": (lambda x, i: x.index_fill(1, i, -1.5), [(7, 5), _idx((3,), 5)]),
        "index_fill_zero_inplace": (lambda x, i: (x * 1).index_fill_(0, i, 0),
                                    [Input(lambda g: torch.randn(7, 5, generator=g),
                                           layouts=(S1, B, P)), _idx((3,), 7, (B,))]),
        "scatter_inplace": (lambda x, i, s: (x * 1).scatter_(0, i, s),
                            [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S1, B, P)),
                             Input(lambda g: torch.randperm(7, generator=g)[:4].repeat(5, 1).t(),
                                   grad=False, layouts=(S1, B)), _floats((4, 5), (S1, B, P))]),
        "scatter_value_inplace": (lambda x, i: (x * 1).scatter_(1, i, 2.5),
                                  [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S0, B)),
                                   _idx((7, 2), 5, (S0, B))]),
        "scatter_add_inplace": (lambda x, i, s: (x * 1).scatter_add_(0, i, s),
                                [Input(lambda g: torch.randn(7, 5, generator=g),
                                       layouts=(S1, B, P)),
                                 _idx((4, 5), 7, (S0, S1, B)), _floats((4, 5), (S0, S1, B, P))]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def test_creation_local():
    assert torch.equal(sbpflow.tril_indices(4, 3).to_torch(), torch.tril_indices(4, 3))
    assert torch.equal(sbpflow.triu_indices(3, 5, 1).to_torch(), torch.triu_indices(3, 5, 1))


def test_errors():
    x = sbpflow.ones(4, 5)
    with pytest.raises(ValueError, match="repeats has 2 counts but dim 1 has size 5"):
        x.repeat_interleave(torch.tensor([1, 2]), dim=1)
    with pytest.raises(ValueError, match="non-negative"):
        x.repeat_interleave(-1, dim=0)
    with pytest.raises(ValueError, match="output_size=3"):
        x.repeat_interleave(2, dim=0, output_size=3)
    with pytest.raises(TypeError, match="repeats must be an int"):
        x.repeat_interleave(1.5)
    with pytest.raises(IndexError, match="out of range"):
        x.index_add(2, torch.tensor([0]), x)
    with pytest.raises(ValueError, match="k=6 is out of range"):
        x.kthvalue(6, 0)
    with pytest.raises(ValueError, match=r"q values must be in \[0, 1\]"):
        x.quantile(1.5)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        x.quantile(0.5, interpolation="cubic")
    with pytest.raises(ValueError, match="dim1 and dim2 must differ"):
        x.diagonal(0, 1, -1)
    with pytest.raises(ValueError, match="expected a 1-D or 2-D"):
        sbpflow.ones(2, 2, 2).diag()
    with pytest.raises(ValueError, match="trace: expected a 2-D"):
        sbpflow.ones(3).trace()
    with pytest.raises(ValueError, match="expected a 1-D int"):
        x.long().bincount()
    with pytest.raises(ValueError, match="must have size 3"):
        x.cross(x, dim=1)
    with pytest.raises(ValueError, match="no dim of size 3"):
        x.cross(x)
    with pytest.raises(ValueError, match="mat1 and mat2 must be 2-D"):
        x.addmm(sbpflow.ones(4), x)
    with pytest.raises(ValueError, match="cdist: expected"):
        sbpflow.cdist(x, sbpflow.ones(3, 4))
    with pytest.raises(ValueError, match="order n must be non-negative"):
        x.diff(-1)
    with pytest.raises(TypeError, match="nanmean: expected a floating"):
        x.long().nanmean()
    with pytest.raises(ValueError, match="boundaries must be 1-D"):
        sbpflow.bucketize(x, x)
    with pytest.raises(TypeError, match="sorter= is not supported"):
        sbpflow.searchsorted(sbpflow.ones(3), x, sorter=sbpflow.ones(3).long())


def _global_errors():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.ones(4, 6, placement=pl, sbp=S0)
    out = []
    # an in-place index op with no signature that keeps a split indexed dim: the logical
    # value, written back into x's layout
    y = x * 1
    y.index_add_(0, torch.tensor([0, 1]), sbpflow.ones(2, 6, placement=pl, sbp=B))
    want = np.ones((4, 6), np.float32)
    want[:2] += 1
    out.append(y.sbp == (S0,) and np.array_equal(y.numpy(), want))
    try:
        x.masked_select(sbpflow.from_torch(torch.ones(4, 6, dtype=torch.bool)))
    except TypeError as e:
        out.append("one input is local" in str(e))
    return out


def test_global_errors_raise_on_every_rank(dist_run):
    assert dist_run(2, _global_errors) == [[True, True]] * 2


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
