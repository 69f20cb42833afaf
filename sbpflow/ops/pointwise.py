"""Pointwise ops: arithmetic, comparisons, torch's unary and binary math functions,
``where``, ``clamp``, ``lerp``, ``addcmul``/``addcdiv``, ``masked_fill``, ``fill_``/
``copy_``, ``isclose``, and their in-place forms.

Every op is registered with the splits that :func:`sbpflow.ops.rules.elementwise` derives
from broadcasting, plus the partial-sum (P) signatures that are *exact* for it (one mesh
axis; ``(in_0, ..., out)``). An op without a P signature boxes a P input away (the
chooser picks the cheapest: reduce-scatter to S or all-reduce to B). Ops with a Python
number operand are separate entries (``add_scalar``...) because their P rules differ:
``P * c`` is exact, ``P + c`` is not.

=========================================== ===========================================
op                                          exact P signatures
=========================================== ===========================================
add, sub, neg, ``x * c``, ``x / c``,         (P, P) -> P, (P) -> P
deg2rad, rad2deg
mul(x, y)                                   (P, B), (B, P) -> P
div(x, y)                                   (P, B) -> P
clamp, pow, ``c ** x``, ``c / x``, div with   none (not linear)
rounding_mode, floor_divide, remainder,
fmod, bitwise_*, logical_xor, math functions
(exp, expm1, atan2, hypot, xlogy, logit ...)
masked_fill(x, mask, value: number)         (P, B) -> P when value == 0
masked_fill(x, mask, value: 0-d tensor)     (P, B, P) -> P  (linear in (x, value))
lerp(a, b, weight: number)                  (P, P) -> P     ((1 - w) a + w b)
lerp(a, b, weight: tensor)                  (P, P, B) -> P
where(c, x, y)                              (B, P, P) -> P
where(c, x, 0), where(c, 0, y)              (B, P) -> P
addcmul(x, t1, t2)                          (P, P, B), (P, B, P) -> P
addcdiv(x, t1, t2)                          (P, P, B) -> P
=========================================== ===========================================

A Python number ``other`` of the math functions becomes a 0-d tensor of
``torch.result_type(x, other)`` (torch's scalar promotion), so ``x.atan2(2.0)`` and
``x.heaviside(0.5)`` work like their tensor forms.

**In-place ops** (``add_``, ``mul_``, ``clamp_``, ``masked_fill_``, ``fill_``, ``copy_``,
``+=`` ...) run through :func:`sbpflow.ops.dispatch.dispatch_inplace`. A local tensor:
torch's in-place op on the wrapped tensor. A global tensor keeps its SBP and its local
shard: the other inputs are boxed to the cheapest signature of the op's rule whose first
input and output are the tensor's own layout, then torch's in-place op runs on the shard.
So autograd is torch's: in-place on a leaf that requires grad raises torch's RuntimeError
(outside :func:`sbpflow.no_grad`), in-place on a non-leaf is differentiated through,
version counters apply. The other inputs may need a collective (``x.mul_(y)`` with x and
y both P all-reduces y to B; ``x.add_(y)`` with x P and y B makes y's P summands
locally). Where no signature keeps the layout (``clamp_``, ``exp_``, ``relu_`` ... of a P
tensor: not linear) the logical value is computed out of place and written back into the
tensor's own layout (for P: the rank at coordinate 0 of each P axis holds it, the others
zeros), so ``s = x.sum(); s.clamp_(max=2)`` reads at most 2, as in torch. A number added
to, filled into or masked into a P tensor is added once, not once per rank: it becomes a
B 0-d tensor boxed to P. ``fill_(v)`` of a P tensor therefore leaves ``v`` on that rank
and zeros elsewhere (the same layout as ``sbpflow.full(..., sbp=P)``); ``zero_`` zeros
every rank.
"""

from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .api import function, method
from .args import is_number, want_tensor
from .cast import keeps_partial
from .creation import full
from .dispatch import coerce_operand, dispatch, dispatch_inplace
from .registry import register
from .rules import elementwise

S, B, P = Split, broadcast, partial_sum


def _pointwise(*partial, when=None):
    """Elementwise splits plus the P signatures ``partial`` (only where ``when(attrs)``)."""
    base = elementwise()

    def rule(metas, attrs):
        sigs = base(metas, attrs)
        if partial and (when is None or when(attrs)):
            sigs += [tuple(s) for s in partial]
        return sigs

    return rule


