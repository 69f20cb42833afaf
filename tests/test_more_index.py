"""More indexing, reduction and shape ops (sbpflow/ops/_more_index.py): every case against
plain torch on one process, values and gradients, for every input layout on 1-D meshes
of 2 and 4 ranks (uneven: 7 over 4 is 2,2,2,1; 3 over 4 leaves a rank empty) and a
sample of 2x2 layouts; the GQA head repeat (repeat_interleave of a head-split tensor)
runs no collective; data-dependent results are B; local mode; errors."""

from __future__ import annotations

import math

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import Input, ints, lib

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2 = split(0), split(1), split(2)


def _with_zeros(shape, p=0.3):
    return Input(lambda g: torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) > p))


def _with_nan(shape):
    def make(g):
        x = torch.randn(shape, generator=g)
        x[1, 2] = x[4, 0] = x[4, 3] = x[6, 2] = math.nan
        return x
    return Input(make, layouts=(S0, S1, B))


def _perm(n, k, layouts=(S0, B)):
    """``k`` distinct int64 indices below ``n`` (index_copy needs distinct ones)."""
    return Input(lambda g: torch.randperm(n, generator=g)[:k], grad=False, layouts=layouts)


def _idx(shape, high, layouts=(S0, B)):
    base = ints(shape, high)
    return Input(base.make, grad=False, layouts=layouts)


def _sorted(shape, layouts):
    return Input(lambda g: torch.randn(shape, generator=g).sort(-1).values, grad=False,
                 layouts=layouts)


def _bools(shape, layouts):
    return Input(lambda g: torch.rand(shape, generator=g) < 0.5, grad=False, layouts=layouts)


def _float_ints(shape, high=3):
    """Floats with many ties (mode), differentiable."""
    return Input(lambda g: torch.randint(0, high, shape, generator=g).float())


def _nograd(shape, layouts=None):
    return Input(lambda g: torch.randn(shape, generator=g), grad=False, layouts=layouts)


def _f(shape, layouts):
    """A float input tried in ``layouts`` only (the cases composed of ops tested elsewhere
    need not run every combination of their inputs' layouts)."""
    return Input(lambda g: torch.randn(shape, generator=g), layouts=layouts)


def _ri_tensor(a):
    return a.repeat_interleave(torch.tensor([1, 0, 2, 1, 3]), dim=1)


