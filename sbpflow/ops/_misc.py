"""The remaining pointwise ops, casts and in-place ops (issue 3).

Pointwise ops are registered with the splits that :func:`sbpflow.ops._rules.elementwise`
derives from broadcasting, plus the partial-sum (P) signatures that are *exact* for each
(one mesh axis; ``(in_0, ..., out)``). An op without a P signature boxes a P input away
(the chooser picks the cheapest: reduce-scatter to S or all-reduce to B).

=========================================== ===========================================
op                                          exact P signatures
=========================================== ===========================================
clamp, pow, ``c ** x``, ``c / x``, div with   none (not linear)
rounding_mode, floor_divide, remainder,
fmod, bitwise_*, logical_xor
masked_fill(x, mask, value: number)         (P, B) -> P when value == 0
masked_fill(x, mask, value: 0-d tensor)     (P, B, P) -> P  (linear in (x, value))
lerp(a, b, weight: number)                  (P, P) -> P     ((1 - w) a + w b)
lerp(a, b, weight: tensor)                  (P, P, B) -> P
where(c, x, y)                              (B, P, P) -> P
where(c, x, 0), where(c, 0, y)              (B, P) -> P
addcmul(x, t1, t2)                          (P, P, B), (P, B, P) -> P
addcdiv(x, t1, t2)                          (P, P, B) -> P
cast to a float/complex dtype, int -> int   (P) -> P
=========================================== ===========================================

**Casts** (``to``, ``float``, ``int``, ``type``, ``type_as`` ...) keep the layout. A P
tensor cast to a floating or complex dtype stays P (each summand is rounded to the target
dtype, so the value is within that dtype's rounding of the one-process cast); an integer
cast to another integer dtype stays P (wrap-around commutes with the sum). A cast of a P
tensor from a floating dtype to an integer dtype, or to bool, would truncate each summand
and give wrong numbers: those P mesh axes are boxed to B first (an all-reduce), so the
result is B there. The device of a global tensor comes from its placement.

**In-place ops** (``add_``, ``mul_``, ``clamp_``, ``masked_fill_``, ``fill_``, ``copy_``,
``+=`` ...). A local tensor: torch's in-place op on the wrapped tensor. A global tensor
keeps its SBP and its local shard: the other inputs are boxed to the cheapest signature of
the op's rule whose first input and output are the tensor's own layout, then torch's
in-place op runs on the shard. So autograd is torch's: in-place on a leaf that requires
grad raises torch's RuntimeError (outside :func:`sbpflow.no_grad`), in-place on a
non-leaf is differentiated through, version counters apply. The other inputs may need a
collective (``x.mul_(y)`` with x and y both P all-reduces y to B; ``x.add_(y)`` with x P
and y B makes y's P summands locally). Where no signature keeps the layout (``clamp_``,
``exp_``, ``relu_`` ... of a P tensor: not linear) a ValueError names the layouts and the
fix (``x = x.to_global(sbp=...)`` first, or the out-of-place op). A number added to, filled
into or masked into a P tensor is added once, not once per rank: it becomes a B 0-d
tensor boxed to P (the rank at coordinate 0 of each P axis holds it, the others 0).
``fill_(v)`` of a P tensor therefore leaves ``v`` on that rank and zeros elsewhere (the
same layout as ``sbpflow.full(..., sbp=P)``); ``zero_`` zeros every rank.
"""

from __future__ import annotations

import itertools
import numbers
from functools import lru_cache

import torch

from ..sbp import broadcast as B
from ..sbp import format_nd_sbp
from ..sbp import partial_sum as P
from ..tensor import Tensor
from ._core import UNARY
from ._dispatch import apply, check_writable, coerce_operand
from ._registry import Meta, _boxing_cost, _one_axis_signatures, get_op, infer_meta, register
from ._rules import elementwise
from .creation import full

__all__ = ["where"]


def _pointwise(*partial, when=None):
    """Elementwise splits plus the P signatures ``partial`` (only where ``when(attrs)``)."""
    base = elementwise()

    def rule(metas, attrs):
        sigs = base(metas, attrs)
        if partial and (when is None or when(attrs)):
            sigs += [tuple(s) for s in partial]
        return sigs

    return rule


