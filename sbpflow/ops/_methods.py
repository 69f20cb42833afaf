"""Tensor operators and methods, generated from the registry in this one place.

``x + y`` with a Tensor ``y`` runs op ``add``; with a Python number it runs
``add_scalar`` (whose P rule differs). Reflected operators (``2 - x``) map to the
``r``-ops. Adding a method here is one line in :data:`METHODS`.
"""

from __future__ import annotations

import math
import numbers

from ..tensor import Tensor
from ._core import BINARY, UNARY
from ._dispatch import VIEW_METHODS, apply, coerce_operand, mark_view_copies
from ._extremum import extremum
from ._reduce import cast

__all__ = ["install", "METHODS", "cat", "stack"]


def _binary(name: str, scalar_op: str | None = None):
    """``self <name> other``; with a Python number, op ``scalar_op`` (default
    ``<name>_scalar``) with ``other=`` the number."""

    def method(self, other):
        other = coerce_operand(self, other)
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


def _sum(self, dim=None, keepdim: bool = False, *, dtype=None):
    """Sum over ``dim`` (int, tuple, or None for all); a split reduced dim gives P.
    ``dtype`` casts the input first and is the output dtype (ints and bool sum to int64
    without it, as torch)."""
    return cast(apply("sum", cast(self, dtype), dim=dim, keepdim=keepdim), dtype)


def _dims(dim, ndim: int) -> tuple[int, ...]:
    dims = range(ndim) if dim is None else (dim,) if isinstance(dim, int) else dim
    return tuple(d % max(ndim, 1) for d in dims)  # a 0-d tensor takes dim 0 or -1, as torch


def _mean(self, dim=None, keepdim: bool = False, *, dtype=None):
    """Mean over ``dim``; exact under uneven splits (divides by the global count).
    ``dtype`` casts the input first; without it the input must be floating (as torch).

    Raises:
        TypeError: an integer or bool input without a floating ``dtype``."""
    self = cast(self, dtype)
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        raise TypeError(f"mean: could not infer the output dtype from a {self.dtype} input; "
                        f"pass a floating dtype, e.g. x.mean(dtype=torch.float32)")
    count = math.prod(self.shape[d] for d in _dims(dim, self.ndim) if d < self.ndim)
    return apply("mean", self, dim=dim, keepdim=keepdim, count=count)


def _permute(self, *dims):
    """``torch.permute``; a split dim moves with its data (no communication)."""
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    return apply("permute", self, dims=tuple(d % self.ndim for d in dims))


def _transpose(self, dim0: int, dim1: int):
    if self.ndim == 0:  # torch: dims 0 and -1 name the scalar itself
        for d in (dim0, dim1):
            if d not in (0, -1):
                raise IndexError(f"transpose: dim {d} is out of range for a 0-d tensor "
                                 f"(valid: -1, 0)")
        return self
    dims = list(range(self.ndim))
    dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return apply("permute", self, dims=tuple(dims))


def _t(self):
    if self.ndim > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dims, got {self.ndim}")
    return self if self.ndim < 2 else _transpose(self, 0, 1)


