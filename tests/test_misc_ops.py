"""Remaining pointwise ops, casts, in-place ops, the autograd surface and error messages
(issue 3): every case against plain torch on one process (values, gradients, dtypes) on
every 1-D input layout on 2 and 4 ranks and a sample of 2x2 layouts; the collectives of
the exact P rules; in-place semantics and errors; retain_grad, hooks, autograd.grad."""

from __future__ import annotations

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

S0, S1 = split(0), split(1)


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


def _cast_to(a, i):
    return (a * 4).to(i) + i + (a * 4).type_as(i) + (a * 4).to(torch.int32).long()


# name -> (function on torch and sbpflow tensors, inputs[, opts])
CASES = {
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
                     + a.div(b, rounding_mode="trunc"), [ints((7, 5), 20, -20), ints((5,), 5, 1)]),
    "masked_fill": (lambda a, m: a.masked_fill(m, 0.0) * 2 + a.masked_fill(m, 1.5),
                    [(7, 5), mask((7, 5))]),
    "masked_fill_broadcast": (lambda a, m: lib(a).masked_fill(a, m, -1.0), [(7, 5), mask((5,))]),
    "masked_fill_tensor_value": (lambda a, m, v: a.masked_fill(m, v),
                                 [(7, 5), Input(mask((7, 1)).make, False, (S0, B)), ()]),
    "lerp_scalar": (lambda a, b: a.lerp(b, 0.3) + lib(a).lerp(a, b, 0.8), [(7, 5), (7, 5)]),
    "lerp_tensor": (lambda a, b, w: a.lerp(b, w), [(7, 5), (5,), some((7, 1), S0, B)]),
    "where_scalars": (lambda a, b: lib(a).where(a > 0, a, 0.0) + lib(a).where(b > 0, 0.0, b) * 2
                      + lib(a).where(a > b, a, b) + lib(a).where(a > 0, 1.0, -1.0)
                      + a.where(b < 0, b * 3), [(7, 5), (5,)]),
    "logical_bitwise_bool": (lambda m, n: ((m ^ n) | (~m & n) | m.logical_xor(n)).long()
                             + (m & True).long() + (False | n).int(), [mask((7, 5)), mask((5,))]),
    "bitwise_int": (lambda a, b: (a & b) + (a | 3) + (a ^ b) + (~a) + (5 & a)
                    + a.bitwise_xor(6) + a.bitwise_not(), [ints((7, 5), 16), ints((5,), 16)]),
    "addcmul_addcdiv": (lambda a, b, c: a.addcmul(b, c, value=0.5)
                        + lib(a).addcdiv(a, b, c.abs() + 1, value=2),
                        [(7, 5), some((7, 5), S1, B, P), some((5,), B, P)]),
    "cast_double": (lambda a: a.double() * a.to(torch.float64) + a.type(torch.float64)
                    + a.to(dtype=torch.float64, copy=True), [(7, 5)]),
    "cast_half": (lambda a: a.half().float() + a.bfloat16().float() * 2 + a.float(), [(7, 5)],
                  {"rtol": 1e-2, "atol": 3e-2}),
    "cast_int": (lambda a: (a * 4).long() + (a > 0).int() + (a * 2).int() + a.bool().long()
                 + (a * 3).type("torch.LongTensor"), [(7, 5)]),
    "cast_to_other": (_cast_to, [(7, 5), ints((5,), 9)]),
    "inplace_add_sub_scalars": (_iops, [(7, 5), (5,)]),
    "inplace_mul_div": (_imul_div, [(7, 5), some((7, 5), S0, B, P),
                                    some((7, 1), B, P, make=positive((7, 1)).make)]),
    "inplace_clamp_masked_fill": (_iclamp_fill, [(7, 5), some((5,), S0, B), mask((7, 5))]),
    "inplace_masked_fill_partial": (_imasked_fill_partial, [(7, 5), mask((7, 1))]),
    "inplace_copy_zero_fill": (_icopy_zero_fill, [(7, 5), (5,)]),
    "inplace_fill_tensor": (_ifill_tensor, [(7, 5), ()]),
    "inplace_unary": (_iunary, [(7, 5)]),
    "inplace_int": (_iint, [ints((7, 5), 30, 1), ints((5,), 8)]),
}


def _sweep_1d(names):
    return oracle.sweep_1d(CASES, names)


@pytest.mark.parametrize("world", [2, 4])
def test_misc_every_1d_layout_match_torch(dist_run, world):
    results = dist_run(world, _sweep_1d, sorted(CASES))
    assert results[0] == [], "\n".join(results[0])