def _keeps_partial(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast ``src -> dst`` of every summand gives the summands of the cast sum."""
    if dst.is_floating_point or dst.is_complex:
        return True
    if dst == torch.bool:
        return False
    return not (src.is_floating_point or src.is_complex)


def _cast_rule(metas, attrs):
    sigs = elementwise()(metas, attrs)
    if _keeps_partial(metas[0].dtype, attrs["dtype"]):
        sigs.append((P, P))
    return sigs


# --------------------------------------------------------------- registrations (sorted)
register("addcdiv", _pointwise((P, P, B, P)))(
    lambda a, t1, t2, *, value: torch.addcdiv(a, t1, t2, value=value))
register("addcmul", _pointwise((P, P, B, P), (P, B, P, P)))(
    lambda a, t1, t2, *, value: torch.addcmul(a, t1, t2, value=value))
for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    _fn = getattr(torch, _name)
    register(_name, _pointwise())(_fn)
    register(f"{_name}_scalar", _pointwise())(lambda a, *, other, _fn=_fn: _fn(a, other))
register("bitwise_not", _pointwise())(torch.bitwise_not)
register("cast", _cast_rule)(lambda a, *, dtype: a.to(dtype, copy=True))
register("clamp", _pointwise())(lambda a, *, lo, hi: torch.clamp(a, lo, hi))
register("clamp_max_tensor", _pointwise())(lambda a, hi: torch.clamp(a, max=hi))
register("clamp_min_tensor", _pointwise())(lambda a, lo: torch.clamp(a, min=lo))
register("clamp_tensor", _pointwise())(lambda a, lo, hi: torch.clamp(a, lo, hi))
# copy_/fill_ targets: the result is the source, so a P source gives P summands.
register("copy_from", _pointwise((P, P, P)))(lambda a, src: src.to(a.dtype).expand_as(a))
register("div_mode", _pointwise())(
    lambda a, b, *, rounding_mode: torch.div(a, b, rounding_mode=rounding_mode))
register("div_mode_scalar", _pointwise())(
    lambda a, *, other, rounding_mode: torch.div(a, other, rounding_mode=rounding_mode))
register("fill", _pointwise((P, P, P)))(lambda a, v: v.to(a.dtype).expand_as(a))
register("fill_scalar", _pointwise((P, P), when=lambda at: at["value"] == 0))(
    lambda a, *, value: torch.full_like(a, value))
register("floor_divide", _pointwise())(torch.floor_divide)
register("floor_divide_scalar", _pointwise())(lambda a, *, other: torch.floor_divide(a, other))
register("fmod", _pointwise())(torch.fmod)
register("fmod_scalar", _pointwise())(lambda a, *, other: torch.fmod(a, other))
register("lerp", _pointwise((P, P, P)))(lambda a, b, *, weight: torch.lerp(a, b, weight))
register("lerp_tensor", _pointwise((P, P, B, P)))(torch.lerp)
register("logical_xor", _pointwise())(torch.logical_xor)
register("masked_fill", _pointwise((P, B, P), when=lambda at: at["value"] == 0))(
    lambda a, mask, *, value: a.masked_fill(mask, value))
register("masked_fill_tensor", _pointwise((P, B, P, P)))(
    lambda a, mask, v: a.masked_fill(mask, v))
register("rdiv_scalar", _pointwise())(lambda a, *, other: a.reciprocal() * other)  # torch's
register("remainder", _pointwise())(torch.remainder)
register("remainder_scalar", _pointwise())(lambda a, *, other: torch.remainder(a, other))
register("rfloor_divide_scalar", _pointwise())(lambda a, *, other: torch.floor_divide(other, a))
register("rpow_scalar", _pointwise())(lambda a, *, other: torch.pow(other, a))
register("rremainder_scalar", _pointwise())(lambda a, *, other: torch.remainder(other, a))
register("where_input_scalar", _pointwise((B, P, P), when=lambda at: at["input"] == 0))(
    lambda c, y, *, input: torch.where(c, input, y))
register("where_other_scalar", _pointwise((B, P, P), when=lambda at: at["other"] == 0))(
    lambda c, x, *, other: torch.where(c, x, other))
register("where_scalars", _pointwise())(lambda c, *, input, other: torch.where(c, input, other))
register("where_tensor", _pointwise((B, P, P, P)))(torch.where)


# --------------------------------------------------------------- argument helpers
def _is_number(v) -> bool:
    return isinstance(v, numbers.Number) and not isinstance(v, Tensor)


def _want_tensor(name: str, what: str, v) -> Tensor:
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: {what} must be an sbpflow.Tensor or a Python number, got "
                        f"{type(v).__name__} (wrap torch tensors with sbpflow.from_torch)")
    return v


def _fill_value(name: str, x: Tensor, value):
    """A masked_fill/fill value: a number, or a 0-d tensor (a local 0-d tensor that needs
    no gradient is read as a number for a global ``x``)."""
    if isinstance(value, torch.Tensor):
        value = Tensor(value)
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise ValueError(f"{name} only supports a 0-dimensional value tensor, got shape "
                             f"{tuple(value.shape)}")
        if x.is_global and value.is_local:
            if value.requires_grad:
                raise TypeError(f"{name}: x is global but the value is a local tensor that "
                                f"requires grad; convert it with value.to_global(placement, "
                                f"sbp=sbpflow.sbp.broadcast)")
            return value.item()
        return value
    if _is_number(value):
        return value
    raise TypeError(f"{name}: value must be a number or a 0-d tensor, got {type(value).__name__}")


def _has_partial(x: Tensor) -> bool:
    return x.is_global and any(s.is_partial() for s in x.sbp)


def _global_scalar(x: Tensor, value, dtype: torch.dtype) -> Tensor:
    """``value`` as a B 0-d global tensor on ``x``'s placement (boxed to P by the in-place
    ops of a P tensor, so that it is counted once)."""
    return full((), value, dtype=dtype, placement=x.placement, sbp=(B,) * x.placement.ndim)


# --------------------------------------------------------------- out-of-place methods
def _binary(op: str, scalar_op: str, name: str, reflected_op: str | None = None):
    """``x.name(other)``: op ``op`` with a tensor, ``scalar_op`` (``other=``) with a number;
    ``reflected_op`` makes the reflected operator (``number <op> x``)."""

    def method(self, other):
        other = coerce_operand(self, other)
        if reflected_op is not None:
            if _is_number(other):
                return apply(reflected_op, self, other=other)
            if isinstance(other, Tensor):  # an array operand, made a tensor above
                return apply(op, other, self)
            return NotImplemented
        if isinstance(other, Tensor):
            return apply(op, self, other)
        if _is_number(other):
            return apply(scalar_op, self, other=other)
        if name.startswith("__"):
            return NotImplemented
        raise TypeError(f"{name}: other must be an sbpflow.Tensor or a number, got "
                        f"{type(other).__name__}")

    method.__name__ = name
    method.__doc__ = (f"``torch.Tensor.{name}`` elementwise with broadcasting (ops "
                      f"``{op}``/``{scalar_op}``; no exact P rule: a P input is boxed).")
    return method


def _div(self, other, *, rounding_mode=None):
    """``torch.div(x, other, rounding_mode=None)``: true division, or rounded with
    ``rounding_mode`` ``'trunc'`` / ``'floor'`` (integer inputs stay integer).

    SBP: ``P / B`` and ``P / number`` stay P for true division; rounded division has no
    P rule. Raises ValueError for another rounding mode, TypeError for another ``other``.
    """
    if rounding_mode is None:
        if isinstance(other, Tensor):
            return apply("div", self, other)
        if _is_number(other):
            return apply("div_scalar", self, other=other)
    elif rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found {rounding_mode!r}")
    elif isinstance(other, Tensor):
        return apply("div_mode", self, other, rounding_mode=rounding_mode)
    elif _is_number(other):
        return apply("div_mode_scalar", self, other=other, rounding_mode=rounding_mode)
    raise TypeError(f"div: other must be an sbpflow.Tensor or a number, got "
                    f"{type(other).__name__}")


def _bound(name: str, v):
    if v is None or _is_number(v) or isinstance(v, Tensor):
        return v
    raise TypeError(f"{name}: min and max must be numbers, sbpflow Tensors or None, got "
                    f"{type(v).__name__}")


def _clamp(self, min=None, max=None):  # noqa: A002 - torch's argument names
    """``torch.clamp``: elementwise ``min(max(x, min), max)``; bounds are numbers or
    tensors broadcasting to ``x`` (one of each kind is allowed too), either may be None.

    SBP: splits follow broadcasting; no P rule (clamp is not linear), a P input is boxed.
    Raises ValueError when both bounds are None.
    """
    lo, hi = _bound("clamp", min), _bound("clamp", max)
    if lo is None and hi is None:
        raise ValueError("clamp: at least one of 'min' or 'max' must not be None")
    lo_t, hi_t = isinstance(lo, Tensor), isinstance(hi, Tensor)
    if not lo_t and not hi_t:
        return apply("clamp", self, lo=lo, hi=hi)
    if lo_t and hi_t:
        return apply("clamp_tensor", self, lo, hi)
    out = self
    if lo is not None:
        out = apply("clamp_min_tensor", out, lo) if lo_t else apply("clamp", out, lo=lo, hi=None)
    if hi is not None:
        out = apply("clamp_max_tensor", out, hi) if hi_t else apply("clamp", out, lo=None, hi=hi)
    return out


def _masked_fill(self, mask, value):
    """``torch.Tensor.masked_fill``: ``value`` (a number or a 0-d tensor) where the bool
    ``mask`` (broadcasting to ``x``) is True.

    SBP: ``(P, B) -> P`` when ``value == 0``; with a 0-d tensor value ``(P, B, P) -> P``.
    """
    mask = _want_tensor("masked_fill", "mask", mask)
    value = _fill_value("masked_fill", self, value)
    if isinstance(value, Tensor):
        return apply("masked_fill_tensor", self, mask, value)
    return apply("masked_fill", self, mask, value=value)


def _lerp(self, end, weight):
    """``torch.lerp``: ``x + weight * (end - x)``; ``weight`` a number or a tensor.

    SBP: ``(P, P) -> P`` with a number weight, ``(P, P, B) -> P`` with a tensor weight.
    """
    end = _want_tensor("lerp", "end", end)
    if isinstance(weight, Tensor):
        return apply("lerp_tensor", self, end, weight)
    if _is_number(weight):
        return apply("lerp", self, end, weight=weight)
    raise TypeError(f"lerp: weight must be a number or an sbpflow.Tensor, got "
                    f"{type(weight).__name__}")


def _addc(kind: str):
    def method(self, tensor1, tensor2, *, value=1):
        t1 = _want_tensor(kind, "tensor1", tensor1)
        t2 = _want_tensor(kind, "tensor2", tensor2)
        return apply(kind, self, t1, t2, value=value)

    method.__name__ = kind
    method.__doc__ = (f"``torch.{kind}``: ``x + value * tensor1 {'*' if kind == 'addcmul' else '/'}"
                      f" tensor2``. SBP: P in ``x`` and ``tensor1`` "
                      f"{'(or tensor2) ' if kind == 'addcmul' else ''}with the other B -> P.")
    return method


def where(condition: Tensor, input, other) -> Tensor:  # noqa: A002 - torch's names
    """``torch.where(condition, input, other)``: ``input`` where the bool ``condition`` is
    True, else ``other``; each of ``input``/``other`` is a tensor or a Python number, all
    broadcasting together (torch's type promotion).

    SBP: splits follow broadcasting; ``(B, P, P) -> P``, and with one operand the number
    0, ``(B, P) -> P`` (a selection is linear in its operands jointly).

    Raises:
        TypeError: ``condition`` is not an sbpflow Tensor, or an operand is neither a
            tensor nor a number.
    """
    cond = _want_tensor("where", "condition", condition)
    for what, v in (("input", input), ("other", other)):
        if not (isinstance(v, Tensor) or _is_number(v)):
            raise TypeError(f"where: {what} must be an sbpflow.Tensor or a number, got "
                            f"{type(v).__name__}")
    it, ot = isinstance(input, Tensor), isinstance(other, Tensor)
    if it and ot:
        return apply("where_tensor", cond, input, other)
    if it:
        return apply("where_other_scalar", cond, input, other=other)
    if ot:
        return apply("where_input_scalar", cond, other, input=input)
    return apply("where_scalars", cond, input=input, other=other)


# --------------------------------------------------------------- casts
def _cast(x: Tensor, dtype: torch.dtype, copy: bool = False) -> Tensor:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {dtype!r}")
    if dtype == x.dtype and not copy:
        return x
    if x.is_local:
        return Tensor(x._local.to(dtype, copy=copy))
    if _has_partial(x) and not _keeps_partial(x.dtype, dtype):
        # Truncating each summand is not truncating the sum: make those axes B first.
        x = x.to_global(sbp=tuple(B if s.is_partial() else s for s in x.sbp))
    return apply("cast", x, dtype=dtype)


def _to(self, *args, dtype=None, device=None, copy: bool = False, non_blocking: bool = False,
        memory_format=None):
    """``torch.Tensor.to``: ``to(dtype)``, ``to(device)``, ``to(device, dtype)``,
    ``to(other)`` (its dtype and device), keywords ``dtype=``, ``device=``, ``copy=``.
    Returns ``self`` when nothing changes (unless ``copy=True``), as torch does.

    Global tensors keep their layout (see the module doc for P and integer dtypes); their
    device is their placement's, so a device of another type raises ValueError naming the
    fix (``x.to_global(placement=sbpflow.placement('cuda', ranks), ...)``).
    """
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (Tensor, torch.Tensor)):
            dtype, device = a.dtype, a.device
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            device = a
        else:
            raise TypeError(f"to(): unexpected argument {a!r}; pass a dtype, a device or a "
                            f"tensor")
    if self.is_local:
        kw = {"copy": copy, "non_blocking": non_blocking}
        if memory_format is not None:
            kw["memory_format"] = memory_format
        out = self._local.to(device=device, dtype=dtype, **kw)
        return self if out is self._local else Tensor(out)
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != self.device.type:
            raise ValueError(
                f"to({str(dev)!r}): a global tensor lives on its placement {self.placement!r}; "
                f"move it with x.to_global(placement=sbpflow.placement({dev.type!r}, ranks), "
                f"sbp=x.sbp)")
    return _cast(self, self.dtype if dtype is None else dtype, copy)


def _caster(name: str, dtype: torch.dtype):
    def method(self):
        return _cast(self, dtype)

    method.__name__ = name
    method.__doc__ = (f"``x.{name}()`` is ``x.to({dtype})`` (layout kept; a P tensor cast to "
                      f"an integer or bool dtype is boxed to B first).")
    return method


def _type(self, dtype=None, non_blocking: bool = False):
    """``torch.Tensor.type``: without arguments the type string (``'torch.FloatTensor'``,
    of the local shard); with a dtype or a type string, the cast (``to``)."""
    if dtype is None:
        return self._local.type()
    if isinstance(dtype, str):
        obj = torch
        try:
            for part in dtype.split(".")[1:]:
                obj = getattr(obj, part)
            dtype = obj.dtype
        except AttributeError:
            raise ValueError(f"type(): invalid type {dtype!r}") from None
    return _cast(self, dtype)


def _type_as(self, other):
    """``x.type_as(other)`` is ``x.to(other.dtype)``."""
    return _cast(self, _want_tensor("type_as", "other", other).dtype)


# --------------------------------------------------------------- in-place machinery
@lru_cache(maxsize=4096)
def _inplace_signature(op, attrs_key, metas, sbps, pl):
    """The inputs' nd-SBPs for ``op`` with the first input and the output both laid out
    as ``sbps[0]`` (the cheapest boxing of the others), or None if no signature keeps it."""
    per_axis_all = _one_axis_signatures(op, metas, dict(attrs_key))
    per_axis = []
    for own in sbps[0]:
        sigs = [s for s in per_axis_all if s[0] == own and s[-1] == own]
        if not sigs:
            return None
        per_axis.append(sigs)
    best, best_key = None, None
    for k, combo in enumerate(itertools.product(*per_axis)):
        ins = tuple(tuple(sig[i] for sig in combo) for i in range(len(metas)))
        cost = [_boxing_cost(m, pl, s, want) for m, s, want in zip(metas[1:], sbps[1:], ins[1:])]
        key = (sum(c[0] for c in cost), sum(c[1] for c in cost), k)
        if best_key is None or key < best_key:
            best, best_key = ins, key
    return best


def _inplace(self: Tensor, name: str, op: str, others, attrs: dict, run) -> Tensor:
    """Run torch's in-place ``run(self_local, *other_locals)`` as op ``name``; the layout
    rules are op ``op``'s (registry) with ``attrs``. See the module doc."""
    for i, o in enumerate(others):
        if not isinstance(o, Tensor):
            raise TypeError(f"{name}: argument {i} is a {type(o).__name__}, expected an "
                            f"sbpflow.Tensor")
    if self.is_local:
        if any(o.is_global for o in others):
            raise TypeError(f"{name}: x is local but an argument is global; convert x with "
                            f"x.to_global(placement, sbp) or the argument with .to_local()")
        run(self._local, *(o._local for o in others))
        return self
    if any(o.is_local for o in others):
        raise TypeError(f"{name}: x is global but an argument is local; convert it with "
                        f"arg.to_global(x.placement, sbp)")
    check_writable(self, name)
    pl = self.placement
    for o in others:
        if o.placement != pl:
            raise ValueError(f"{name}: x lives on {pl!r} but an argument on {o.placement!r}; "
                             f"move it with arg.to_global(placement=x.placement, sbp=...)")
    if torch.is_grad_enabled() and self._local.is_leaf and self._local.requires_grad:
        raise RuntimeError(f"a leaf Variable that requires grad is being used in an in-place "
                           f"operation ({name}); update parameters under sbpflow.no_grad(), or "
                           f"use the out-of-place op")
    spec = get_op(op)
    attrs_key = tuple(sorted(attrs.items()))
    metas = (Meta(tuple(self.shape), self.dtype),) + tuple(
        Meta(tuple(o.shape), o.dtype) for o in others)
    shapes = ", ".join(str(tuple(m.shape)) for m in metas)
    try:
        out = infer_meta(spec, attrs_key, metas)
    except RuntimeError as e:
        raise ValueError(f"{name}: input shapes {shapes} do not broadcast ({e})") from None
    if not torch.can_cast(out.dtype, self.dtype):  # torch's check, before any collective
        raise RuntimeError(f"{name}: result type {out.dtype} can't be cast to the desired "
                           f"output type {self.dtype}")
    if out.shape != tuple(self.shape):
        raise ValueError(f"{name}: the result would have shape {out.shape} but x has shape "
                         f"{tuple(self.shape)} (inputs {shapes}); an in-place op cannot change "
                         f"the shape, use the out-of-place op")
    sbps = (self.sbp,) + tuple(o.sbp for o in others)
    ins = _inplace_signature(spec, attrs_key, metas, sbps, pl)
    if ins is None:
        # per mesh axis: x's own SBP where a signature keeps it, else B (always kept)
        kept = {sig[0] for sig in _one_axis_signatures(spec, metas, dict(attrs_key))
                if sig[0] == sig[-1]}
        fix = tuple(s if s in kept else B for s in self.sbp)
        raise ValueError(
            f"{name} on a tensor laid out {format_nd_sbp(self.sbp)} (arguments "
            f"{', '.join(format_nd_sbp(o.sbp) for o in others) or 'none'}): the op has no "
            f"exact signature that keeps the layout {format_nd_sbp(self.sbp)} (a split of an "
            f"indexed or scanned dim, or a partial sum the op is not linear in); box it "
            f"first, x = x.to_global(sbp={format_nd_sbp(fix)}), or use the out-of-place op")
    boxed = [o._local if o.sbp == s else o.to_global(pl, s)._local
             for o, s in zip(others, ins[1:])]
    if pl.coord() is None:
        # Outside the placement: keep the empty shard connected to the arguments' graph
        # so that this rank's backward reaches the same boxing steps as the members'.
        links = [b.reshape(-1)[:0].sum() for b in boxed if b.requires_grad]
        if links and self._local.is_floating_point():
            self._local.add_(sum(links).to(self.dtype))
        return self
    run(self._local, *boxed)
    return self


def _scalar_or_tensor(name: str, other):
    if isinstance(other, Tensor) or _is_number(other):
        return other
    raise TypeError(f"{name}: other must be an sbpflow.Tensor or a number, got "
                    f"{type(other).__name__}")


def _add_sub_(kind: str):
    name = f"{kind}_"

    def method(self, other, *, alpha=1):
        other = _scalar_or_tensor(name, other)
        if _is_number(other) and _has_partial(self):
            other = _global_scalar(self, other, torch.result_type(self._local, other))
        if _is_number(other):
            return _inplace(self, name, f"{kind}_scalar", (), {"other": other},
                            lambda s: getattr(s, name)(other, alpha=alpha))
        return _inplace(self, name, kind, (other,), {},
                        lambda s, o: getattr(s, name)(o, alpha=alpha))

    method.__name__ = name
    method.__doc__ = (f"In place ``x.{kind}(other, alpha=alpha)`` (``torch.Tensor.{name}``); "
                      f"a number on a P tensor is counted once. See the module doc.")
    return method


def _mul_(self, other):
    """In place ``x * other`` (``torch.Tensor.mul_``); a P tensor times a number or a B
    tensor stays P (a P other is all-reduced to B first). See the module doc."""
    other = _scalar_or_tensor("mul_", other)
    if _is_number(other):
        return _inplace(self, "mul_", "mul_scalar", (), {"other": other}, lambda s: s.mul_(other))
    return _inplace(self, "mul_", "mul", (other,), {}, lambda s, o: s.mul_(o))


def _div_(self, other, *, rounding_mode=None):
    """In place :func:`_div` (``torch.Tensor.div_``); true division of a P tensor by a
    number or a B tensor stays P."""
    other = _scalar_or_tensor("div_", other)
    if rounding_mode is not None and rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div_ expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found {rounding_mode!r}")
    mode = {} if rounding_mode is None else {"rounding_mode": rounding_mode}
    if _is_number(other):
        op = "div_scalar" if rounding_mode is None else "div_mode_scalar"
        return _inplace(self, "div_", op, (), {"other": other, **mode},
                        lambda s: s.div_(other, rounding_mode=rounding_mode))
    op = "div" if rounding_mode is None else "div_mode"
    return _inplace(self, "div_", op, (other,), mode,
                    lambda s, o: s.div_(o, rounding_mode=rounding_mode))


def _clamp_(self, min=None, max=None):  # noqa: A002 - torch's argument names
    """In place :func:`_clamp` (``torch.Tensor.clamp_``); raises ValueError on a P tensor
    (clamp is not linear: box it to B or S first)."""
    lo, hi = _bound("clamp_", min), _bound("clamp_", max)
    if lo is None and hi is None:
        raise ValueError("clamp_: at least one of 'min' or 'max' must not be None")
    lo_t, hi_t = isinstance(lo, Tensor), isinstance(hi, Tensor)
    if not lo_t and not hi_t:
        return _inplace(self, "clamp_", "clamp", (), {"lo": lo, "hi": hi},
                        lambda s: s.clamp_(lo, hi))
    if lo_t and hi_t:
        return _inplace(self, "clamp_", "clamp_tensor", (lo, hi), {},
                        lambda s, a, b: s.clamp_(a, b))
    if lo is not None:
        _clamp_min_(self, lo)
    if hi is not None:
        _clamp_max_(self, hi)
    return self


def _clamp_min_(self, min):  # noqa: A002
    """In place ``clamp(min=min)``."""
    if isinstance(min, Tensor):
        return _inplace(self, "clamp_min_", "clamp_min_tensor", (min,), {},
                        lambda s, a: s.clamp_(min=a))
    return _clamp_(self, min=min)


def _clamp_max_(self, max):  # noqa: A002
    """In place ``clamp(max=max)``."""
    if isinstance(max, Tensor):
        return _inplace(self, "clamp_max_", "clamp_max_tensor", (max,), {},
                        lambda s, a: s.clamp_(max=a))
    return _clamp_(self, max=max)


def _masked_fill_(self, mask, value):
    """In place :func:`_masked_fill` (``torch.Tensor.masked_fill_``); on a P tensor a
    nonzero number is filled on the rank at coordinate 0 of each P axis, 0 elsewhere
    (exact: the filled elements sum to ``value``)."""
    mask = _want_tensor("masked_fill_", "mask", mask)
    value = _fill_value("masked_fill_", self, value)
    if _is_number(value) and value != 0 and _has_partial(self):
        value = _global_scalar(self, value, self.dtype)
    if isinstance(value, Tensor):
        return _inplace(self, "masked_fill_", "masked_fill_tensor", (mask, value), {},
                        lambda s, m, v: s.masked_fill_(m, v))
    return _inplace(self, "masked_fill_", "masked_fill", (mask,), {"value": value},
                    lambda s, m: s.masked_fill_(m, value))


def _fill_(self, value):
    """``torch.Tensor.fill_`` with a number or a 0-d tensor. A P tensor holds ``value`` on
    the rank at coordinate 0 of each P axis and zeros elsewhere (``sbpflow.full``'s P
    layout); S and B shards are filled with no communication."""
    value = _fill_value("fill_", self, value)
    if _is_number(value) and value != 0 and _has_partial(self):
        value = _global_scalar(self, value, self.dtype)
    if isinstance(value, Tensor):
        return _inplace(self, "fill_", "fill", (value,), {}, lambda s, v: s.fill_(v))
    return _inplace(self, "fill_", "fill_scalar", (), {"value": value}, lambda s: s.fill_(value))


def _zero_(self):
    """``torch.Tensor.zero_`` (every layout, no communication)."""
    return _inplace(self, "zero_", "fill_scalar", (), {"value": 0}, lambda s: s.zero_())


def _copy_(self, src, non_blocking: bool = False):
    """``torch.Tensor.copy_``: copy ``src`` (broadcasting to ``x``, cast to ``x``'s dtype)
    into ``x``; for a global ``x`` the source is boxed to ``x``'s layout (from another
    placement too, when the shapes are equal). Differentiable w.r.t. ``src``."""
    src = _want_tensor("copy_", "src", src)
    if self.is_global and src.is_global:
        if src.placement != self.placement:
            if tuple(src.shape) != tuple(self.shape):
                raise ValueError(f"copy_: src on {src.placement!r} with shape "
                                 f"{tuple(src.shape)} into x on {self.placement!r} with shape "
                                 f"{tuple(self.shape)}: across placements the shapes must match")
            src = src.to_global(self.placement, self.sbp)
        if _has_partial(self) and not _keeps_partial(src.dtype, self.dtype):
            src = src.to_global(sbp=tuple(B if s.is_partial() else s for s in src.sbp))
    return _inplace(self, "copy_", "copy_from", (src,), {},
                    lambda s, o: s.copy_(o, non_blocking=non_blocking))


def _inplace_binary(op: str, method_name: str):
    """In-place ``torch.Tensor.<method_name>`` of binary op ``op`` (``op_scalar`` with a
    number); with a dunder name, unsupported operands give NotImplemented."""
    torch_name = method_name if not method_name.startswith("__") else {
        "__ifloordiv__": "floor_divide_", "__imod__": "remainder_", "__ipow__": "pow_",
        "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
    }[method_name]

    def method(self, other):
        if _is_number(other):
            return _inplace(self, torch_name, f"{op}_scalar", (), {"other": other},
                            lambda s: getattr(s, torch_name)(other))
        if isinstance(other, Tensor):
            return _inplace(self, torch_name, op, (other,), {},
                            lambda s, o: getattr(s, torch_name)(o))
        if method_name.startswith("__"):
            return NotImplemented
        raise TypeError(f"{torch_name}: other must be an sbpflow.Tensor or a number, got "
                        f"{type(other).__name__}")

    method.__name__ = method_name
    method.__doc__ = f"In place ``torch.Tensor.{torch_name}`` (rules of op ``{op}``)."
    return method


def _inplace_operator(fn):
    def method(self, other):
        if isinstance(other, Tensor) or _is_number(other):
            return fn(self, other)
        return NotImplemented

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


def _inplace_unary(name: str):
    def method(self):
        return _inplace(self, f"{name}_", name, (), {}, lambda s: getattr(s, f"{name}_")())

    method.__name__ = f"{name}_"
    method.__doc__ = f"In place ``torch.Tensor.{name}_`` (rules of op ``{name}``)."
    return method


_add_ = _add_sub_("add")
_sub_ = _add_sub_("sub")
_UNARY_INPLACE = sorted(n for n in ("neg", *UNARY) if hasattr(torch.Tensor, f"{n}_"))

# Tensor methods contributed by this module (installed by sbpflow.ops._methods.install).
METHODS: dict = {
    # operators
    "__and__": _binary("bitwise_and", "bitwise_and_scalar", "__and__"),
    "__floordiv__": _binary("floor_divide", "floor_divide_scalar", "__floordiv__"),
    "__iadd__": _inplace_operator(_add_),
    "__iand__": _inplace_binary("bitwise_and", "__iand__"),
    "__ifloordiv__": _inplace_binary("floor_divide", "__ifloordiv__"),
    "__imod__": _inplace_binary("remainder", "__imod__"),
    "__imul__": _inplace_operator(_mul_),
    "__invert__": lambda self: apply("bitwise_not", self),
    "__ior__": _inplace_binary("bitwise_or", "__ior__"),
    "__ipow__": _inplace_binary("pow", "__ipow__"),
    "__isub__": _inplace_operator(_sub_),
    "__itruediv__": _inplace_operator(_div_),
    "__ixor__": _inplace_binary("bitwise_xor", "__ixor__"),
    "__mod__": _binary("remainder", "remainder_scalar", "__mod__"),
    "__or__": _binary("bitwise_or", "bitwise_or_scalar", "__or__"),
    "__rand__": _binary("bitwise_and", "bitwise_and_scalar", "__rand__", "bitwise_and_scalar"),
    "__rfloordiv__": _binary("floor_divide", "", "__rfloordiv__", "rfloor_divide_scalar"),
    "__rmod__": _binary("remainder", "", "__rmod__", "rremainder_scalar"),
    "__ror__": _binary("bitwise_or", "bitwise_or_scalar", "__ror__", "bitwise_or_scalar"),
    "__rpow__": _binary("pow", "", "__rpow__", "rpow_scalar"),
    "__rtruediv__": _binary("div", "", "__rtruediv__", "rdiv_scalar"),
    "__rxor__": _binary("bitwise_xor", "bitwise_xor_scalar", "__rxor__", "bitwise_xor_scalar"),
    "__xor__": _binary("bitwise_xor", "bitwise_xor_scalar", "__xor__"),
    # pointwise
    "addcdiv": _addc("addcdiv"),
    "addcmul": _addc("addcmul"),
    "bitwise_and": _binary("bitwise_and", "bitwise_and_scalar", "bitwise_and"),
    "bitwise_not": lambda self: apply("bitwise_not", self),
    "bitwise_or": _binary("bitwise_or", "bitwise_or_scalar", "bitwise_or"),
    "bitwise_xor": _binary("bitwise_xor", "bitwise_xor_scalar", "bitwise_xor"),
    "clamp": _clamp,
    "clamp_max": lambda self, max: _clamp(self, max=max),  # noqa: A006
    "clamp_min": lambda self, min: _clamp(self, min=min),  # noqa: A006
    "clip": _clamp,
    "div": _div,
    "divide": _div,
    "floor_divide": _binary("floor_divide", "floor_divide_scalar", "floor_divide"),
    "fmod": _binary("fmod", "fmod_scalar", "fmod"),
    "lerp": _lerp,
    "logical_xor": lambda self, other: apply("logical_xor", self,
                                             _want_tensor("logical_xor", "other", other)),
    "masked_fill": _masked_fill,
    "remainder": _binary("remainder", "remainder_scalar", "remainder"),
    "true_divide": _div,
    "where": lambda self, condition, other: where(condition, self, other),
    # casts
    "bfloat16": _caster("bfloat16", torch.bfloat16),
    "bool": _caster("bool", torch.bool),
    "double": _caster("double", torch.float64),
    "float": _caster("float", torch.float32),
    "half": _caster("half", torch.float16),
    "int": _caster("int", torch.int32),
    "long": _caster("long", torch.int64),
    "to": _to,
    "type": _type,
    "type_as": _type_as,
    # in place
    "add_": _add_,
    "bitwise_and_": _inplace_binary("bitwise_and", "bitwise_and_"),
    "bitwise_or_": _inplace_binary("bitwise_or", "bitwise_or_"),
    "bitwise_xor_": _inplace_binary("bitwise_xor", "bitwise_xor_"),
    "clamp_": _clamp_,
    "clamp_max_": _clamp_max_,
    "clamp_min_": _clamp_min_,
    "clip_": _clamp_,
    "copy_": _copy_,
    "div_": _div_,
    "fill_": _fill_,
    "floor_divide_": _inplace_binary("floor_divide", "floor_divide_"),
    "fmod_": _inplace_binary("fmod", "fmod_"),
    "masked_fill_": _masked_fill_,
    "mul_": _mul_,
    "pow_": _inplace_binary("pow", "pow_"),
    "remainder_": _inplace_binary("remainder", "remainder_"),
    "sub_": _sub_,
    "zero_": _zero_,
    **{f"{n}_": _inplace_unary(n) for n in _UNARY_INPLACE},
}