def _reshape(self, *shape):
    """``torch.reshape``; a split dim stays split when it survives the reshape whole,
    otherwise the input is gathered first (see ``sbpflow.ops._rules.reshape``)."""
    shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one dim can be -1, got {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(self.numel() // known if s == -1 else s for s in shape)
    if math.prod(shape) != self.numel():
        raise ValueError(f"reshape: shape {shape} is invalid for a tensor of shape "
                         f"{tuple(self.shape)} ({self.numel()} elements)")
    return apply("reshape", self, shape=shape, in_shape=tuple(self.shape))


def _flatten(self, start_dim: int = 0, end_dim: int = -1):
    s, e = start_dim % max(self.ndim, 1), end_dim % max(self.ndim, 1)
    shape = (*self.shape[:s], math.prod(self.shape[s:e + 1]), *self.shape[e + 1:])
    return _reshape(self, shape)


def _matmul(self, other):
    """``torch.matmul`` semantics; SBP rules from its einsum string."""
    if not isinstance(other, Tensor):
        return NotImplemented
    return apply("matmul", self, other)


def _softmax(self, dim, dtype=None):
    """``Tensor.softmax(dim)``: :func:`sbpflow.nn.functional.softmax`."""
    from ..nn import functional as F

    return F.softmax(self, dim, dtype=dtype)


def _log_softmax(self, dim, dtype=None):
    """``Tensor.log_softmax(dim)``: :func:`sbpflow.nn.functional.log_softmax`."""
    from ..nn import functional as F

    return F.log_softmax(self, dim, dtype=dtype)


METHODS = {
    "softmax": _softmax,
    "log_softmax": _log_softmax,
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
    **{name: _binary(name) for name in sorted(BINARY)},
    "neg": _unary("neg"),
    **{name: _unary(name) for name in sorted(UNARY) if name not in ("gelu", "silu", "softplus")},
    "matmul": _matmul,
    "sum": _sum,
    "mean": _mean,
    "amax": lambda self, dim=None, keepdim=False: extremum(self, "max", dim, keepdim),
    "amin": lambda self, dim=None, keepdim=False: extremum(self, "min", dim, keepdim),
    "permute": _permute,
    "transpose": _transpose,
    "t": _t,
    "T": property(_t),
    "reshape": _reshape,
    "view": _reshape,
    "flatten": _flatten,
}


def cat(tensors, dim: int = 0) -> Tensor:
    """``torch.cat``: join along ``dim``; a dim other than ``dim`` that every input splits
    stays split, summands (P) join to summands, otherwise the inputs are gathered."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat needs at least one tensor")
    return apply("cat", *tensors, dim=dim % max(tensors[0].ndim, 1))


def stack(tensors, dim: int = 0) -> Tensor:
    """``torch.stack``: join along a new dim ``dim`` (layouts as :func:`cat`)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack needs at least one tensor")
    return apply("stack", *tensors, dim=dim % (tensors[0].ndim + 1), new_dim=True)


def _tables() -> list[dict]:
    """Every module's method table: this one's plus one per op family."""
    from . import _extra, _misc, _more_elementwise, _more_index, _reduce, _shape, creation

    return [METHODS, _reduce.METHODS, _shape.METHODS, _misc.METHODS, creation.METHODS,
            _extra.METHODS, _more_elementwise.METHODS, _more_index.METHODS]


def _as_function(name: str, method):
    def fn(input, *args, **kwargs):  # noqa: A002 - torch's argument name
        return method(input, *args, **kwargs)

    fn.__name__ = name
    fn.__doc__ = f"``sbpflow.{name}(x, ...)`` is ``x.{name}(...)``.\n\n{method.__doc__ or ''}"
    return fn


def torch_functions() -> dict:
    """``sbpflow.<name>(x, ...)`` for every public method (torch's function forms:
    ``torch.exp(x)``, ``torch.sum(x, dim=1)``...); properties and operators excluded."""
    out = {}
    for table in _tables():
        for attr, method in table.items():
            if not attr.startswith("_") and callable(method) and not isinstance(method, property):
                out[attr] = _as_function(attr, method)
    return out


def _advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool)
               for i in items)


def _viewing(attr: str, fn):
    """``fn`` with its results marked when they are copies of a global input (torch returns
    views there; see :func:`sbpflow.ops._dispatch.mark_view_copies`)."""

    def method(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if attr == "__getitem__" and _advanced(args[0]):
            return out  # advanced indexing copies in torch too
        return mark_view_copies(attr, self, out)

    method.__name__, method.__doc__ = getattr(fn, "__name__", attr), fn.__doc__
    return method


def install() -> None:
    """Attach every method table to :class:`sbpflow.Tensor` (called once on import).

    Raises:
        ValueError: two tables define the same attribute.
    """
    seen: set[str] = set()
    for table in _tables():
        for attr, fn in table.items():
            if attr in seen:
                raise ValueError(f"Tensor.{attr} is defined by two method tables")
            seen.add(attr)
            if attr in VIEW_METHODS and callable(fn) and not isinstance(fn, property):
                fn = _viewing(attr, fn)
            setattr(Tensor, attr, fn)
