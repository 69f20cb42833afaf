"""More elementwise ops, activations and losses (sbpflow.ops._more_elementwise and
sbpflow.nn.functional): every case against plain torch on one process (values, gradients,
dtypes) on every 1-D input layout on 2 and 4 ranks and a sample of 2x2 layouts (uneven
dims: 7, 5, 3 over 2 and 4 ranks); local mode; the collectives of the rules that matter
(deg2rad's exact P rule, glu over a split dim, softmin over a split dim, losses over a
split batch); error messages."""

from __future__ import annotations

import math

import _oracle as oracle
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from _oracle import Input, lib

import sbpflow
import sbpflow.nn.functional as SF
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1 = split(0), split(1)


def nnf(x):
    """``torch.nn.functional`` for torch tensors, ``sbpflow.nn.functional`` for ours."""
    return SF if isinstance(x, sbpflow.Tensor) else TF


def num(x, v):
    """A Python number for sbpflow (its scalar overloads), a 0-d tensor for torch (whose
    atan2/hypot/heaviside/logaddexp take tensors only)."""
    return v if isinstance(x, sbpflow.Tensor) else torch.tensor(v)


def uniform(shape, lo: float, hi: float, grad: bool = True, layouts=None) -> Input:
    return Input(lambda g: torch.rand(shape, generator=g) * (hi - lo) + lo, grad, layouts)


def signs(shape) -> Input:
    """A float input of +1/-1 (ranking and embedding targets; not differentiated)."""
    return Input(lambda g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1, grad=False)


def some(shape, *layouts) -> Input:
    return Input(lambda g: torch.randn(shape, generator=g), layouts=layouts)


def _with_specials(g):
    v = torch.randn((7, 5), generator=g)
    v[0, 1], v[3, 2], v[6, 4], v[2, 0] = math.inf, -math.inf, math.nan, math.inf
    return v


def _unary_real(a):
    b = a * 0.5
    return (a.expm1() + a.exp2() * 0.5 + b.sinh() + b.cosh() + a.atan() + a.asinh() + b.tan()
            + a.erfc() + a.sgn() * 0.1 + a.sinc() + a.deg2rad() + a.rad2deg() * 0.01
            + a.arctan() + b.i0() + a.frac() + a.trunc() + lib(a).fix(a) + lib(a).expm1(a)
            + a.arcsinh())


def _unary_unit(u):
    return u.asin() + u.acos() + u.atanh() + u.erfinv() + u.arcsin() * 2 + u.arccos() \
        + lib(u).arctanh(u)


def _unary_positive(p):
    return (p.log2() + p.log10() + p.lgamma() + p.digamma() + (p + 1).acosh()
            + (p / 3).logit() + (p / 3).logit(eps=0.2) + lib(p).logit(p / 3, 1e-6)
            + (p + 1).arccosh())


def _binary(a, b):
    return (a.atan2(b) + a.hypot(b) + a.logaddexp(b) + lib(a).logaddexp2(a, b)
            + a.copysign(b) + lib(a).arctan2(b, a))


def _binary_scalars(a):
    return (a.atan2(num(a, 2.0)) + a.hypot(num(a, 1.5)) + a.logaddexp(num(a, 0.3))
            + a.copysign(-1.0) + a.copysign(num(a, 1.0)) + lib(a).logaddexp2(a, num(a, -0.5)))


def _xlogy_float_power(a, p):
    return (a.xlogy(p) + lib(a).xlogy(a, 2.0) + lib(a).xlogy(3.0, p)
            + (a * 0).xlogy(p)
            + (a.float_power(2) + lib(a).float_power(2, a) + p.float_power(a)).float())


def _not_differentiable(a, b):
    return (a.heaviside(b) + a.heaviside(num(a, 0.5)) + (a.nextafter(b) - a) * 1e6
            + a.nextafter(num(a, 0.0)))


def _inplace_more(a, b):
    y1 = a.sin()
    y1.expm1_()
    y2 = a.sin()
    y2.atan_()
    y3 = a * 0.5  # P stays P: deg2rad_/rad2deg_ keep it (linear)
    y3.deg2rad_()
    y3.rad2deg_()
    y4 = a.sigmoid() * 1  # sigmoid saves its output: modify a copy
    y4.logit_(1e-3)
    y5 = a.sin()
    y5.atan2_(b)
    y6 = a.sin()
    y6.copysign_(b)
    y7 = a.sin()
    y7.nan_to_num_(0.0)
    y8 = a.cos()
    y8.arcsin_()
    return y1 + y2 + y3 + y4 + y5 + y6 + y7 + y8