def _sweep_2x2(names, per_case):
    return oracle.sweep_2x2(CASES, names, per_case)


def test_misc_2x2_sampled_layouts_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), 6)
    assert results[0] == [], "\n".join(results[0])


@pytest.mark.exhaustive
def test_misc_2x2_every_layout_match_torch(dist_run):
    results = dist_run(4, _sweep_2x2, sorted(CASES), None, timeout=3600)
    assert results[0] == [], "\n".join(results[0])


def test_misc_cases_local_match_torch():
    for name, case in CASES.items():
        fn, inputs = case[0], case[1]
        values, _ = oracle._values(name, inputs)
        grads = [oracle._spec(i).grad and v.is_floating_point() for i, v in zip(inputs, values)]
        ref_in = [v.clone().requires_grad_(r) for v, r in zip(values, grads)]
        xs = [sbpflow.tensor(v, requires_grad=r) for v, r in zip(values, grads)]
        ref, out = fn(*ref_in), fn(*xs)
        assert out.dtype == ref.dtype, name
        assert torch.equal(out.to_torch().detach(), ref.detach()), name
        if ref.requires_grad:
            ref.sum().backward()
            out.sum().backward()
            for x, r in zip(xs, ref_in):
                if r.grad is not None:
                    assert torch.equal(x.grad.to_torch(), r.grad), name


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


# ------------------------------------------------------------------ autograd surface
def _retain_grad_and_hooks():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv, wv = torch.randn(6, 4), torch.randn(4, 3)
    x = sbpflow.tensor(xv, placement=pl, sbp=S0, requires_grad=True)
    w = sbpflow.tensor(wv, placement=pl, sbp=B, requires_grad=True)
    h = x @ w  # S0
    hb = h.to_global(sbp=B)  # B non-leaf: its gradient arrives P
    hp = (x @ w).sum(dim=0)  # B after P? keep: sum over the split dim gives P
    assert hp.sbp == (P,)
    for t in (h, hb, hp):
        t.retain_grad()
        assert t.retains_grad and not t.is_leaf and t.grad_fn is not None
    seen = {}

    def record(name):
        def hook(g):
            seen[name] = (g.sbp, g.numpy())
        return hook

    hb.register_hook(record("hb"))
    w.register_hook(record("w"))
    doubled = hp.register_hook(lambda g: g * 2)  # replace: doubles hp's gradient
    loss = (hb * hb).sum() + hp.sum()
    loss.backward()
    # torch reference
    xr, wr = xv.clone().requires_grad_(True), wv.clone().requires_grad_(True)
    hr = xr @ wr
    hr.retain_grad()
    hpr = (xr @ wr).sum(dim=0)
    hpr.retain_grad()
    hpr.register_hook(lambda g: g * 2)
    ((hr * hr).sum() + hpr.sum()).backward()
    assert hb.grad.sbp == (B,) and h.grad.sbp == (S0,) and hp.grad.sbp == (P,)
    assert np.allclose(hb.grad.numpy(), hr.grad.numpy(), atol=1e-5)
    assert np.allclose(h.grad.numpy(), hr.grad.numpy(), atol=1e-5)
    assert np.allclose(hp.grad.numpy(), hpr.grad.numpy(), atol=1e-5)  # after the hook
    assert seen["hb"][0] == (P,) and np.allclose(seen["hb"][1], hr.grad.numpy(), atol=1e-5)
    # w's gradient is reduced in the backward's buckets after its hook runs: P (summands).
    assert seen["w"][0] == (P,) and np.allclose(seen["w"][1], wr.grad.numpy(), atol=1e-5)
    assert np.allclose(w.grad.numpy(), wr.grad.numpy(), atol=1e-5)
    assert np.allclose(x.grad.numpy(), xr.grad.numpy(), atol=1e-5)
    doubled.remove()
    hb.grad = None
    assert hb.grad is None
    return "ok"


def test_retain_grad_and_hooks_global(dist_run):
    dist_run(2, _retain_grad_and_hooks)