# --------------------------------------------------------------- arithmetic
# --------------------------------------------------------------- elementwise, tensor x tensor
register("add", elementwise("sum"))(torch.add)
register("sub", elementwise("sum"))(torch.sub)
register("mul", elementwise("one"))(torch.mul)
register("div", elementwise("first"))(torch.div)
# --------------------------------------------------------------- elementwise, tensor x scalar
register("add_scalar", elementwise())(lambda a, *, other: torch.add(a, other))
register("sub_scalar", elementwise())(lambda a, *, other: torch.sub(a, other))
register("rsub_scalar", elementwise())(lambda a, *, other: torch.sub(other, a))
register("mul_scalar", elementwise("sum"))(lambda a, *, other: torch.mul(a, other))
register("div_scalar", elementwise("sum"))(lambda a, *, other: torch.div(a, other))
# --------------------------------------------------------------- unary
# name -> torch function; all elementwise, none linear except neg (listed first).
register("neg", elementwise("sum"))(torch.neg)


UNARY = {
    "abs": torch.abs, "ceil": torch.ceil, "cos": torch.cos, "erf": torch.erf,
    "exp": torch.exp, "floor": torch.floor, "gelu": torch.nn.functional.gelu,
    "isinf": torch.isinf, "isnan": torch.isnan, "log": torch.log, "log1p": torch.log1p,
    "logical_not": torch.logical_not, "reciprocal": torch.reciprocal, "relu": torch.relu,
    "round": torch.round, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "sign": torch.sign,
    "silu": torch.nn.functional.silu, "sin": torch.sin, "softplus": torch.nn.functional.softplus,
    "sqrt": torch.sqrt, "square": torch.square, "tanh": torch.tanh,
}


for _name, _fn in sorted(UNARY.items()):
    register(_name, elementwise())(_fn)


# --------------------------------------------------------------- binary, no exact P rule
BINARY = {
    "eq": torch.eq, "ge": torch.ge, "gt": torch.gt, "le": torch.le, "logical_and":
    torch.logical_and, "logical_or": torch.logical_or, "lt": torch.lt, "maximum": torch.maximum,
    "minimum": torch.minimum, "ne": torch.ne, "pow": torch.pow,
}


# torch takes a Python number as ``other`` for these (not for logical_and/or, maximum,
# minimum: those raise a TypeError naming the fix, as torch's do)
_SCALAR_OK = ("eq", "ge", "gt", "le", "lt", "ne", "pow")
for _name, _fn in sorted(BINARY.items()):
    register(_name, elementwise())(_fn)
    if _name in _SCALAR_OK:
        register(f"{_name}_scalar", elementwise())(lambda a, *, other, _fn=_fn: _fn(a, other))




# --------------------------------------------------------------- more pointwise (sorted)
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


# --------------------------------------------------------------- math functions
# --------------------------------------------------------------- unary
UNARY_MORE = {
    "acos": torch.acos, "acosh": torch.acosh, "asin": torch.asin, "asinh": torch.asinh,
    "atan": torch.atan, "atanh": torch.atanh, "cosh": torch.cosh, "digamma": torch.digamma,
    "erfc": torch.erfc, "erfinv": torch.erfinv, "exp2": torch.exp2, "expm1": torch.expm1,
    "fix": torch.fix, "frac": torch.frac, "i0": torch.i0, "lgamma": torch.lgamma,
    "log10": torch.log10, "log2": torch.log2, "sgn": torch.sgn, "sinc": torch.sinc,
    "sinh": torch.sinh, "tan": torch.tan, "trunc": torch.trunc,
}
LINEAR_UNARY = {"deg2rad": torch.deg2rad, "rad2deg": torch.rad2deg}  # x * constant
ALIASES = {"arccos": "acos", "arccosh": "acosh", "arcsin": "asin", "arcsinh": "asinh",
           "arctan": "atan", "arctanh": "atanh"}
for _name, _fn in sorted(UNARY_MORE.items()):
    register(_name, elementwise())(_fn)
for _name, _fn in sorted(LINEAR_UNARY.items()):
    register(_name, elementwise("sum"))(_fn)