def _activations(a):
    F = nnf(a)
    return (F.hardswish(a * 3) + F.hardsigmoid(a * 3) + F.mish(a) + F.logsigmoid(a)
            + F.softsign(a) + F.relu6(a * 4) + F.hardtanh(a, -0.5, 0.7) + F.selu(a)
            + F.celu(a, 0.7) + F.elu(a, 0.5) + F.leaky_relu(a, 0.2) + F.threshold(a, 0.1, -2.0)
            + F.tanhshrink(a) + F.softshrink(a, 0.3) + F.hardshrink(a, 0.4) + F.leaky_relu(a))


def _activations_inplace(a):
    F = nnf(a)
    y = _activations(a) * 0.1 + F.softmin(a, 1) + F.softmin(a, dim=0)
    y = y + a * 2
    F.hardswish(y, inplace=True)
    z = a * 1
    F.leaky_relu(z, 0.3, inplace=True)
    w = a * 1
    F.threshold(w, 0.2, 5.0, inplace=True)
    return y + z + w


def _kl_div(x, t):
    F = nnf(x)
    logt = t.log()
    return (F.kl_div(x, t, reduction="batchmean") + F.kl_div(x, t, reduction="sum") * 0.1
            + F.kl_div(x, logt, reduction="mean", log_target=True))


def _regression_losses(a, b):
    F = nnf(a)
    return (F.smooth_l1_loss(a, b, beta=0.5) + F.smooth_l1_loss(a, b, reduction="sum") * 0.1
            + F.huber_loss(a, b, delta=0.7) + F.huber_loss(a, b, reduction="sum") * 0.2
            + F.smooth_l1_loss(a, b, beta=0.0))


def _bce(p, t, w):
    F = nnf(p)
    return (F.binary_cross_entropy(p, t, weight=w) + F.binary_cross_entropy(p, t, reduction="sum")
            * 0.1)


CASES = {
    "unary_real_binary_scalars": (lambda a: _unary_real(a) + _binary_scalars(a), [(7, 5)]),
    "unary_unit": (_unary_unit, [uniform((7, 5), -0.9, 0.9)]),
    "unary_positive": (_unary_positive, [uniform((7, 5), 0.3, 2.5)]),
    "nan_to_num": (lambda a: (a.nan_to_num(0.5, 2.0, -3.0), lib(a).nan_to_num(a)),
                   [Input(_with_specials)]),
    "binary_broadcast": (_binary, [(7, 5), some((5,), S0, P)]),
    "xlogy_float_power": (_xlogy_float_power, [(7, 5), uniform((7, 1), 0.5, 2.0,
                                                               layouts=(S0, P))]),
    "heaviside_nextafter": (_not_differentiable,
                            [Input(lambda g: torch.randn((7, 5), generator=g).round(), False),
                             Input(lambda g: torch.randn((5,), generator=g), False)]),
    "inplace_more": (_inplace_more, [(7, 5), some((5,), S0, B)]),
    "activations_softmin_inplace": (_activations_inplace, [(7, 5)]),
    "glu_last": (lambda a: nnf(a).glu(a), [(3, 7, 6)]),
    "glu_dim0": (lambda a: nnf(a).glu(a, 0), [(6, 5)]),
    "prelu_channels": (lambda x, w: nnf(x).prelu(x, w), [(5, 3, 4), some((3,), S0, P)]),
    "prelu_single": (lambda x, w: nnf(x).prelu(x, w), [(7, 5), some((1,), B, P)]),
    "kl_div": (_kl_div, [(7, 5), uniform((7, 5), 0.05, 1.0, layouts=(S1, B))]),
    "regression_losses": (_regression_losses, [(7, 5), some((7, 5), S0, P)]),
    "bce_weight": (_bce, [uniform((7, 5), 0.05, 0.95),
                          uniform((7, 5), 0.0, 1.0, grad=False, layouts=(S1, B)),
                          uniform((5,), 0.5, 1.5, grad=False, layouts=(S0, B))]),
    "margin_ranking": (lambda a, b, y: nnf(a).margin_ranking_loss(a, b, y, margin=0.2)
                       + nnf(a).margin_ranking_loss(a, b, y, reduction="sum"),
                       [(7,), some((7,), S0, P), signs((7,))]),
    "cosine_similarity_pairwise": (lambda a, b: nnf(a).cosine_similarity(a, b)
                                   + nnf(a).pairwise_distance(a, b)
                                   + nnf(a).pairwise_distance(a, b, p=1.0),
                                   [(7, 5), some((7, 5), S1, P)]),
    "cosine_embedding_loss": (lambda a, b, y: nnf(a).cosine_embedding_loss(a, b, y, margin=0.1),
                              [(7, 5), some((7, 5), S1, B),
                               Input(signs((7,)).make, False, (S0,))]),
    "triplet_margin_loss": (lambda a, p, n: nnf(a).triplet_margin_loss(a, p, n, margin=0.5,
                                                                       swap=True),
                            [(7, 5), some((7, 5), S0, B), some((7, 5), P)]),
}


