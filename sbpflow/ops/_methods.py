"""Tensor operators and methods, generated from the registry in this one place.

``x + y`` with a Tensor ``y`` runs op ``add``; with a Python number it runs
``add_scalar`` (whose P rule differs). Reflected operators (``2 - x``) map to the
``r``-ops. Adding a method here is one line in :data:`METHODS`.
"""

from __future__ import annotations

import numbers

from ..tensor import Tensor
from ._core import BINARY, UNARY
from ._dispatch import apply

__all__ = ["install", "METHODS"]


def _binary(name: str, scalar_op: str | None = None):
    """``self <name> other``; with a Python number, op ``scalar_op`` (default
    ``<name>_scalar``) with ``other=`` the number."""

    def method(self, other):
        if isinstance(other, Tensor):
            return apply(name, self, other)
        if isinstance(other, numbers.Number):
            return apply(scalar_op or f"{name}_scalar", self, other=other)
        return NotImplemented

    method.__name__ = name
    method.__doc__ = f"Elementwise ``{name}`` with broadcasting (op registry: ``{name}``)."
    return method


def _unary(name: str):
    def method(self):
        return apply(name, self)

    method.__name__ = name
    method.__doc__ = f"Elementwise ``{name}`` (op registry: ``{name}``)."
    return method


def _sum(self, dim=None, keepdim: bool = False):
    """Sum over ``dim`` (int, tuple, or None for all); a split reduced dim gives P."""
    return apply("sum", self, dim=dim, keepdim=keepdim)


def _matmul(self, other):
    """``torch.matmul`` semantics; SBP rules from its einsum string."""
    if not isinstance(other, Tensor):
        return NotImplemented
    return apply("matmul", self, other)


METHODS = {
    "__add__": _binary("add"),
    "__radd__": _binary("add", "add_scalar"),
    "__sub__": _binary("sub"),
    "__rsub__": _binary("sub", "rsub_scalar"),
    "__mul__": _binary("mul"),
    "__rmul__": _binary("mul", "mul_scalar"),
    "__truediv__": _binary("div"),
    "__pow__": _binary("pow"),
    "__eq__": _binary("eq"),
    "__ne__": _binary("ne"),
    "__lt__": _binary("lt"),
    "__le__": _binary("le"),
    "__gt__": _binary("gt"),
    "__ge__": _binary("ge"),
    "__neg__": _unary("neg"),
    "__abs__": _unary("abs"),
    "__matmul__": _matmul,
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "div": _binary("div"),
    **{name: _binary(name) for name in sorted(BINARY)},
    "neg": _unary("neg"),
    **{name: _unary(name) for name in sorted(UNARY) if name not in ("gelu", "silu", "softplus")},
    "matmul": _matmul,
    "sum": _sum,
}


def install() -> None:
    """Attach :data:`METHODS` to :class:`sbpflow.Tensor` (called once on import)."""
    for attr, fn in METHODS.items():
        setattr(Tensor, attr, fn)