register("logit", elementwise())(lambda a, *, eps: torch.logit(a, eps))
register("nan_to_num", elementwise())(
    lambda a, *, nan, posinf, neginf: torch.nan_to_num(a, nan, posinf, neginf))


# --------------------------------------------------------------- binary
BINARY_MORE = {
    "atan2": torch.atan2, "copysign": torch.copysign, "float_power": torch.float_power,
    "heaviside": torch.heaviside, "hypot": torch.hypot, "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2, "nextafter": torch.nextafter, "xlogy": torch.xlogy,
}


def _scalar_tensor(a: torch.Tensor, other) -> torch.Tensor:
    """The Python number ``other`` as a 0-d tensor of torch's promoted type with ``a``."""
    return torch.full((), other, dtype=torch.result_type(a, other), device=a.device)


for _name, _fn in sorted(BINARY_MORE.items()):
    register(_name, elementwise())(_fn)
    register(f"{_name}_scalar", elementwise())(
        lambda a, *, other, _fn=_fn: _fn(a, _scalar_tensor(a, other)))


# number <op> tensor (torch.xlogy(2.0, x), torch.float_power(2, x))
register("rxlogy_scalar", elementwise())(lambda a, *, other: torch.xlogy(other, a))
register("rfloat_power_scalar", elementwise())(lambda a, *, other: torch.float_power(other, a))


register("isclose", elementwise())(
    lambda a, b, *, rtol, atol, equal_nan: torch.isclose(a, b, rtol, atol, equal_nan))


# --------------------------------------------------------------- argument helpers


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
    if is_number(value):
        return value
    raise TypeError(f"{name}: value must be a number or a 0-d tensor, got {type(value).__name__}")


def _has_partial(x: Tensor) -> bool:
    return x.is_global and any(s.is_partial() for s in x.sbp)


def _global_scalar(x: Tensor, value, dtype: torch.dtype) -> Tensor:
    """``value`` as a B 0-d global tensor on ``x``'s placement (boxed to P by the in-place
    ops of a P tensor, so that it is counted once)."""
    return full((), value, dtype=dtype, placement=x.placement, sbp=(B,) * x.placement.ndim)


# --------------------------------------------------------------- out-of-place methods


# --------------------------------------------------------------- out-of-place methods
def _binary(op: str, scalar_op: str, name: str, reflected_op: str | None = None):
    """``x.name(other)``: op ``op`` with a tensor, ``scalar_op`` (``other=``) with a number;
    ``reflected_op`` makes the reflected operator (``number <op> x``)."""

    def method(self, other):
        other = coerce_operand(self, other)
        if reflected_op is not None:
            if is_number(other):
                return dispatch(reflected_op, self, other=other)
            if isinstance(other, Tensor):  # an array operand, made a tensor above
                return dispatch(op, other, self)
            return NotImplemented
        if isinstance(other, Tensor):
            return dispatch(op, self, other)
        if is_number(other):
            if not scalar_op:
                raise TypeError(f"{name}: other must be a tensor (torch.{op} takes no number); "
                                f"make one, e.g. sbpflow.full_like(x, {other!r})")
            return dispatch(scalar_op, self, other=other)
        if name.startswith("__"):
            return NotImplemented
        raise TypeError(f"{name}: other must be an sbpflow.Tensor or a number, got "
                        f"{type(other).__name__}")

    method.__name__ = name
    method.__doc__ = (f"``torch.Tensor.{name}`` elementwise with broadcasting (ops "
                      f"``{op}``/``{scalar_op}``; no exact P rule: a P input is boxed).")
    return method


def _unary(name: str):
    def method(self):
        return dispatch(name, self)

    method.__name__ = name
    method.__doc__ = f"Elementwise ``{name}`` (op registry: ``{name}``)."
    return method


def _div(self, other, *, rounding_mode=None):
    """``torch.div(x, other, rounding_mode=None)``: true division, or rounded with
    ``rounding_mode`` ``'trunc'`` / ``'floor'`` (integer inputs stay integer).

    SBP: ``P / B`` and ``P / number`` stay P for true division; rounded division has no
    P rule. Raises ValueError for another rounding mode, TypeError for another ``other``.
    """
    if rounding_mode is None:
        if isinstance(other, Tensor):
            return dispatch("div", self, other)
        if is_number(other):
            return dispatch("div_scalar", self, other=other)
    elif rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found {rounding_mode!r}")
    elif isinstance(other, Tensor):
        return dispatch("div_mode", self, other, rounding_mode=rounding_mode)
    elif is_number(other):
        return dispatch("div_mode_scalar", self, other=other, rounding_mode=rounding_mode)
    raise TypeError(f"div: other must be an sbpflow.Tensor or a number, got "
                    f"{type(other).__name__}")