def _sweep_1d(names):
    return oracle.sweep_1d(CASES, names)


@pytest.mark.parametrize("world", [2, 4])
def test_more_elementwise_every_1d_layout_match_torch(dist_run, world):
    results = dist_run(world, _sweep_1d, sorted(CASES))
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2(names, per_case):
    return oracle.sweep_2x2(CASES, names, per_case)


def test_more_elementwise_2x2_sampled_layouts_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), 6)
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2_full(names):
    """Every 2x2 layout combination of the cases with at most 36 of them; every 2-D layout
    of every input (plus 8 random combinations) for the larger products (the full sweep
    of all cases is ~1200 runs, over 5 minutes)."""
    small = [n for n in names if _combos_2x2(n) <= 36]
    large = [n for n in names if n not in small]
    return (oracle.sweep_2x2(CASES, small, None)
            + oracle.sweep_2x2_covering(CASES, large, extra=8))


def _combos_2x2(name):
    return math.prod(len(opts) for opts in oracle._per_input_2x2(CASES, name))


@pytest.mark.exhaustive
def test_more_elementwise_2x2_every_layout_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2_full, sorted(CASES), timeout=3600)
    assert results[0] == [], "\n".join(results[0])


def test_more_elementwise_cases_local_match_torch():
    for name, case in CASES.items():
        fn, inputs = case[0], case[1]
        values, _ = oracle._values(name, inputs)
        grads = [oracle._spec(i).grad and v.is_floating_point() for i, v in zip(inputs, values)]
        ref_in = [v.clone().requires_grad_(r) for v, r in zip(values, grads)]
        xs = [sbpflow.tensor(v, requires_grad=r) for v, r in zip(values, grads)]
        ref, out = oracle._first(fn(*ref_in)), oracle._first(fn(*xs))
        assert out.is_local and out.dtype == ref.dtype, name
        assert torch.equal(out.to_torch().detach(), ref.detach()) or torch.allclose(
            out.to_torch().detach(), ref.detach(), equal_nan=True), name
        if ref.requires_grad:
            ref.sum().backward()
            out.sum().backward()
            for x, r in zip(xs, ref_in):
                if r.grad is not None:
                    assert torch.allclose(x.grad.to_torch(), r.grad), name


def test_function_forms_and_scalar_promotion_local():
    x = torch.randn(4, 3, dtype=torch.float64)
    s = sbpflow.tensor(x)
    for name in ("expm1", "exp2", "sinh", "arctan", "trunc", "frac", "sgn", "deg2rad", "i0"):
        assert torch.equal(getattr(sbpflow, name)(s).to_torch(), getattr(torch, name)(x)), name
    # a Python number follows torch's scalar promotion: float64 stays float64
    assert sbpflow.atan2(s, 2.0).dtype == torch.float64
    assert torch.equal(s.heaviside(0.5).to_torch(), x.heaviside(torch.tensor(0.5, dtype=x.dtype)))
    i = sbpflow.tensor(torch.arange(-3, 3))
    assert i.atan2(2).dtype == torch.float32 and i.expm1().dtype == torch.float32
    assert torch.equal(i.copysign(-1).to_torch(), torch.arange(-3, 3).copysign(-1))
    assert torch.equal(sbpflow.xlogy(2, s.abs()).to_torch(), torch.xlogy(2, x.abs()))
    assert sbpflow.float_power(2, i).dtype == torch.float64


# ------------------------------------------------------------------ signature table
def _ones(shape, sbp, pl):
    return sbpflow.ones(*shape, placement=pl, sbp=sbp)