# name -> (function usable on torch and sbpflow tensors, inputs[, tolerances])
CASES = {
    # repeat_interleave
    "ri_int_dim0": (lambda a: a.repeat_interleave(2, dim=0), [(7, 5)]),
    "ri_int_dim1": (lambda a: a.repeat_interleave(3, dim=1) * 2, [(7, 5)]),
    "ri_flat": (lambda a: a.repeat_interleave(2), [(3, 5)]),
    "ri_tensor": (_ri_tensor, [(7, 5)]),
    "ri_heads": (lambda k: k.repeat_interleave(2, dim=1), [(2, 4, 3, 2)]),
    # index_add / index_copy / index_fill, out of place and in place
    "index_add_0": (lambda x, i, s: x.index_add(0, i, s, alpha=2),
                    [(7, 5), _idx((4,), 7), _f((4, 5), (S0, S1, P))]),
    "index_add_1": (lambda x, i, s: x.index_add(1, i, s), [(7, 5), _idx((3,), 5, (B,)), (7, 3)]),
    "index_add_inplace": (lambda x, i, s: (x * 1).index_add_(0, i, s),
                          [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S1, B, P)),
                           _idx((4,), 7), (4, 5)]),
    "index_copy_0": (lambda x, i, s: x.index_copy(0, i, s),
                     [(7, 5), _perm(7, 4), _f((4, 5), (S1, P))]),
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
                               grad=False, layouts=(S1, B)), _f((4, 5), (S1, B, P))]),
    "scatter_value_inplace": (lambda x, i: (x * 1).scatter_(1, i, 2.5),
                              [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S0, B)),
                               _idx((7, 2), 5, (S0, B))]),
    "scatter_add_inplace": (lambda x, i, s: (x * 1).scatter_add_(0, i, s),
                            [Input(lambda g: torch.randn(7, 5, generator=g), layouts=(S1, B, P)),
                             _idx((4, 5), 7, (S0, S1, B)), _f((4, 5), (S0, S1, B, P))]),
    # in place through copy_ (x keeps its layout)
    "tril_inplace": (lambda a: (a * 1).tril_(-1), [(7, 5)]),
    "cumsum_inplace": (lambda a: (a * 1).cumsum_(0), [(7, 5)]),
    "lerp_inplace": (lambda a, b: (a * 1).lerp_(b, 0.3), [(7, 5), _f((7, 5), (S1, B, P))]),
    "addcmul_inplace": (lambda a, b, c: (a * 1).addcmul_(b, c, value=0.5),
                        [(7, 5), _f((7, 5), (S0, B)), _f((7, 5), (S1, B))]),
    # cumulative
    "cumprod_0": (lambda a: a.cumprod(0), [_with_zeros((7, 5))]),
    "cumprod_1": (lambda a: a.cumprod(dim=-1), [_with_zeros((7, 5), 0.2)]),
    "cummax_0": (lambda a: a.cummax(0), [(7, 5)]),
    "cummin_1": (lambda a: lib(a).cummin(a, 1), [(7, 5)]),
    "logcumsumexp_0": (lambda a: a.logcumsumexp(0), [(7, 5)]),
    # diagonals
    "diag_vec": (lambda a: lib(a).diag(a, 1), [(5,)]),
    "diag_mat": (lambda a: a.diag(-1) * 2, [(7, 5)]),
    "diagonal_batch": (lambda a: a.diagonal(1, 1, 2), [(3, 7, 5)]),
    "diagonal_outer": (lambda a: a.diagonal(0, 0, 2), [(7, 3, 5)]),
    "trace": (lambda a: a.trace(), [(7, 5)]),
    "diag_embed": (lambda a: a.diag_embed(-1), [(3, 4)]),
    "diag_embed_dims": (lambda a: lib(a).diag_embed(a, 1, 0, 2), [(3, 4)]),
    # data-dependent shapes
    "masked_select": (lambda a, m: a.masked_select(m), [(7, 5), _bools((7, 5), (S0, S1, B))]),
    "masked_select_bcast": (lambda a, m: lib(a).masked_select(a, m), [(7, 5), _bools((5,), (B,))]),
    "nonzero": (lambda a: a.nonzero(), [_with_zeros((7, 5))]),
    "nonzero_tuple": (lambda a: lib(a).nonzero(a, as_tuple=True), [_with_zeros((7, 5))]),
    "argwhere": (lambda a: a.argwhere(), [_with_zeros((7, 5))]),
    "unique": (lambda a: a.unique(return_inverse=True, return_counts=True), [ints((7, 5), 4)]),
    "unique_dim": (lambda a: lib(a).unique(a, dim=0, return_counts=True), [ints((7, 3), 2)]),
    "bincount": (lambda a: a.bincount(minlength=3), [ints((13,), 6)]),
    "bincount_w": (lambda a, w: a.bincount(w), [ints((13,), 6), _nograd((13,))]),
    "histc": (lambda a: a.histc(6), [_nograd((7, 5))]),
    "histc_range": (lambda a: lib(a).histc(a, 4, -1, 1), [_nograd((7, 5))]),
    "count_nonzero": (lambda a: a.count_nonzero(1), [_with_zeros((7, 5))]),
    "count_nonzero_all": (lambda a: lib(a).count_nonzero(a), [_with_zeros((7, 5))]),
    # order statistics
    "median_all": (lambda a: a.median(), [(7, 5)]),
    "median_dim0": (lambda a: a.median(0), [(7, 5)]),
    "median_keep": (lambda a: lib(a).median(a, 1, keepdim=True), [(7, 5)]),
    "nanmedian": (lambda a: a.nanmedian(0), [_with_nan((7, 5))]),
    "nanmedian_all": (lambda a: a.nanmedian(), [_with_nan((7, 5))]),
    "kthvalue": (lambda a: a.kthvalue(3, 0), [(7, 5)]),
    "mode": (lambda a: a.mode(1), [_float_ints((7, 5))]),
    "quantile_dim": (lambda a: a.quantile(0.3, dim=1), [(7, 5)]),
    "quantile_qs": (lambda a, q: a.quantile(q, dim=0, keepdim=True),
                    [(7, 5), Input(lambda g: torch.tensor([0.1, 0.5, 0.9]), grad=False,
                                   layouts=(B,))]),
    "quantile_all": (lambda a: lib(a).quantile(a, 0.75, interpolation="midpoint"), [(7, 5)]),
    "nanquantile": (lambda a: a.nanquantile(0.4, dim=0, interpolation="nearest"),
                    [_with_nan((7, 5))]),
    # nan-reductions, moments, aminmax
    "nansum_0": (lambda a: a.nansum(0), [_with_nan((7, 5))]),
    "nansum_all": (lambda a: lib(a).nansum(a), [_with_nan((7, 5))]),
    "nanmean_1": (lambda a: a.nanmean(1), [_with_nan((7, 5))]),
    "std_mean": (lambda a: lib(a).std_mean(a, 0), [(7, 5)]),
    "var_mean": (lambda a: lib(a).var_mean(a, (0, 1), correction=0, keepdim=True), [(7, 5)]),
    "aminmax_dim": (lambda a: a.aminmax(dim=1, keepdim=True), [(7, 5)]),
    "aminmax_all": (lambda a: lib(a).aminmax(a), [(7, 5)]),
    # diff, cross
    "diff_prepend": (lambda a, p: a.diff(2, 0, prepend=p), [(7, 5), _f((2, 5), (B, P))]),
    "diff_append": (lambda a, q: lib(a).diff(a, dim=1, append=q), [(7, 5), _f((7, 1), (S0, B))]),
    "cross": (lambda a, b: a.cross(b, dim=1), [(7, 3), (7, 3)]),
    "cross_bcast": (lambda a, b: a.cross(b, dim=-1), [(7, 3), _f((1, 3), (B, P))]),
    # matmul family
    "addmm": (lambda x, a, b: x.addmm(a, b, beta=0.5, alpha=2),
              [_f((7, 6), (B, P)), _f((7, 5), (S0, S1, B)), _f((5, 6), (S0, S1, B))]),
    "addmm_bcast": (lambda x, a, b: lib(a).addmm(x, a, b),
                    [_f((6,), (B,)), (7, 5), _f((5, 6), (S1, B))]),
    "addmv": (lambda x, a, v: x.addmv(a, v, alpha=3), [_f((7,), (B, P)), _f((7, 5), (S0, S1, B)),
                                                           _f((5,), (S0, B))]),
    "baddbmm": (lambda x, a, b: x.baddbmm(a, b, beta=2), [_f((3, 7, 4), (S0, B)),
                                                         _f((3, 7, 5), (S0, S2, B)),
                                                         _f((3, 5, 4), (S0, S1, B))]),
    "addbmm": (lambda x, a, b: x.addbmm(a, b), [_f((7, 4), (B, P)), _f((3, 7, 5), (S0, S2, B)),
                                                _f((3, 5, 4), (S0, S1, B))]),
    # distances, search
    "cdist": (lambda a, b: lib(a).cdist(a, b), [(7, 5), (3, 5)], {"rtol": 1e-4, "atol": 1e-5}),
    "cdist_batched_p1": (lambda a, b: lib(a).cdist(a, b, p=1), [_f((2, 7, 5), (S0, S1, B)),
                                                                _f((2, 3, 5), (S0, S1, B))]),
    "dist": (lambda a, b: a.dist(b), [(7, 5), _f((7, 5), (S0, B, P))]),
    "dist_p3": (lambda a, b: lib(a).dist(a, b, 3), [(7, 5), (5,)]),
    "searchsorted": (lambda s, v: lib(v).searchsorted(s, v), [_sorted((6,), (B, S0)),
                                                             _nograd((7, 5), (S0, S1, B))]),
    "searchsorted_nd": (lambda s, v: lib(v).searchsorted(s, v, right=True),
                        [_sorted((7, 4), (S0, S1, B)), _nograd((7, 3), (S0, S1, B))]),
    "bucketize": (lambda v, b: lib(v).bucketize(v, b, right=True),
                  [_nograd((7, 5), (S0, S1, B)), _sorted((6,), (B,))]),
}


