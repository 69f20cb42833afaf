"""Pointwise ops (sbpflow/ops/pointwise): arithmetic, unary and binary math, comparisons,
where, clamp, lerp, addcmul/addcdiv, masked_fill, fill/copy, nan_to_num, xlogy and the
in-place forms.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import math

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, S1, Input, _floats, ints, lib, some_of, uniform

import sbpflow
import sbpflow.nn.functional as SF
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


def mask(shape) -> Input:
    """A bool input (never P, never differentiated)."""
    return Input(lambda g: torch.rand(shape, generator=g) > 0.5, grad=False)


def positive(shape, grad: bool = True) -> Input:
    """A float input in [0.5, 1.5) (divisors)."""
    return Input(lambda g: torch.rand(shape, generator=g) + 0.5, grad=grad)


def some(shape, *layouts, make=None) -> Input:
    """A differentiable float input tried only in ``layouts`` (the third input of a
    three-input case: keeps the 1-D sweep of those cases at ~24 combinations)."""
    return Input(make or (lambda g: torch.randn(shape, generator=g)), layouts=layouts)


def plain(shape) -> Input:
    """A float input that is not differentiated (ops torch cannot differentiate)."""
    return Input(lambda g: torch.randn(shape, generator=g) * 3, grad=False)


# ------------------------------------------------------------------ in-place case bodies
def _iops(a, b):
    y = a * 1  # a non-leaf in a's layout (P stays P)
    y += b
    y -= 0.5 * b
    y *= 2.0
    y /= 3.0
    y.add_(b, alpha=2)
    y.sub_(1.5)
    y.add_(0.25)
    return y


def _imul_div(a, b, c):
    y = a * 1
    y.mul_(b)
    y.div_(c)
    y *= b
    y.div_(2.0)
    return y


def _iclamp_fill(a, lo, m):
    y = a.sin()  # not P: clamp_ keeps no P layout
    y.clamp_(min=-0.3, max=0.5)
    y.clamp_(lo)
    y.clamp_max_(0.4)
    y.masked_fill_(m, 0.7)
    return y * 1


def _imasked_fill_partial(a, m):
    y = a * 2
    y.masked_fill_(m, 1.5)  # on P: 1.5 counted once
    y.masked_fill_(~m, 0.0)
    return y


def _icopy_zero_fill(a, b):
    y = a * 1
    y.copy_(b * 1)  # broadcast (5,) -> (7, 5)
    y.mul_(a)
    w = a * 1
    w.zero_()
    w.add_(b)
    v = a * 1
    v.fill_(2.0)
    return y + w + v * a


def _ifill_tensor(a, v):
    y = a * 1
    y.fill_(v)
    return y * a


def _iunary(a):
    y = a.sin()
    y.exp_()  # saves its output: nothing modifies y afterwards
    w = y * 2
    w.tanh_()
    z = a * 1
    z.neg_()
    return w + z


def _iint(a, b):
    y = a * 1
    y //= 3
    y %= 5
    y &= b
    y |= 1
    y ^= b
    y **= 2
    return y


def num(x, v):
    """A Python number for sbpflow (its scalar overloads), a 0-d tensor for torch (whose
    atan2/hypot/heaviside/logaddexp take tensors only)."""
    return v if isinstance(x, sbpflow.Tensor) else torch.tensor(v)


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


CASES = {
    # Swept more densely: 6 sampled 2x2 combinations per case (3 for the others).
    **oracle.policy({
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
    }, sample_2x2=6),
    # Local mode bit for bit.
    **oracle.policy({
        "clamp_scalars": (lambda a: a.clamp(min=-0.5, max=0.5) + a.clamp(max=0.2) * 2
                          + a.clip(-1, 1) + a.clamp_min(0.1), [(7, 5)]),
        "clamp_tensors": (lambda a, lo, hi: a.clamp(lo, hi) + a.clamp_min(lo) * 2 + a.clamp_max(hi),
                          [(7, 5), some((5,), S0, B), some((7, 1), S0, B, P)]),
        "pow_scalar_both_ways": (lambda a: a ** 2 + 2 ** a + 0.5 ** (a * 2), [(7, 5)]),
        "rdiv_true_divide": (lambda a, b: 2 / b + a.true_divide(b) - 1 / (b * 3) + a.divide(2.0),
                             [(7, 5), positive((7, 5))]),
        "div_rounding": (lambda a, b: a.div(b, rounding_mode="floor")
                         + a.div(b, rounding_mode="trunc") * 2
                         + lib(a).div(a, 0.7, rounding_mode="floor") + a * b,
                         [(7, 5), positive((5,))]),
        "remainder_fmod": (lambda a, b: a % b + a.fmod(b) * 2 + a.remainder(0.3) + a.fmod(-0.7),
                           [(7, 5), positive((5,))]),
        "floor_divide_float": (lambda a, b: a // b + a.floor_divide(0.7) + 3.0 // b + (a % b)
                               + 2.5 % b,
                               [plain((7, 5)), positive((5,), grad=False)]),
        "int_division": (lambda a, b: a // b + a % b + 7 // b + 7 % b + a // 3
                         + a.div(b, rounding_mode="trunc"),
                         [ints((7, 5), 20, -20), ints((5,), 5, 1)]),
        "masked_fill": (lambda a, m: a.masked_fill(m, 0.0) * 2 + a.masked_fill(m, 1.5),
                        [(7, 5), mask((7, 5))]),
        "masked_fill_broadcast": (lambda a, m: lib(a).masked_fill(a, m, -1.0),
                                  [(7, 5), mask((5,))]),
        "masked_fill_tensor_value": (lambda a, m, v: a.masked_fill(m, v),
                                     [(7, 5), Input(mask((7, 1)).make, False, (S0, B)), ()]),
        "lerp_scalar": (lambda a, b: a.lerp(b, 0.3) + lib(a).lerp(a, b, 0.8), [(7, 5), (7, 5)]),
        "lerp_tensor": (lambda a, b, w: a.lerp(b, w), [(7, 5), (5,), some((7, 1), S0, B)]),
        "where_scalars": (lambda a, b: lib(a).where(a > 0, a, 0.0) + lib(a).where(b > 0, 0.0, b) * 2
                          + lib(a).where(a > b, a, b) + lib(a).where(a > 0, 1.0, -1.0)
                          + a.where(b < 0, b * 3), [(7, 5), (5,)]),
        "logical_bitwise_bool": (lambda m, n: ((m ^ n) | (~m & n) | m.logical_xor(n)).long()
                                 + (m & True).long() + (False | n).int(),
                                 [mask((7, 5)), mask((5,))]),
        "bitwise_int": (lambda a, b: (a & b) + (a | 3) + (a ^ b) + (~a) + (5 & a)
                        + a.bitwise_xor(6) + a.bitwise_not(), [ints((7, 5), 16), ints((5,), 16)]),
        "addcmul_addcdiv": (lambda a, b, c: a.addcmul(b, c, value=0.5)
                            + lib(a).addcdiv(a, b, c.abs() + 1, value=2),
                            [(7, 5), some((7, 5), S1, B, P), some((5,), B, P)]),
        "inplace_add_sub_scalars": (_iops, [(7, 5), (5,)]),
        "inplace_mul_div": (_imul_div, [(7, 5), some((7, 5), S0, B, P),
                                        some((7, 1), B, P, make=positive((7, 1)).make)]),
        "inplace_clamp_masked_fill": (_iclamp_fill, [(7, 5), some((5,), S0, B), mask((7, 5))]),
        "inplace_masked_fill_partial": (_imasked_fill_partial, [(7, 5), mask((7, 1))]),
        "inplace_copy_zero_fill": (_icopy_zero_fill, [(7, 5), (5,)]),
        "inplace_fill_tensor": (_ifill_tensor, [(7, 5), ()]),
        "inplace_unary": (_iunary, [(7, 5)]),
        "inplace_int": (_iint, [ints((7, 5), 30, 1), ints((5,), 8)]),
    }, local="exact"),
    # Exhaustive 2x2: all combinations up to 36, else a covering set.
    **oracle.policy({
        "unary_real_binary_scalars": (lambda a: _unary_real(a) + _binary_scalars(a), [(7, 5)]),
        "unary_unit": (_unary_unit, [uniform((7, 5), -0.9, 0.9)]),
        "unary_positive": (_unary_positive, [uniform((7, 5), 0.3, 2.5)]),
        "nan_to_num": (lambda a: (a.nan_to_num(0.5, 2.0, -3.0), lib(a).nan_to_num(a)),
                       [Input(_with_specials)]),
        "binary_broadcast": (_binary, [(7, 5), some_of((5,), S0, P)]),
        "xlogy_float_power": (_xlogy_float_power, [(7, 5), uniform((7, 1), 0.5, 2.0,
                                                                   layouts=(S0, P))]),
        "heaviside_nextafter": (_not_differentiable,
                                [Input(lambda g: torch.randn((7, 5), generator=g).round(), False),
                                 Input(lambda g: torch.randn((5,), generator=g), False)]),
        "inplace_more": (_inplace_more, [(7, 5), some_of((5,), S0, B)]),
    }, full_2x2_max=36),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "lerp_inplace": (lambda a, b: (a * 1).lerp_(b, 0.3), [(7, 5), _floats((7, 5), (S1, B, P))]),
        "addcmul_inplace": (lambda a, b, c: (a * 1).addcmul_(b, c, value=0.5),
                            [(7, 5), _floats((7, 5), (S0, B)), _floats((7, 5), (S1, B))]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


# ------------------------------------------------------------------ signature table
def _ones(shape, sbp, pl, dtype=torch.float32):
    return sbpflow.ones(*shape, placement=pl, sbp=sbp, dtype=dtype)


def _mask(shape, sbp, pl):
    return _ones(shape, sbp, pl, torch.bool)


# (description, fn(pl) -> output, output SBP, collectives). Written from the math: an exact
# P rule runs no collective; an op without one boxes its P input.
SIGNATURE_TABLE = [
    ("masked_fill 0 of P", lambda pl: _ones((7, 5), P, pl).masked_fill(_mask((7, 5), B, pl), 0.0),
     P, []),
    ("masked_fill tensor of P", lambda pl: _ones((7, 5), P, pl).masked_fill(
        _mask((7, 5), B, pl), _ones((), P, pl)), P, []),
    ("lerp P P", lambda pl: _ones((7, 5), P, pl).lerp(_ones((7, 5), P, pl), 0.3), P, []),
    ("lerp P P B", lambda pl: _ones((7, 5), P, pl).lerp(_ones((7, 5), P, pl),
                                                        _ones((5,), B, pl)), P, []),
    ("where B P P", lambda pl: sbpflow.where(_mask((7, 5), B, pl), _ones((7, 5), P, pl),
                                             _ones((7, 5), P, pl)), P, []),
    ("where B P 0", lambda pl: sbpflow.where(_mask((7, 5), B, pl), _ones((7, 5), P, pl), 0.0),
     P, []),
    ("addcmul P P B", lambda pl: _ones((7, 5), P, pl).addcmul(_ones((7, 5), P, pl),
                                                              _ones((5,), B, pl)), P, []),
    ("addcdiv P P B", lambda pl: _ones((7, 5), P, pl).addcdiv(_ones((7, 5), P, pl),
                                                              _ones((5,), B, pl)), P, []),
    ("clamp S0", lambda pl: _ones((7, 5), S0, pl).clamp(0, 0.5), S0, []),
    ("remainder S1 S0", lambda pl: _ones((7, 5), S1, pl) % _ones((5,), S0, pl), S1, []),
    ("double of P", lambda pl: _ones((7, 5), P, pl).double(), P, []),
    ("long of P", lambda pl: _ones((7, 5), P, pl).long(), B, ["all_reduce"]),
    ("bool of P", lambda pl: _ones((7, 5), P, pl).bool(), B, ["all_reduce"]),
    ("int of int P", lambda pl: _ones((7, 5), P, pl, torch.int64).int(), P, []),
    ("float of S1", lambda pl: _ones((7, 5), S1, pl, torch.int64).float(), S1, []),
    ("P add_ B", lambda pl: _ones((7, 5), P, pl).add_(_ones((5,), B, pl)), P, []),
    ("P add_ number", lambda pl: _ones((7, 5), P, pl).add_(2.0), P, []),
    ("P mul_ P", lambda pl: _ones((7, 5), P, pl).mul_(_ones((7, 5), P, pl)), P, ["all_reduce"]),
    ("P div_ number", lambda pl: _ones((7, 5), P, pl).div_(3.0), P, []),
    ("S0 add_ S0", lambda pl: _ones((7, 5), S0, pl).add_(_ones((7, 5), S0, pl)), S0, []),
    ("S1 mul_ B", lambda pl: _ones((7, 5), S1, pl).mul_(_ones((7, 1), B, pl)), S1, []),
    ("B add_ P", lambda pl: _ones((7, 5), B, pl).add_(_ones((7, 5), P, pl)), B, ["all_reduce"]),
    ("P fill_", lambda pl: _ones((7, 5), P, pl).fill_(3.0), P, []),
    ("S0 copy_ B", lambda pl: _ones((7, 5), S0, pl).copy_(_ones((7, 5), B, pl)), S0, []),
    ("P masked_fill_ 2", lambda pl: _ones((7, 5), P, pl).masked_fill_(_mask((7, 5), B, pl), 2.0),
     P, []),
]


def _signature_table(table: str = "SIGNATURE_TABLE"):
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, fn, want, want_comms in globals()[table]:
        with CommRecorder() as rec:
            out = fn(pl)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}: got {out.sbp} with {rec.kinds()}, want {want} "
                            f"with {want_comms}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


# ------------------------------------------------------------------ P semantics
def _partial_from_summands(v: torch.Tensor, pl):
    """A P tensor whose summands are not (value, 0, ...): rank r holds v * w_r, sum 1."""
    n = len(pl.rank_list)
    r = pl.rank_list.index(sbpflow.distributed.get_rank())
    w = (2 * r + 1) / n ** 2  # sum over r of (2r + 1) is n^2; exact dyadic for n = 2, 4
    return sbpflow.from_torch(v * w).to_global(pl, P)


def _partial_casts_and_fills():
    pl = sbpflow.placement.all("cpu")
    v = torch.arange(-8, 8, dtype=torch.float32).reshape(4, 4) + 0.5
    x = _partial_from_summands(v, pl)
    assert np.array_equal(x.numpy(), v.numpy())
    lng = x.long()
    assert lng.sbp == (B,) and np.array_equal(lng.numpy(), v.long().numpy())
    assert np.array_equal(x.to(torch.int32).numpy(), v.int().numpy())
    assert np.array_equal(x.bool().numpy(), v.bool().numpy())
    assert x.double().sbp == (P,)
    assert np.array_equal(x.double().numpy(), v.double().numpy())
    # copy_ of a float P source into an int P target: exact (boxed through B)
    t = _ones((4, 4), P, pl, torch.int64)
    t.copy_(x)
    assert t.sbp == (P,) and np.array_equal(t.numpy(), v.long().numpy())
    # Numbers meet a P tensor once.
    y = _partial_from_summands(v, pl)
    y.add_(1.0)
    y.sub_(0.25)
    assert np.allclose(y.numpy(), (v + 0.75).numpy())
    m = torch.arange(16).reshape(4, 4) % 3 == 0
    y.masked_fill_(sbpflow.tensor(m, placement=pl, sbp=B), 9.0)
    assert np.allclose(y.numpy(), (v + 0.75).masked_fill(m, 9.0).numpy())
    # fill_ on P: the value on the first rank of the axis, zeros elsewhere.
    y.fill_(2.5)
    first = sbpflow.distributed.get_rank() == pl.rank_list[0]
    assert torch.equal(y.to_local().to_torch(), torch.full((4, 4), 2.5 if first else 0.0))
    assert np.array_equal(y.numpy(), np.full((4, 4), 2.5, np.float32))
    y.zero_()
    assert not y.to_local().to_torch().any()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_partial_casts_and_fills_are_exact(dist_run, world):
    dist_run(world, _partial_casts_and_fills)


def _partial_2x2_fill():
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    y = sbpflow.zeros(4, 6, placement=pl, sbp=(P, S1))
    y.fill_(1.5)
    assert np.array_equal(y.numpy(), np.full((4, 6), 1.5, np.float32))
    z = sbpflow.zeros(4, 6, placement=pl, sbp=(S0, P))
    z.add_(2.0)
    assert np.array_equal(z.numpy(), np.full((4, 6), 2.0, np.float32))
    return "ok"


def test_partial_fill_and_add_on_2x2(dist_run):
    dist_run(4, _partial_2x2_fill)


# ------------------------------------------------------------------ in-place semantics
def _inplace_semantics():
    pl = sbpflow.placement.all("cpu")
    w = sbpflow.randn(7, 5, placement=pl, sbp=S0, requires_grad=True)
    before = w.numpy()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.add_(1.0)
    with sbpflow.no_grad():  # the optimizer's update
        same = w.sub_(w.grad if w.grad is not None else sbpflow.ones(
            7, 5, placement=pl, sbp=B), alpha=0.5)
    assert same is w and w.sbp == (S0,) and w.is_leaf and w.requires_grad
    assert np.allclose(w.numpy(), before - 0.5)
    # in-place keeps the layout and the local shard (same torch tensor)
    x = sbpflow.ones(7, 5, placement=pl, sbp=S1)
    local = x.to_local().to_torch()
    x += sbpflow.ones(7, 5, placement=pl, sbp=B)
    assert x.to_local().to_torch() is local and x.sbp == (S1,)
    assert np.array_equal(x.numpy(), np.full((7, 5), 2.0, np.float32))
    # no signature keeps P (not linear): the logical value, written back in x's layout
    p = sbpflow.ones(7, 5, placement=pl, sbp=P)
    local = p.to_local().to_torch()
    assert p.clamp_(0, 0.5) is p and p.sbp == (P,) and p.to_local().to_torch() is local
    assert np.allclose(p.numpy(), np.full((7, 5), 0.5, np.float32))
    p.exp_()
    assert p.sbp == (P,) and np.allclose(p.numpy(), np.full((7, 5), np.exp(0.5), np.float32))
    # errors: shapes, kinds
    with pytest.raises(ValueError, match=r"cannot change the shape"):
        sbpflow.ones(5, placement=pl, sbp=B).add_(sbpflow.ones(7, 5, placement=pl, sbp=B))
    with pytest.raises(ValueError, match=r"do not broadcast"):
        x.mul_(sbpflow.ones(3, placement=pl, sbp=B))
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        sbpflow.ones(3, placement=pl, sbp=S0, dtype=torch.int64).div_(2)
    with pytest.raises(TypeError, match="x is global but an argument is local"):
        x.add_(sbpflow.ones(7, 5))
    with pytest.raises(TypeError, match="x is local but an argument is global"):
        sbpflow.ones(7, 5).add_(x)
    sub = sbpflow.placement("cpu", [0])
    with pytest.raises(ValueError, match="move it with"):
        x.add_(sbpflow.ones(7, 5, placement=sub, sbp=B))
    with pytest.raises(ValueError, match="to_global"):
        x.to("meta")
    # a placement that leaves rank 1 out: it takes part with an empty shard
    t = sbpflow.ones(4, placement=sub, sbp=B, requires_grad=True)
    s = t * 1
    s.add_(t)
    s.mul_(2.0)
    s.masked_fill_(s > 100, 0.0)
    assert s.sbp == (B,) and np.array_equal(s.numpy(), np.full(4, 4.0, np.float32))
    s.sum().backward()
    assert np.array_equal(t.grad.numpy(), np.full(4, 4.0, np.float32))
    return "ok"


def test_inplace_semantics_and_errors(dist_run):
    dist_run(2, _inplace_semantics)


def test_inplace_local():
    a = torch.randn(4, 3)
    x = sbpflow.from_torch(a.clone())
    x += 1
    x.mul_(2).clamp_(max=1.0)
    assert torch.equal(x.to_torch(), ((a + 1) * 2).clamp(max=1.0))
    leaf = sbpflow.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        leaf.add_(1)
    with sbpflow.no_grad():
        leaf.add_(1)
    assert leaf.is_leaf and torch.equal(leaf.to_torch().detach(), torch.full((3,), 2.0))
    # += on a non-leaf is differentiated (torch's version counter applies)
    y = leaf * 2
    y += leaf
    y.sum().backward()
    assert torch.equal(leaf.grad.to_torch(), torch.full((3,), 3.0))
    z = leaf.exp()  # exp saves its output: modifying it in place breaks backward
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    d = (leaf * 1).detach_()
    assert d.is_leaf and not d.requires_grad
    with pytest.raises(TypeError, match="must be an sbpflow.Tensor or a number"):
        x.add_("1")


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


# (description, fn(pl) -> output, output SBP, collectives)
ELEMENTWISE_TABLE = [
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


def test_elementwise_table(dist_run):
    results = dist_run(2, _signature_table, "ELEMENTWISE_TABLE")
    assert results[0] == [], "\n".join(results[0])