# (description, fn(pl) -> output, output SBP, collectives)
SIGNATURE_TABLE = [
    ("expm1 S0", lambda pl: _ones((7, 5), S0, pl).expm1(), S0, []),
    ("atan2 S1 with S0 (5,)", lambda pl: _ones((7, 5), S1, pl).atan2(_ones((5,), S0, pl)), S1,
     []),
    ("deg2rad of P (linear)", lambda pl: _ones((7, 5), P, pl).deg2rad(), P, []),
    ("rad2deg_ of P", lambda pl: (_ones((7, 5), P, pl) * 1).rad2deg_(), P, []),
    ("hypot S0 with a number", lambda pl: _ones((7, 5), S0, pl).hypot(2.0), S0, []),
    ("glu S0 over dim 1", lambda pl: SF.glu(_ones((7, 6), S0, pl), 1), S0, []),
    ("glu over its split dim: re-split", lambda pl: SF.glu(_ones((7, 6), S1, pl), 1), S0,
     ["all_to_all"]),
    ("prelu channel split, weight B", lambda pl: SF.prelu(_ones((4, 6, 3), S1, pl),
                                                          _ones((6,), B, pl)), S1, []),
    ("softmin over a split dim", lambda pl: SF.softmin(_ones((7, 6), S1, pl), 1), S1,
     ["all_reduce", "all_reduce"]),
    ("kl_div batchmean over a split batch", lambda pl: SF.kl_div(
        _ones((7, 5), S0, pl), _ones((7, 5), S0, pl), reduction="batchmean"), P, []),
    ("bce weighted over a split batch", lambda pl: SF.binary_cross_entropy(
        _ones((7, 5), S0, pl) * 0.5, _ones((7, 5), S0, pl), _ones((5,), B, pl)), P, []),
    ("huber sum over a split batch", lambda pl: SF.huber_loss(
        _ones((7, 5), S0, pl), _ones((7, 5), S0, pl), reduction="sum"), P, []),
]


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, fn, want, want_comms in SIGNATURE_TABLE:
        with CommRecorder() as rec:
            out = fn(pl)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}: got {out.sbp} with {rec.kinds()}, want {want} "
                            f"with {want_comms}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


# ------------------------------------------------------------------ errors
def _global_errors():
    pl = sbpflow.placement.all("cpu")
    x = _ones((4, 3), P, pl) * 1
    x.expm1_()  # no signature keeps P: the logical value, written back as P
    assert x.sbp == (P,) and np.allclose(x.numpy(), np.full((4, 3), np.expm1(1.0), np.float32))
    with pytest.raises(TypeError, match="global but an argument is local"):
        _ones((4, 3), S0, pl).atan2_(sbpflow.ones(4, 3))
    return "ok"


def test_global_errors(dist_run):
    assert dist_run(2, _global_errors) == ["ok", "ok"]


def test_errors_local():
    x = sbpflow.randn(4, 5)
    with pytest.raises(ValueError, match="halving dimension must be even"):
        SF.glu(x, 1)
    with pytest.raises(ValueError, match="does not support 0-dim"):
        SF.glu(sbpflow.tensor(1.0))
    with pytest.raises(ValueError, match="must have 1 or C elements"):
        SF.prelu(x, sbpflow.ones(3))
    with pytest.raises(ValueError, match="cannot be greater than max_val"):
        SF.hardtanh(x, 1.0, -1.0)
    with pytest.raises(ValueError, match="alpha must not be 0"):
        SF.celu(x, 0.0)
    with pytest.raises(ValueError, match="lambd must be >= 0"):
        SF.softshrink(x, -0.1)
    with pytest.raises(ValueError, match="reduction must be one of"):
        SF.kl_div(x, x, reduction="batch")
    with pytest.raises(ValueError, match="reduction must be one of"):
        SF.huber_loss(x, x, reduction="batchmean")
    with pytest.raises(ValueError, match="target of shape"):
        SF.binary_cross_entropy(x.sigmoid(), sbpflow.ones(5))
    with pytest.raises(ValueError, match="beta must be >= 0"):
        SF.smooth_l1_loss(x, x, beta=-1.0)
    with pytest.raises(ValueError, match="delta must be > 0"):
        SF.huber_loss(x, x, delta=0.0)
    with pytest.raises(ValueError, match="weight of shape"):
        SF.huber_loss(x, x, weight=sbpflow.ones(5))
    with pytest.raises(ValueError, match="same number of dims"):
        SF.margin_ranking_loss(x, x, sbpflow.ones(4))
    with pytest.raises(ValueError, match="expected inputs"):
        SF.cosine_embedding_loss(x, x, sbpflow.ones(4, 5))
    with pytest.raises(ValueError, match="margin must be > 0"):
        SF.triplet_margin_loss(x, x, x, margin=0.0)
    with pytest.raises(ValueError, match="size_average and reduce are deprecated"):
        SF.kl_div(x, x, size_average=True)
    with pytest.raises(TypeError, match="input must be an sbpflow.Tensor or a number"):
        sbpflow.xlogy("a", x)
    with pytest.raises(TypeError, match="other must be an sbpflow.Tensor or a number"):
        x.atan2("a")
    leaf = sbpflow.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        leaf.expm1_()
