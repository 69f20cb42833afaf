"""More elementwise ops: torch's remaining unary and binary math functions and the kernels
of the activations and pointwise losses of :mod:`sbpflow.nn.functional`.

Every op is registered with :func:`sbpflow.ops._rules.elementwise` (splits from
broadcasting) and a torch kernel; only the maps that are linear get a partial-sum rule:

=============================================== ==========================================
op                                              exact P signatures (one mesh axis)
=============================================== ==========================================
deg2rad, rad2deg (``x * c``)                    (P) -> P
expm1, log2, log10, exp2, sinh, cosh, tan,      none: not linear, a P input is boxed
asin, acos, atan, asinh, acosh, atanh, trunc,   (the chooser takes the cheapest of a
fix, frac, sgn, erfc, erfinv, lgamma, digamma,  reduce-scatter to S or an all-reduce to B)
i0, sinc, logit, nan_to_num
atan2, hypot, xlogy, float_power, heaviside,    none
logaddexp, logaddexp2, copysign, nextafter
(tensor or Python-number ``other``)
``nn.*`` activations and pointwise losses       none; ``nn.glu`` keeps splits of every dim
                                                but ``dim`` (a split ``dim`` is re-split);
                                                ``nn.prelu`` splits the channel dim of the
                                                input and the weight together
=============================================== ==========================================

A Python number ``other`` becomes a 0-d tensor of ``torch.result_type(x, other)`` (torch's
scalar promotion), so ``x.atan2(2.0)`` and ``x.heaviside(0.5)`` work like their tensor
forms. In-place forms (``x.expm1_()``, ``x.atan2_(y)``, ``x.logit_(eps)`` ...) use the
in-place machinery of :mod:`sbpflow.ops._misc`: the tensor keeps its layout, a P tensor
raises ValueError except for ``deg2rad_``/``rad2deg_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sbp import SBP, Split
from ..tensor import Tensor
from ._dispatch import apply
from ._methods import _unary
from ._misc import _binary, _inplace, _inplace_binary, _inplace_unary, _is_number
from ._registry import register
from ._rules import elementwise

__all__ = ["float_power", "xlogy"]

# --------------------------------------------------------------- unary
UNARY = {
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

for _name, _fn in sorted(UNARY.items()):
    register(_name, elementwise())(_fn)
for _name, _fn in sorted(LINEAR_UNARY.items()):
    register(_name, elementwise("sum"))(_fn)
register("logit", elementwise())(lambda a, *, eps: torch.logit(a, eps))
register("nan_to_num", elementwise())(
    lambda a, *, nan, posinf, neginf: torch.nan_to_num(a, nan, posinf, neginf))


def _logit(self, eps=None):
    """``torch.logit``: ``log(p / (1 - p))``, ``p`` clamped to ``[eps, 1 - eps]`` when
    ``eps`` is given (no gradient outside it, as torch). No P rule."""
    return apply("logit", self, eps=eps)


def _logit_(self, eps=None):
    """In place :func:`_logit` (``torch.Tensor.logit_``)."""
    return _inplace(self, "logit_", "logit", (), {"eps": eps}, lambda s: s.logit_(eps))


def _nan_to_num(self, nan=0.0, posinf=None, neginf=None):
    """``torch.nan_to_num``: NaN -> ``nan``, +inf -> ``posinf`` (default: the dtype's
    largest finite value), -inf -> ``neginf`` (its lowest). No P rule."""
    return apply("nan_to_num", self, nan=nan, posinf=posinf, neginf=neginf)


def _nan_to_num_(self, nan=0.0, posinf=None, neginf=None):
    """In place :func:`_nan_to_num` (``torch.Tensor.nan_to_num_``)."""
    return _inplace(self, "nan_to_num_", "nan_to_num",
                    (), {"nan": nan, "posinf": posinf, "neginf": neginf},
                    lambda s: s.nan_to_num_(nan, posinf, neginf))


# --------------------------------------------------------------- binary
BINARY = {
    "atan2": torch.atan2, "copysign": torch.copysign, "float_power": torch.float_power,
    "heaviside": torch.heaviside, "hypot": torch.hypot, "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2, "nextafter": torch.nextafter, "xlogy": torch.xlogy,
}


def _number(a: torch.Tensor, other) -> torch.Tensor:
    """The Python number ``other`` as a 0-d tensor of torch's promoted type with ``a``."""
    return torch.full((), other, dtype=torch.result_type(a, other), device=a.device)