def _bound(name: str, v):
    if v is None or is_number(v) or isinstance(v, Tensor):
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
        return dispatch("clamp", self, lo=lo, hi=hi)
    if lo_t and hi_t:
        return dispatch("clamp_tensor", self, lo, hi)
    out = self
    if lo is not None:
        out = (dispatch("clamp_min_tensor", out, lo) if lo_t
               else dispatch("clamp", out, lo=lo, hi=None))
    if hi is not None:
        out = (dispatch("clamp_max_tensor", out, hi) if hi_t
               else dispatch("clamp", out, lo=None, hi=hi))
    return out


def _masked_fill(self, mask, value):
    """``torch.Tensor.masked_fill``: ``value`` (a number or a 0-d tensor) where the bool
    ``mask`` (broadcasting to ``x``) is True.

    SBP: ``(P, B) -> P`` when ``value == 0``; with a 0-d tensor value ``(P, B, P) -> P``.
    """
    mask = want_tensor("masked_fill", "mask", mask)
    value = _fill_value("masked_fill", self, value)
    if isinstance(value, Tensor):
        return dispatch("masked_fill_tensor", self, mask, value)
    return dispatch("masked_fill", self, mask, value=value)


def _lerp(self, end, weight):
    """``torch.lerp``: ``x + weight * (end - x)``; ``weight`` a number or a tensor.

    SBP: ``(P, P) -> P`` with a number weight, ``(P, P, B) -> P`` with a tensor weight.
    """
    end = want_tensor("lerp", "end", end)
    if isinstance(weight, Tensor):
        return dispatch("lerp_tensor", self, end, weight)
    if is_number(weight):
        return dispatch("lerp", self, end, weight=weight)
    raise TypeError(f"lerp: weight must be a number or an sbpflow.Tensor, got "
                    f"{type(weight).__name__}")


def _addc(kind: str):
    def method(self, tensor1, tensor2, *, value=1):
        t1 = want_tensor(kind, "tensor1", tensor1)
        t2 = want_tensor(kind, "tensor2", tensor2)
        return dispatch(kind, self, t1, t2, value=value)

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
    cond = want_tensor("where", "condition", condition)
    for what, v in (("input", input), ("other", other)):
        if not (isinstance(v, Tensor) or is_number(v)):
            raise TypeError(f"where: {what} must be an sbpflow.Tensor or a number, got "
                            f"{type(v).__name__}")
    it, ot = isinstance(input, Tensor), isinstance(other, Tensor)
    if it and ot:
        return dispatch("where_tensor", cond, input, other)
    if it:
        return dispatch("where_other_scalar", cond, input, other=other)
    if ot:
        return dispatch("where_input_scalar", cond, other, input=input)
    return dispatch("where_scalars", cond, input=input, other=other)


def _logit(self, eps=None):
    """``torch.logit``: ``log(p / (1 - p))``, ``p`` clamped to ``[eps, 1 - eps]`` when
    ``eps`` is given (no gradient outside it, as torch). No P rule."""
    return dispatch("logit", self, eps=eps)


def _nan_to_num(self, nan=0.0, posinf=None, neginf=None):
    """``torch.nan_to_num``: NaN -> ``nan``, +inf -> ``posinf`` (default: the dtype's
    largest finite value), -inf -> ``neginf`` (its lowest). No P rule."""
    return dispatch("nan_to_num", self, nan=nan, posinf=posinf, neginf=neginf)


def _reflected(name: str, input, other):  # noqa: A002 - torch's argument name
    if is_number(input) and isinstance(other, Tensor):
        return dispatch(f"r{name}_scalar", other, other=input)
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: input must be an sbpflow.Tensor or a number, got "
                        f"{type(input).__name__}")
    return getattr(input, name)(other)


def xlogy(input, other):  # noqa: A002
    """``torch.xlogy``: ``input * log(other)``, 0 where ``input == 0`` (NaN where ``other``
    is NaN). ``input`` or ``other`` may be a Python number. No P rule (a P ``input`` with
    summands that are not 0 where the sum is would not give the 0)."""
    return _reflected("xlogy", input, other)


