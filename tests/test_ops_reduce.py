"""Reductions (sbpflow/ops/reduce): sum, mean, prod, max/min/amax/amin/argmax/argmin/
aminmax, var/std(_mean), norm, logsumexp, all/any, nansum/nanmean, count_nonzero.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import math

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, S1, Input, _ints_p, _nan_at, _with_zeros, ints, lib

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import dual
from sbpflow.sbp import partial_sum as P

INF = math.inf


def _all_cases():
    """The cases the tables below name, from their family files."""
    return oracle.all_cases("reduce", "scan")


def _ties(shape, high=3):
    """Floats with many equal values (differentiable): ties for max/min."""
    return Input(lambda g: torch.randint(0, high, shape, generator=g).float())


def _positive(shape):
    return Input(lambda g: torch.rand(shape, generator=g) + 0.5)


def _with_nan(shape):
    def make(g):
        x = torch.randn(shape, generator=g)
        x[1, 2] = x[4, 0] = x[4, 3] = math.nan
        return x
    return Input(make)


def _with_inf(shape, rows: bool):
    """Some -inf (finite gradient); with ``rows`` also a row of -inf and a +inf, whose
    gradients are NaN in torch as here (compared by value only: not differentiated)."""
    def make(g):
        x = torch.randn(shape, generator=g)
        x[3, 1] = x[5, 4] = x[6, :4] = -INF
        if rows:
            x[0, :] = -INF
            x[2, 1] = INF
        return x
    return Input(make, grad=not rows, layouts=(S0, S1, B, P))


def _bools(shape, p=0.5):
    return Input(lambda g: torch.rand(shape, generator=g) < p, grad=False)


def _floats_nograd(shape, p=0.4):
    """Float data with zeros, not differentiated (all/any), tried as P too."""
    return Input(lambda g: torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) > p),
                 grad=False, layouts=(S0, S1, B, P))


CASES = {
    "prod_all": (lambda a: a.prod(), [_positive((7, 5))]),
    "prod_dim0": (lambda a: a.prod(0), [(7, 5)]),
    "prod_dim1_keep": (lambda a: a.prod(1, keepdim=True), [(7, 5)]),
    "prod_zeros": (lambda a: a.prod(dim=0), [_with_zeros((7, 5), 0.2)]),
    "prod_dtype": (lambda a: a.prod(0, dtype=torch.float64), [(7, 5)]),
    "prod_int": (lambda a: a.prod(1), [_ints_p((7, 5), 4, 1)]),
    "prod_fn": (lambda a: lib(a).prod(a, -1), [(3, 7, 5)]),
    "max_all": (lambda a: a.max(), [(7, 5)]),
    "min_all_ties": (lambda a: a.min() * 3, [_ties((7, 5))]),
    "max_dim0": (lambda a: a.max(0), [(7, 5)]),
    "max_dim1_keep": (lambda a: a.max(1, keepdim=True), [(7, 5)]),
    "min_dim0": (lambda a: a.min(dim=0), [(7, 5)]),
    "min_dim_neg": (lambda a: a.min(-1), [(7, 5)]),
    "max_ties": (lambda a: a.max(0), [_ties((7, 5))]),
    "min_ties_keep": (lambda a: a.min(1, True), [_ties((7, 5))]),
    "max_nan": (lambda a: a.max(0), [_with_nan((7, 5))]),
    "min_nan": (lambda a: a.min(1), [_with_nan((7, 5))]),
    "max_3d": (lambda a: a.max(1), [(3, 7, 5)]),
    "max_3d_dim0": (lambda a: a.min(0), [(3, 7, 5)]),
    "max_fn": (lambda a: tuple(lib(a).max(a, dim=1)), [(7, 5)]),
    "max_other": (lambda a, b: a.max(b) + lib(a).min(a, b) * 2, [(7, 5), (5,)]),
    "max_int": (lambda a: a.max(0), [ints((7, 5), 5)]),
    "max_int_all": (lambda a: a.min(), [ints((7, 5), 50, -50)]),
    "max_bool": (lambda a: a.max(1), [_bools((7, 5))]),
    "argmax_all": (lambda a: a.argmax(), [(7, 5)]),
    "argmin_all_ties": (lambda a: a.argmin(), [_ties((7, 5))]),
    "argmax_all_keep": (lambda a: a.argmax(keepdim=True), [(3, 7, 5)]),
    "argmin_dim1_keep": (lambda a: a.argmin(1, keepdim=True), [_ties((7, 5))]),
    "argmax_dim0": (lambda a: lib(a).argmax(a, dim=0), [ints((7, 5), 4)]),
    "var_all": (lambda a: a.var(), [(7, 5)]),
    "var_dim0": (lambda a: a.var(0), [(7, 5)]),
    "var_dims_keep": (lambda a: a.var(dim=(0, 2), keepdim=True), [(3, 7, 5)]),
    "var_unbiased_false": (lambda a: a.var(1, False), [(7, 5)]),
    "var_bool_form": (lambda a: a.var(False), [(7, 5)]),
    "var_correction": (lambda a: a.var(0, correction=2.5, keepdim=True), [(7, 5)]),
    "std_dim1": (lambda a: a.std(1), [(7, 5)]),
    "std_all": (lambda a: lib(a).std(a, unbiased=False), [(3, 7, 5)]),
    "norm_fro": (lambda a: a.norm(), [(7, 5)]),
    "norm_p2_dim0": (lambda a: a.norm(2, dim=0), [(7, 5)]),
    "norm_fro_dims": (lambda a: a.norm("fro", dim=(0, 2), keepdim=True), [(3, 7, 5)]),
    "norm_p1": (lambda a: a.norm(1, dim=0), [(7, 5)]),
    "norm_inf": (lambda a: a.norm(INF, dim=1), [(7, 5)]),
    "norm_neginf": (lambda a: a.norm(-INF), [(3, 7, 5)]),
    "norm_p3": (lambda a: a.norm(3, dim=(0, 1), keepdim=True), [(3, 7, 5)]),
    "norm_half": (lambda a: a.norm(0.5, dim=1), [_positive((7, 5))]),
    "norm_p0": (lambda a: a.norm(0, dim=1), [_with_zeros((7, 5))]),
    "norm_dtype": (lambda a: a.norm(dim=0, dtype=torch.float64), [(7, 5)]),
    "lse_dim1": (lambda a: a.logsumexp(1), [(7, 5)]),
    "lse_dim0_keep": (lambda a: lib(a).logsumexp(a, 0, keepdim=True), [(7, 5)]),
    "lse_dims": (lambda a: a.logsumexp((0, 2)), [(3, 7, 5)]),
    "lse_neg_inf": (lambda a: a.logsumexp(1), [_with_inf((7, 5), rows=False)]),
    "lse_inf_rows": (lambda a: a.logsumexp(1), [_with_inf((7, 5), rows=True)]),
    "lse_int": (lambda a: a.logsumexp(0), [ints((7, 5), 6)]),
    "all_bool": (lambda a: a.all(), [_bools((7, 5), 0.9)]),
    "any_bool_dim": (lambda a: a.any(0), [_bools((7, 5), 0.1)]),
    "all_float_dim1": (lambda a: a.all(1, keepdim=True), [_floats_nograd((7, 5), 0.1)]),
    "any_float": (lambda a: lib(a).any(a, dim=0), [_floats_nograd((7, 5), 0.8)]),
    "all_int_dims": (lambda a: a.all(dim=(0, 2)), [ints((3, 7, 5), 5)]),
    "sum_dtype": (lambda a: a.sum(1, dtype=torch.float64), [(7, 5)]),
    "sum_int_dtype": (lambda a: a.sum(0, dtype=torch.int32), [_ints_p((7, 5), 10)]),
    "mean_int_dtype": (lambda a: a.mean(dim=0, dtype=torch.float64), [_ints_p((7, 5), 10)]),
    "sum_float_to_int": (lambda a: (a * 3).sum(0, dtype=torch.int64), [Input(
        lambda g: torch.randn((7, 5), generator=g), grad=False, layouts=(S0, S1, B, P))]),
    # Swept more densely: 6 sampled 2x2 combinations per case (3 for the others).
    **oracle.policy({
        "sum_all": (lambda a: a.sum(), [(7, 5)]),
        "sum_dim": (lambda a: a.sum(dim=1), [(7, 5)]),
        "sum_keepdim": (lambda a: a.sum(dim=0, keepdim=True), [(7, 5)]),
        "mean_all": (lambda a: a.mean(), [(7, 5)]),
        "mean_dim": (lambda a: a.mean(dim=0), [(7, 5)]),
        "mean_dims": (lambda a: a.mean(dim=(0, 2), keepdim=True), [(3, 7, 5)]),
        "amax_dim": (lambda a: a.amax(dim=0) * 2, [(7, 5)]),
        "amin_all": (lambda a: a.amin(), [(7, 5)]),
        "amax_keep": (lambda a: a - a.amax(dim=1, keepdim=True), [(7, 5)]),
        "amax_ties": (lambda a: (a * 0).amax(dim=1) + a.relu().amin(dim=0).sum(), [(7, 5)]),
    }, sample_2x2=6),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "count_nonzero": (lambda a: a.count_nonzero(1), [_with_zeros((7, 5))]),
        "count_nonzero_all": (lambda a: lib(a).count_nonzero(a), [_with_zeros((7, 5))]),
        "nansum_0": (lambda a: a.nansum(0), [_nan_at((7, 5))]),
        "nansum_all": (lambda a: lib(a).nansum(a), [_nan_at((7, 5))]),
        "nanmean_1": (lambda a: a.nanmean(1), [_nan_at((7, 5))]),
        "std_mean": (lambda a: lib(a).std_mean(a, 0), [(7, 5)]),
        "var_mean": (lambda a: lib(a).var_mean(a, (0, 1), correction=0, keepdim=True), [(7, 5)]),
        "aminmax_dim": (lambda a: a.aminmax(dim=1, keepdim=True), [(7, 5)]),
        "aminmax_all": (lambda a: lib(a).aminmax(a), [(7, 5)]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


# Both mesh axes splitting the reduced dim, or each axis another reduced dim.
HIERARCHICAL = [
    "max_dim0", "max_ties", "min_dim0", "max_nan", "argmax_all", "argmin_all_ties",
    "prod_dim0", "prod_zeros", "var_dim0", "lse_dims", "norm_p3", "norm_inf",
    "all_int_dims", "max_3d_dim0",
]


def test_2x2_hierarchical_splits(dist_run):
    results = dist_run(4, oracle.run_sweep, __name__, "2x2_hierarchical", HIERARCHICAL)
    assert results[0] == [], "\n".join(results[0])


def _extremum_runs_one_max_all_reduce():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.randn(7, 5, placement=pl, sbp=S0)
    with CommRecorder() as rec:
        m = x.amax(dim=0)
    # A local max, then an all-reduce MAX; no gradient needed: nothing else.
    assert m.sbp == (B,) and [r.kind for r in rec.records] == ["all_reduce"]
    xg = x.detach().requires_grad_()
    with CommRecorder() as rec:
        m = xg.amax(dim=0)
    # ... and one SUM of the tie counts when the input needs a gradient (torch's rule).
    assert m.sbp == (B,) and [r.kind for r in rec.records] == ["all_reduce", "all_reduce"]
    with CommRecorder() as rec:
        k = x.amax(dim=1)
    assert k.sbp == (S0,) and rec.kinds() == []
    return "ok"


def test_extremum_collectives(dist_run):
    dist_run(2, _extremum_runs_one_max_all_reduce)


# (case, input SBP, output SBP, collectives forward, collectives backward or None).
# Written from the math: a reduced split dim never gathers the input; each collective
# listed moves output-sized data (checked below) except the P -> B boxing of a P input.
# Backward: the seed is given in the output gradient's layout and the leaf keeps its
# gradient in its dual layout, so only the op's own backward collectives are listed.
SHAPE = (16, 32)


SIGNATURE_TABLE = [
    ("max_dim0", S0, B, ["all_gather", "all_gather"], ["all_reduce"]),  # values, indices
    ("max_dim0", S1, S0, [], []),
    ("max_dim0", B, B, [], []),
    ("max_dim0", P, B, ["all_reduce"], None),  # the max of a sum needs the sum
    ("min_dim_neg", S1, B, ["all_gather", "all_gather"], ["all_reduce"]),
    ("max_all", S0, B, ["all_reduce", "all_reduce"], ["all_reduce"]),  # MAX, tie count
    ("argmax_all", S1, B, ["all_gather", "all_gather"], None),
    ("argmax_dim0", S0, B, ["all_gather", "all_gather"], None),
    ("prod_dim0", S0, B, ["all_gather"], ["all_reduce"]),
    ("prod_dim0", S1, S0, [], []),
    ("var_dim0", S0, P, ["all_reduce"], ["all_reduce"]),  # the mean, output-sized
    ("var_unbiased_false", S0, S0, [], []),
    ("std_dim1", S1, B, ["all_reduce", "all_reduce"], ["all_reduce", "all_reduce"]),
    ("norm_p2_dim0", S0, B, ["all_reduce"], ["all_reduce"]),
    ("norm_p1", S0, P, [], []),
    ("norm_inf", S1, B, ["all_reduce", "all_reduce"], ["all_reduce"]),
    ("lse_dim1", S1, B, ["all_reduce", "all_reduce"], ["all_reduce"]),  # MAX, then the sum
    ("lse_dim1", S0, S0, [], []),
    ("all_bool", S0, B, ["all_reduce"], None),
    ("any_bool_dim", S1, S0, [], None),
    ("cumsum_0", S0, S0, ["all_gather"], ["all_gather"]),  # shard totals, then grad totals
    ("cumsum_0", S1, S1, [], []),
    ("cumsum_0", P, P, [], []),  # linear: P stays P
    ("sum_dtype", S1, P, [], []),
    ("sum_dtype", P, P, [], []),  # float32 -> float64 keeps P
    ("mean_int_dtype", S0, P, [], None),
]


def _make(name, sbp, pl):
    # The table's shape is larger than the case's (so that the input's bytes stand out
    # from the output's); the case's input kind decides the dtype.
    spec = oracle._spec(_all_cases()[name][1][0])
    value = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    if spec.grad is False:
        value = (value > 0) if name.startswith(("all", "any")) else (value * 3).long()
    x = sbpflow.tensor(value, placement=pl, sbp=sbp, requires_grad=spec.grad)
    # The leaf keeps its gradient in the dual layout, so that the backward table lists
    # the op's collectives only (not the B leaf's gradient sync).
    return x.set_grad_sbp(dual(sbp)) if spec.grad else x


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, sbp, want, fwd_kinds, bwd_kinds in SIGNATURE_TABLE:
        x = _make(name, sbp, pl)
        with CommRecorder() as fwd:
            out = oracle._first(_all_cases()[name][0](x))
        out_bytes = math.prod(out.shape) * 8
        big = [r for r in fwd.records if r.bytes > out_bytes]
        if out.sbp != (want,) or fwd.kinds() != fwd_kinds or (big and sbp != P):
            problems.append(f"{name}({sbp}): got {out.sbp} with {fwd.kinds()} "
                            f"{[r.bytes for r in fwd.records]} B, want {want} with {fwd_kinds} "
                            f"of <= {out_bytes} B")
        if bwd_kinds is not None and out.requires_grad:
            with CommRecorder() as bwd:
                seed = sbpflow.ones(*out.shape, placement=pl, sbp=[dual(s) for s in out.sbp])
                out.backward(seed)  # already in the gradient's layout: no boxing
            big = [r for r in bwd.records if r.bytes > out_bytes]
            if bwd.kinds() != bwd_kinds or big:
                problems.append(f"{name}({sbp}) backward: {bwd.kinds()} "
                                f"{[r.bytes for r in bwd.records]} B, want {bwd_kinds}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


def _outside_placement():
    # A placement on ranks 0 and 1 of a world of 4: ranks 2 and 3 hold empty shards, run
    # no collective of the placement, and still return (and can call backward).
    pl = sbpflow.placement("cpu", [0, 1])
    v = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    out = {}
    for name, fn in [("max", lambda a: a.max(0).values), ("idx", lambda a: a.argmax()),
                     ("prod", lambda a: a.prod(0)), ("cumsum", lambda a: a.cumsum(0)),
                     ("lse", lambda a: a.logsumexp(0)), ("var", lambda a: a.var(0)),
                     ("norm", lambda a: a.norm(dim=0))]:
        x = sbpflow.tensor(v, placement=pl, sbp=S0, requires_grad=True)
        y = fn(x)
        if y.requires_grad:
            y.backward(sbpflow.ones(*y.shape, placement=pl, sbp=y.sbp))
            out[name + "_grad"] = x.grad.numpy()
        out[name] = y.numpy()
    return out


def test_ranks_outside_placement(dist_run):
    results = dist_run(4, _outside_placement)
    v = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    ref = {"max": v.max(0).values, "idx": v.argmax(), "prod": v.prod(0),
           "cumsum": v.cumsum(0), "lse": v.logsumexp(0), "var": v.var(0), "norm": v.norm(dim=0)}
    for r in results:
        for k, want in ref.items():
            np.testing.assert_allclose(r[k], want.numpy(), rtol=1e-5, atol=1e-5, err_msg=k)
    assert all(np.array_equal(r["cumsum_grad"], results[0]["cumsum_grad"]) for r in results)


def test_local_mode_matches_torch():
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    x = sbpflow.from_torch(t)
    m = x.max(1)
    assert isinstance(m, torch.return_types.max) and isinstance(m.values, sbpflow.Tensor)
    assert torch.equal(m.indices.to_torch(), t.max(1).indices)
    pairs = [
        (x.min(0, keepdim=True).values, t.min(0, keepdim=True).values),
        (x.max(), t.max()), (x.argmin(), t.argmin()), (x.argmax(1, True), t.argmax(1, True)),
        (x.prod(1, dtype=torch.float64), t.prod(1, dtype=torch.float64)),
        (x.var(1, False), t.var(1, False)), (x.std(correction=0), t.std(correction=0)),
        (x.norm(INF), t.norm(INF)), (x.norm(3, 1), t.norm(3, 1)),
        (x.logsumexp((0, 1)), t.logsumexp((0, 1))), (x.all(1), t.all(1)), (x.any(), t.any()),
        (x.cumsum(1, dtype=torch.float64), t.cumsum(1, dtype=torch.float64)),
        (x.sum(dtype=torch.float64), t.sum(dtype=torch.float64)),
        (sbpflow.max(x, x * 2), torch.max(t, t * 2)), (sbpflow.logsumexp(x, 1), t.logsumexp(1)),
        ((x > 0).all(), (t > 0).all()),
    ]
    for got, want in pairs:
        assert got.dtype == want.dtype and torch.allclose(got.to_torch(), want), (got, want)


def test_errors():
    x = sbpflow.ones(2, 3)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for a tensor of 2 dims"):
        x.max(2)
    with pytest.raises(ValueError, match=r"dim -3 is out of range .* \[-2, 1\]"):
        x.cumsum(-3)
    with pytest.raises(ValueError, match="out of range"):
        x.logsumexp((0, 5))
    with pytest.raises(ValueError, match="same dim twice"):
        x.var((0, -2))
    with pytest.raises(TypeError, match="single int"):
        x.prod((0, 1))
    with pytest.raises(TypeError, match="single int"):
        x.argmax((0, 1))
    with pytest.raises(TypeError, match="keepdim needs a dim"):
        x.max(keepdim=True)
    with pytest.raises(TypeError, match="either unbiased= or correction="):
        x.var(0, True, correction=1)
    with pytest.raises(TypeError, match="floating point"):
        sbpflow.ones(2, 3, dtype=torch.int64).var()
    with pytest.raises(TypeError, match="floating"):
        sbpflow.ones(2, 3, dtype=torch.int64).norm()
    with pytest.raises(TypeError, match="could not infer the output dtype"):
        sbpflow.ones(2, 3, dtype=torch.int64).mean()
    with pytest.raises(ValueError, match="matrix norm"):
        x.norm("nuc")
    with pytest.raises(ValueError, match="at most 2 dims"):
        sbpflow.ones(2, 3, 4).norm("fro", dim=(0, 1, 2))
    with pytest.raises(TypeError, match="dim must be"):
        x.sum(0).cumsum(1.0)


def _global_errors():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.ones(4, 6, placement=pl, sbp=S0)
    out = []
    for fn in (lambda: x.max(2), lambda: x.argmin(-3), lambda: x.cumsum(5),
               lambda: x.norm(dim=(0, 7)), lambda: x.all(9)):
        try:
            fn()
        except ValueError as e:
            out.append("of 2 dims" in str(e))
    return out


def test_global_errors_raise_on_every_rank(dist_run):
    assert dist_run(2, _global_errors) == [[True] * 5] * 2


def _zero_dim_reductions():
    # torch accepts dim 0 and -1 on a 0-d tensor (the scalar itself)
    pl = sbpflow.placement.all("cpu")
    t = torch.tensor(3.5)
    out = []
    for z in (sbpflow.tensor(t), sbpflow.tensor(t, placement=pl, sbp=sbpflow.sbp.broadcast)):
        got = [z.sum(0), z.sum(-1, keepdim=True), z.mean(-1), z.amax(0), z.amin(-1),
               z.transpose(0, -1), z.max(0).values, z.logsumexp(0)]
        want = [t.sum(0), t.sum(-1, keepdim=True), t.mean(-1), t.amax(0), t.amin(-1),
                t.transpose(0, -1), t.max(0).values, t.logsumexp(0)]
        out.append(all(tuple(g.shape) == tuple(w.shape) and float(g.numpy()) == float(w)
                       for g, w in zip(got, want)))
        try:
            z.transpose(0, 1)
            out.append(False)
        except IndexError:
            out.append(True)
    return out


def test_zero_dim_tensor_reductions_take_dim_0_and_minus_1(dist_run):
    assert dist_run(2, _zero_dim_reductions) == [[True] * 4] * 2


def _empty_max_min_raise():
    # torch raises for a max/min over nothing; a global tensor must not return -inf/inf/0
    pl = sbpflow.placement.all("cpu")
    e = sbpflow.zeros(0, 4, placement=pl, sbp=sbpflow.sbp.split(0))
    raised = []
    for f in (lambda: e.max(), lambda: e.amin(), lambda: e.argmax(), lambda: e.amax(0),
              lambda: e.max(0)):
        try:
            f()
            raised.append(False)
        except RuntimeError as err:
            raised.append("reduction dim" in str(err))
    return raised + [tuple(e.amax(1).shape) == (0,)]


def test_max_min_over_nothing_raise_like_torch(dist_run):
    assert dist_run(2, _empty_max_min_raise) == [[True] * 6] * 2