for _name, _fn in sorted(BINARY.items()):
    register(_name, elementwise())(_fn)
    register(f"{_name}_scalar", elementwise())(
        lambda a, *, other, _fn=_fn: _fn(a, _number(a, other)))
# number <op> tensor (torch.xlogy(2.0, x), torch.float_power(2, x))
register("rxlogy_scalar", elementwise())(lambda a, *, other: torch.xlogy(other, a))
register("rfloat_power_scalar", elementwise())(lambda a, *, other: torch.float_power(other, a))


def _reflected(name: str, input, other):  # noqa: A002 - torch's argument name
    if _is_number(input) and isinstance(other, Tensor):
        return apply(f"r{name}_scalar", other, other=input)
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


# --------------------------------------------------------------- nn activations
# The kernels of sbpflow.nn.functional's activations (name -> torch function taking the
# attrs as keywords); elementwise, none linear.
ACTIVATIONS = {
    "nn.celu": F.celu, "nn.elu": F.elu, "nn.hardshrink": F.hardshrink,
    "nn.hardsigmoid": F.hardsigmoid, "nn.hardswish": F.hardswish, "nn.hardtanh": F.hardtanh,
    "nn.leaky_relu": F.leaky_relu, "nn.logsigmoid": F.logsigmoid, "nn.mish": F.mish,
    "nn.relu6": F.relu6, "nn.selu": F.selu, "nn.softshrink": F.softshrink,
    "nn.softsign": F.softsign, "nn.tanhshrink": F.tanhshrink, "nn.threshold": F.threshold,
}
for _name, _fn in sorted(ACTIVATIONS.items()):
    register(_name, elementwise())(lambda a, _fn=_fn, **attrs: _fn(a, **attrs))


def _glu_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``glu`` halves ``dim``: splits of the other dims pass; a split ``dim`` is boxed
    (its halves live on different ranks) to the cheapest of them: an all-to-all to another
    dim's split, or an all-gather to B."""
    (m,) = metas
    return [(Split(d), Split(d)) for d in range(m.ndim) if d != attrs["dim"]]


register("nn.glu", _glu_rule)(lambda a, *, dim: F.glu(a, dim))
# prelu(x, w) with w viewed as (C, 1, ..., 1) against x (N, C, ...): then the broadcasting
# rule splits the channel dim of x and w together.
register("nn.prelu", elementwise())(lambda a, w: F.prelu(a, w.reshape(-1)))


# --------------------------------------------------------------- nn pointwise losses
def _with_weight(kernel):
    """Kernel wrapper: a third tensor, when given, is the ``weight`` argument."""

    def run(a, b, weight=None, **attrs):
        return kernel(a, b, weight=weight, **attrs)

    return run


register("nn.kl_div", elementwise())(
    lambda a, b, *, log_target: F.kl_div(a, b, reduction="none", log_target=log_target))
register("nn.smooth_l1_loss", elementwise())(
    lambda a, b, *, beta: F.smooth_l1_loss(a, b, reduction="none", beta=beta))
register("nn.huber_loss", elementwise())(
    lambda a, b, *, delta: F.huber_loss(a, b, reduction="none", delta=delta))
register("nn.binary_cross_entropy", elementwise())(_with_weight(
    lambda a, b, *, weight: F.binary_cross_entropy(a, b, weight, reduction="none")))
register("nn.margin_ranking_loss", elementwise())(
    lambda a, b, y, *, margin: F.margin_ranking_loss(a, b, y, margin, reduction="none"))


# --------------------------------------------------------------- methods
METHODS: dict = {
    **{name: _unary(name) for name in sorted({*UNARY, *LINEAR_UNARY})},
    **{alias: _unary(name) for alias, name in sorted(ALIASES.items())},
    **{name: _binary(name, f"{name}_scalar", name) for name in sorted(BINARY)},
    "arctan2": _binary("atan2", "atan2_scalar", "arctan2"),
    "logit": _logit,
    "nan_to_num": _nan_to_num,
    # in place
    **{f"{name}_": _inplace_unary(name) for name in sorted({*UNARY, *LINEAR_UNARY})
       if hasattr(torch.Tensor, f"{name}_")},
    **{f"{alias}_": _inplace_unary(name) for alias, name in sorted(ALIASES.items())},
    **{f"{name}_": _inplace_binary(name, f"{name}_") for name in sorted(BINARY)
       if hasattr(torch.Tensor, f"{name}_")},
    "arctan2_": _inplace_binary("atan2", "arctan2_"),
    "logit_": _logit_,
    "nan_to_num_": _nan_to_num_,
}