def float_power(input, exponent):  # noqa: A002
    """``torch.float_power``: ``input ** exponent`` in float64 (complex128 for complex
    inputs); either may be a Python number. No P rule."""
    return _reflected("float_power", input, exponent)


def _isfinite(self):
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        return self == self  # integers are finite
    return (self.isinf() | self.isnan()).logical_not()


def _isclose(self, other, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False):
    return dispatch("isclose", self, other, rtol=rtol, atol=atol, equal_nan=equal_nan)


def allclose(input, other, rtol: float = 1e-5, atol: float = 1e-8,  # noqa: A002
             equal_nan: bool = False) -> bool:
    """``torch.allclose`` (collective for global tensors: every rank gets the answer)."""
    return bool(_isclose(input, other, rtol, atol, equal_nan).all().item())


def equal(input, other) -> bool:  # noqa: A002
    """``torch.equal``: same shape and elements (collective for global tensors)."""
    want_tensor("equal", "other", other)
    return tuple(input.shape) == tuple(other.shape) and bool((input == other).all().item())


# --------------------------------------------------------------- in-place methods


# --------------------------------------------------------------- in-place methods
def _scalar_or_tensor(name: str, other):
    if isinstance(other, Tensor) or is_number(other):
        return other
    raise TypeError(f"{name}: other must be an sbpflow.Tensor or a number, got "
                    f"{type(other).__name__}")


def _add_sub_(kind: str):
    name = f"{kind}_"

    def method(self, other, *, alpha=1):
        other = _scalar_or_tensor(name, other)
        if is_number(other) and _has_partial(self):
            other = _global_scalar(self, other, torch.result_type(self._local, other))
        if is_number(other):
            return dispatch_inplace(self, name, f"{kind}_scalar", (), {"other": other},
                                    lambda s: getattr(s, name)(other, alpha=alpha))
        return dispatch_inplace(self, name, kind, (other,), {},
                                lambda s, o: getattr(s, name)(o, alpha=alpha))

    method.__name__ = name
    method.__doc__ = (f"In place ``x.{kind}(other, alpha=alpha)`` (``torch.Tensor.{name}``); "
                      f"a number on a P tensor is counted once. See the module doc.")
    return method


def _mul_(self, other):
    """In place ``x * other`` (``torch.Tensor.mul_``); a P tensor times a number or a B
    tensor stays P (a P other is all-reduced to B first). See the module doc."""
    other = _scalar_or_tensor("mul_", other)
    if is_number(other):
        return dispatch_inplace(self, "mul_", "mul_scalar", (), {"other": other},
                                lambda s: s.mul_(other))
    return dispatch_inplace(self, "mul_", "mul", (other,), {}, lambda s, o: s.mul_(o))


def _div_(self, other, *, rounding_mode=None):
    """In place :func:`_div` (``torch.Tensor.div_``); true division of a P tensor by a
    number or a B tensor stays P."""
    other = _scalar_or_tensor("div_", other)
    if rounding_mode is not None and rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div_ expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found {rounding_mode!r}")
    mode = {} if rounding_mode is None else {"rounding_mode": rounding_mode}
    if is_number(other):
        op = "div_scalar" if rounding_mode is None else "div_mode_scalar"
        return dispatch_inplace(self, "div_", op, (), {"other": other, **mode},
                                lambda s: s.div_(other, rounding_mode=rounding_mode))
    op = "div" if rounding_mode is None else "div_mode"
    return dispatch_inplace(self, "div_", op, (other,), mode,
                            lambda s, o: s.div_(o, rounding_mode=rounding_mode))


def _clamp_(self, min=None, max=None):  # noqa: A002 - torch's argument names
    """In place :func:`_clamp` (``torch.Tensor.clamp_``). On a P tensor (clamp is not
    linear) the clamped value is computed (an all-reduce) and written back as P."""
    lo, hi = _bound("clamp_", min), _bound("clamp_", max)
    if lo is None and hi is None:
        raise ValueError("clamp_: at least one of 'min' or 'max' must not be None")
    lo_t, hi_t = isinstance(lo, Tensor), isinstance(hi, Tensor)
    if not lo_t and not hi_t:
        return dispatch_inplace(self, "clamp_", "clamp", (), {"lo": lo, "hi": hi},
                                lambda s: s.clamp_(lo, hi))
    if lo_t and hi_t:
        return dispatch_inplace(self, "clamp_", "clamp_tensor", (lo, hi), {},
                                lambda s, a, b: s.clamp_(a, b))
    if lo is not None:
        _clamp_min_(self, lo)
    if hi is not None:
        _clamp_max_(self, hi)
    return self