def _autograd_grad_global():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(1)
    xv, wv, gv = torch.randn(6, 4), torch.randn(4, 3), torch.randn(6, 3)
    x = sbpflow.tensor(xv, placement=pl, sbp=S1, requires_grad=True)
    w = sbpflow.tensor(wv, placement=pl, sbp=B, requires_grad=True)
    u = sbpflow.tensor(wv, placement=pl, sbp=S0, requires_grad=True)  # unused
    y = (x @ w).tanh()
    g_out = sbpflow.tensor(gv, placement=pl, sbp=S0)
    gx, gw, gu = sbpflow.autograd.grad(y, [x, w, u], grad_outputs=g_out, retain_graph=True,
                                       allow_unused=True)
    xr, wr = xv.clone().requires_grad_(True), wv.clone().requires_grad_(True)
    gxr, gwr = torch.autograd.grad((xr @ wr).tanh(), [xr, wr], gv)
    assert gu is None and x.grad is None and w.grad is None  # returned, not accumulated
    assert gx.sbp == (S1,) and gw.sbp == (B,)
    assert np.allclose(gx.numpy(), gxr.numpy(), atol=1e-5)
    assert np.allclose(gw.numpy(), gwr.numpy(), atol=1e-5)
    # a non-leaf input, and a B scalar output seeded like backward()
    loss = y.sum().to_global(sbp=B)
    (gy,) = sbpflow.autograd.grad(loss, y, retain_graph=True)
    assert gy.sbp == y.sbp and np.allclose(gy.numpy(), np.ones((6, 3)))
    with pytest.raises(RuntimeError, match="not have been used|does not require grad|unused"):
        sbpflow.autograd.grad(loss, [u], retain_graph=True)
    with pytest.raises(NotImplementedError, match="local tensors only"):
        sbpflow.autograd.grad(loss, [w], create_graph=True)
    # backward of several roots, with and without gradients
    sbpflow.autograd.backward([loss, y], [None, g_out])
    wr2 = wv.clone().requires_grad_(True)
    yr = (xv @ wr2).tanh()
    torch.autograd.backward([yr.sum(), yr], [None, gv])
    assert w.grad.sbp == (B,) and np.allclose(w.grad.numpy(), wr2.grad.numpy(), atol=1e-5)
    # a leaf with a ZeRO gradient layout gets its gradient in that layout
    z = sbpflow.tensor(wv, placement=pl, sbp=B).set_grad_sbp(S0)
    (gz,) = sbpflow.autograd.grad((x @ z).sum(), z)
    assert gz.sbp == (S0,) and np.allclose(gz.numpy(), xv.sum(0)[:, None].expand(4, 3).numpy())
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_autograd_grad_global(dist_run, world):
    dist_run(world, _autograd_grad_global)


def test_autograd_local():
    xv = torch.randn(5)
    x = sbpflow.tensor(xv, requires_grad=True)
    y = x.sin() * x
    (g,) = sbpflow.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = sbpflow.autograd.grad(g.sum(), x)
    xr = xv.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad((xr.sin() * xr).sum(), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    assert torch.allclose(g.to_torch(), gr) and torch.allclose(gg.to_torch(), ggr)
    # grad_outputs, allow_unused, hooks that replace, retain_grad
    u = sbpflow.ones(2, requires_grad=True)
    h = x * 2
    h.retain_grad()
    h.register_hook(lambda t: t * 3)
    seen = []
    x.register_hook(lambda t: seen.append(t.to_torch().clone()))
    gx, gu = sbpflow.autograd.grad(h, [x, u], grad_outputs=sbpflow.ones(5), allow_unused=True,
                                   retain_graph=True)
    assert gu is None and torch.equal(gx.to_torch(), torch.full((5,), 6.0))
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((5,), 6.0))
    sbpflow.autograd.backward([h.sum()])
    # retained in both passes (torch: retain_grad also sees autograd.grad's gradient)
    assert h.retains_grad and torch.equal(h.grad.to_torch(), torch.full((5,), 6.0))
    assert torch.equal(x.grad.to_torch(), torch.full((5,), 6.0))
    with pytest.raises(TypeError, match="callable"):
        x.register_hook(3)
    with pytest.raises(TypeError, match="sequence of them"):
        sbpflow.autograd.grad(h.sum(), torch.ones(2))
    with pytest.raises(ValueError, match="2 gradients for 1 outputs"):
        sbpflow.autograd.backward(h, [None, None])
    assert sbpflow.autograd.no_grad is torch.no_grad


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


def test_cast_local_and_to():
    x = sbpflow.tensor([[1.5, -2.5]])
    assert x.to(torch.float32) is x and x.to("cpu") is x
    assert x.to(torch.float64).dtype == torch.float64
    assert x.to("cpu", torch.int64).dtype == torch.int64
    assert x.to(sbpflow.ones(1, dtype=torch.int32)).dtype == torch.int32
    assert x.type() == "torch.FloatTensor" and x.type("torch.DoubleTensor").dtype == torch.float64
    assert x.to(torch.float32, copy=True) is not x
    with pytest.raises(TypeError, match="unexpected argument"):
        x.to([1])