# The cases in two halves, one dist_run call each (each call has its own timeout).
HALVES = [sorted(CASES)[0::2], sorted(CASES)[1::2]]


def _sweep_1d(names):
    return oracle.sweep_1d(CASES, names)


@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("world", [2, 4])
def test_more_index_every_1d_layout_match_torch(dist_run, world, half):
    results = dist_run(world, _sweep_1d, HALVES[half])
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2(names, per_case):
    return oracle.sweep_2x2(CASES, names, per_case)


@pytest.mark.parametrize("half", [0, 1])
def test_more_index_2x2_sampled_layouts_match_torch(dist_run, half):
    results = dist_run(4, _sweep_2x2, HALVES[half], 6)
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2_full(names):
    """Every 2x2 layout combination of the cases with at most 36 of them; the others: every
    2-D layout of each input at least once plus 8 random combinations."""
    small, big = [], []
    for name in names:
        n = np.prod([len(p) for p in oracle._per_input_2x2(CASES, name)])
        (small if n <= 36 else big).append(name)
    return (oracle.sweep_2x2(CASES, small, None)
            + oracle.sweep_2x2_covering(CASES, big, extra=8))


@pytest.mark.exhaustive
@pytest.mark.parametrize("half", [0, 1])
def test_more_index_2x2_every_layout_match_torch(dist_run, half):
    results = dist_run(4, _sweep_2x2_full, HALVES[half], timeout=1800)
    assert results[0] == [], "\n".join(results[0])