def _clamp_min_(self, min):  # noqa: A002
    """In place ``clamp(min=min)``."""
    if isinstance(min, Tensor):
        return dispatch_inplace(self, "clamp_min_", "clamp_min_tensor", (min,), {},
                                lambda s, a: s.clamp_(min=a))
    return _clamp_(self, min=min)


def _clamp_max_(self, max):  # noqa: A002
    """In place ``clamp(max=max)``."""
    if isinstance(max, Tensor):
        return dispatch_inplace(self, "clamp_max_", "clamp_max_tensor", (max,), {},
                                lambda s, a: s.clamp_(max=a))
    return _clamp_(self, max=max)


def _masked_fill_(self, mask, value):
    """In place :func:`_masked_fill` (``torch.Tensor.masked_fill_``); on a P tensor a
    nonzero number is filled on the rank at coordinate 0 of each P axis, 0 elsewhere
    (exact: the filled elements sum to ``value``)."""
    mask = want_tensor("masked_fill_", "mask", mask)
    value = _fill_value("masked_fill_", self, value)
    if is_number(value) and value != 0 and _has_partial(self):
        value = _global_scalar(self, value, self.dtype)
    if isinstance(value, Tensor):
        return dispatch_inplace(self, "masked_fill_", "masked_fill_tensor", (mask, value), {},
                                lambda s, m, v: s.masked_fill_(m, v))
    return dispatch_inplace(self, "masked_fill_", "masked_fill", (mask,), {"value": value},
                            lambda s, m: s.masked_fill_(m, value))


def _fill_(self, value):
    """``torch.Tensor.fill_`` with a number or a 0-d tensor. A P tensor holds ``value`` on
    the rank at coordinate 0 of each P axis and zeros elsewhere (``sbpflow.full``'s P
    layout); S and B shards are filled with no communication."""
    value = _fill_value("fill_", self, value)
    if is_number(value) and value != 0 and _has_partial(self):
        value = _global_scalar(self, value, self.dtype)
    if isinstance(value, Tensor):
        return dispatch_inplace(self, "fill_", "fill", (value,), {}, lambda s, v: s.fill_(v))
    return dispatch_inplace(self, "fill_", "fill_scalar", (), {"value": value},
                            lambda s: s.fill_(value))


def _zero_(self):
    """``torch.Tensor.zero_`` (every layout, no communication)."""
    return dispatch_inplace(self, "zero_", "fill_scalar", (), {"value": 0}, lambda s: s.zero_())


def _copy_(self, src, non_blocking: bool = False):
    """``torch.Tensor.copy_``: copy ``src`` (broadcasting to ``x``, cast to ``x``'s dtype)
    into ``x``; for a global ``x`` the source is boxed to ``x``'s layout (from another
    placement too, when the shapes are equal). Differentiable w.r.t. ``src``."""
    src = want_tensor("copy_", "src", src)
    if self.is_global and src.is_global:
        if src.placement != self.placement:
            if tuple(src.shape) != tuple(self.shape):
                raise ValueError(f"copy_: src on {src.placement!r} with shape "
                                 f"{tuple(src.shape)} into x on {self.placement!r} with shape "
                                 f"{tuple(self.shape)}: across placements the shapes must match")
            src = src.to_global(self.placement, self.sbp)
        if _has_partial(self) and not keeps_partial(src.dtype, self.dtype):
            src = src.to_global(sbp=tuple(B if s.is_partial() else s for s in src.sbp))
    return dispatch_inplace(self, "copy_", "copy_from", (src,), {},
                            lambda s, o: s.copy_(o, non_blocking=non_blocking))


def _inplace_binary(op: str, method_name: str):
    """In-place ``torch.Tensor.<method_name>`` of binary op ``op`` (``op_scalar`` with a
    number); with a dunder name, unsupported operands give NotImplemented."""
    torch_name = method_name if not method_name.startswith("__") else {
        "__ifloordiv__": "floor_divide_", "__imod__": "remainder_", "__ipow__": "pow_",
        "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_",
    }[method_name]

    def method(self, other):
        if is_number(other):
            return dispatch_inplace(self, torch_name, f"{op}_scalar", (), {"other": other},
                                    lambda s: getattr(s, torch_name)(other))
        if isinstance(other, Tensor):
            return dispatch_inplace(self, torch_name, op, (other,), {},
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
        if isinstance(other, Tensor) or is_number(other):
            return fn(self, other)
        return NotImplemented

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


def _inplace_unary(name: str):
    def method(self):
        return dispatch_inplace(self, f"{name}_", name, (), {}, lambda s: getattr(s, f"{name}_")())

    method.__name__ = f"{name}_"
    method.__doc__ = f"In place ``torch.Tensor.{name}_`` (rules of op ``{name}``)."
    return method


_add_ = _add_sub_("add")


_sub_ = _add_sub_("sub")


_UNARY_INPLACE = sorted(n for n in ("neg", *UNARY) if hasattr(torch.Tensor, f"{n}_"))


def _logit_(self, eps=None):
    """In place :func:`_logit` (``torch.Tensor.logit_``)."""
    return dispatch_inplace(self, "logit_", "logit", (), {"eps": eps}, lambda s: s.logit_(eps))


def _nan_to_num_(self, nan=0.0, posinf=None, neginf=None):
    """In place :func:`_nan_to_num` (``torch.Tensor.nan_to_num_``)."""
    return dispatch_inplace(self, "nan_to_num_", "nan_to_num",
                            (), {"nan": nan, "posinf": posinf, "neginf": neginf},
                            lambda s: s.nan_to_num_(nan, posinf, neginf))


# ---------------------------------------------------------------- Tensor methods and functions
def _with_alpha(name: str, plain):
    """``x.add(other, alpha=a)`` / ``x.sub(...)``: ``x +- a * other`` in one kernel, as
    torch's (``alpha`` 1: the plain op). SBP as the plain op's (``(P, P) -> P``)."""

    def call(self, other, *, alpha=1):
        if alpha == 1:
            return plain(self, other)
        if is_number(other):
            return plain(self, other * alpha)
        return dispatch(f"{name}_alpha", self, want_tensor(name, "other", other), alpha=alpha)

    call.__name__ = name
    call.__doc__ = plain.__doc__
    return call


register("add_alpha", elementwise("sum"))(lambda a, b, *, alpha: torch.add(a, b, alpha=alpha))
register("sub_alpha", elementwise("sum"))(lambda a, b, *, alpha: torch.sub(a, b, alpha=alpha))
for _name in ("add", "sub"):
    method(_name)(_with_alpha(_name, _binary(_name, f"{_name}_scalar", _name)))
    method(f"__{_name}__")(_binary(_name, f"{_name}_scalar", f"__{_name}__"))
for _name in ("mul",):
    method(_name, f"__{_name}__")(_binary(_name, f"{_name}_scalar", _name))
method("__radd__")(_binary("add", "add_scalar", "__radd__", "add_scalar"))
method("__rsub__")(_binary("sub", "", "__rsub__", "rsub_scalar"))
method("__rmul__")(_binary("mul", "mul_scalar", "__rmul__", "mul_scalar"))
method("__truediv__")(_binary("div", "div_scalar", "__truediv__"))
method("__rtruediv__")(_binary("div", "", "__rtruediv__", "rdiv_scalar"))
method("div", "divide", "true_divide")(_div)
method("__pow__")(_binary("pow", "pow_scalar", "__pow__"))
method("__rpow__")(_binary("pow", "", "__rpow__", "rpow_scalar"))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    method(f"__{_name}__")(_binary(_name, f"{_name}_scalar", f"__{_name}__"))
for _name in sorted(BINARY):  # eq ... pow, logical_and/or, maximum/minimum
    method(_name)(_binary(_name, f"{_name}_scalar" if _name in _SCALAR_OK else "", _name))
method("neg", "__neg__")(_unary("neg"))
method("__abs__")(_unary("abs"))
for _name in sorted(UNARY):
    if _name not in ("gelu", "silu", "softplus"):  # nn.functional's, not Tensor methods
        method(_name)(_unary(_name))
for _kind, _op in (("and", "bitwise_and"), ("or", "bitwise_or"), ("xor", "bitwise_xor")):
    method(f"__{_kind}__", _op)(_binary(_op, f"{_op}_scalar", f"__{_kind}__"))
    method(f"__r{_kind}__")(_binary(_op, f"{_op}_scalar", f"__r{_kind}__", f"{_op}_scalar"))
    method(f"__i{_kind}__")(_inplace_binary(_op, f"__i{_kind}__"))
    method(f"{_op}_")(_inplace_binary(_op, f"{_op}_"))
method("__invert__", "bitwise_not")(lambda self: dispatch("bitwise_not", self))
method("__floordiv__", "floor_divide")(
    _binary("floor_divide", "floor_divide_scalar", "__floordiv__"))
method("__rfloordiv__")(_binary("floor_divide", "", "__rfloordiv__", "rfloor_divide_scalar"))
method("__mod__", "remainder")(_binary("remainder", "remainder_scalar", "__mod__"))
method("__rmod__")(_binary("remainder", "", "__rmod__", "rremainder_scalar"))
method("fmod")(_binary("fmod", "fmod_scalar", "fmod"))
method("addcdiv")(_addc("addcdiv"))
method("addcmul")(_addc("addcmul"))
method("clamp", "clip")(_clamp)
method("clamp_max")(lambda self, max: _clamp(self, max=max))  # noqa: A006
method("clamp_min")(lambda self, min: _clamp(self, min=min))  # noqa: A006
method("lerp")(_lerp)
method("logical_xor")(lambda self, other: dispatch(
    "logical_xor", self, want_tensor("logical_xor", "other", other)))
method("masked_fill")(_masked_fill)
method("where")(lambda self, condition, other: where(condition, self, other))
function("where")(where)
for _name in sorted({*UNARY_MORE, *LINEAR_UNARY}):
    method(_name)(_unary(_name))
for _alias, _name in sorted(ALIASES.items()):
    method(_alias)(_unary(_name))
    method(f"{_alias}_")(_inplace_unary(_name))
for _name in sorted(BINARY_MORE):
    method(_name)(_binary(_name, f"{_name}_scalar", _name))
    if hasattr(torch.Tensor, f"{_name}_"):
        method(f"{_name}_")(_inplace_binary(_name, f"{_name}_"))
method("arctan2")(_binary("atan2", "atan2_scalar", "arctan2"))
method("arctan2_")(_inplace_binary("atan2", "arctan2_"))
function("xlogy")(xlogy)
function("float_power")(float_power)
method("logit")(_logit)
method("logit_")(_logit_)
method("nan_to_num")(_nan_to_num)
method("nan_to_num_")(_nan_to_num_)
method("isfinite")(_isfinite)
method("isclose")(_isclose)
method("allclose")(allclose)
method("equal")(equal)
function("allclose")(allclose)
function("equal")(equal)
# in place
method("add_")(_add_)
method("sub_")(_sub_)
method("mul_")(_mul_)
method("div_")(_div_)
method("__iadd__")(_inplace_operator(_add_))
method("__isub__")(_inplace_operator(_sub_))
method("__imul__")(_inplace_operator(_mul_))
method("__itruediv__")(_inplace_operator(_div_))
method("__ifloordiv__")(_inplace_binary("floor_divide", "__ifloordiv__"))
method("__imod__")(_inplace_binary("remainder", "__imod__"))
method("__ipow__")(_inplace_binary("pow", "__ipow__"))
method("clamp_", "clip_")(_clamp_)
method("clamp_max_")(_clamp_max_)
method("clamp_min_")(_clamp_min_)
method("copy_")(_copy_)
method("fill_")(_fill_)
method("zero_")(_zero_)
method("masked_fill_")(_masked_fill_)
for _name in ("floor_divide", "fmod", "pow", "remainder"):
    method(f"{_name}_")(_inplace_binary(_name, f"{_name}_"))
for _name in _UNARY_INPLACE:
    method(f"{_name}_")(_inplace_unary(_name))
for _name in sorted({*UNARY_MORE, *LINEAR_UNARY}):
    if hasattr(torch.Tensor, f"{_name}_"):
        method(f"{_name}_")(_inplace_unary(_name))