def test_local_mode_matches_torch():
    g = torch.Generator().manual_seed(0)
    fails = []
    for name, case in sorted(CASES.items()):
        values, _ = oracle._values(name, case[1])
        want = case[0](*values)
        got = case[0](*(sbpflow.from_torch(v) for v in values))
        pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
        for o, w in pairs:
            if not isinstance(o, sbpflow.Tensor) or o.is_global or o.dtype != w.dtype or \
                    not torch.allclose(o.to_torch(), w, equal_nan=True):
                fails.append(name)
    assert fails == [], fails
    del g


# (case, input nd-SBPs, output SBP). Written from the math: each has a local signature,
# so no collective may run.
SIGNATURE_TABLE = [
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


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want in SIGNATURE_TABLE:
        fn, inputs = CASES[name][:2]
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


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


def _b_results():
    pl = sbpflow.placement.all("cpu")
    v = torch.randn(9, 4, generator=torch.Generator().manual_seed(2)) * \
        (torch.rand(9, 4, generator=torch.Generator().manual_seed(3)) > 0.4)
    x = sbpflow.tensor(v, placement=pl, sbp=S0)
    outs = {"nonzero": x.nonzero(), "masked": x.masked_select(x > 0),
            "unique": x.unique(), "bincount": (x != 0).long().sum(1).bincount(),
            "histc": x.histc(5), "tril": sbpflow.tril_indices(5, 4, -1, placement=pl, sbp=S1),
            "triu": sbpflow.triu_indices(4, 6, 1, placement=pl, sbp=B)}
    return {k: (o.sbp == (B,) * (k != "tril") or o.sbp == (S1,), o.numpy())
            for k, o in outs.items()}


def test_data_dependent_results_are_broadcast(dist_run):
    v = torch.randn(9, 4, generator=torch.Generator().manual_seed(2)) * \
        (torch.rand(9, 4, generator=torch.Generator().manual_seed(3)) > 0.4)
    ref = {"nonzero": v.nonzero(), "masked": v.masked_select(v > 0), "unique": v.unique(),
           "bincount": (v != 0).long().sum(1).bincount(), "histc": v.histc(5),
           "tril": torch.tril_indices(5, 4, -1), "triu": torch.triu_indices(4, 6, 1)}
    for r in dist_run(4, _b_results):
        for k, want in ref.items():
            ok, got = r[k]
            assert ok, k
            np.testing.assert_allclose(got, want.numpy(), err_msg=k)


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
