"""More of torch's Tensor methods and functions, written with the ops of the other
families (so their layouts, collectives and gradients come from those): ``cpu``,
``new_*``, ``view_as``, ``reshape_as``, ``mm``, ``bmm``, ``outer``, ``einsum``,
``argsort``, ``unbind``, ``select``, ``tile``, ``movedim``, ``swapaxes``, ``isfinite``,
``isclose``/``allclose``/``equal``, ``from_numpy``/``as_tensor``/``is_tensor``,
``concat``/``hstack``/``vstack``.
"""

from __future__ import annotations

import string

import numpy as np
import torch

from ..sbp import broadcast
from ..tensor import Tensor
from ._dispatch import apply
from ._methods import cat
from ._registry import register
from ._rules import einsum as _einsum_rule
from ._rules import elementwise
from .creation import tensor

__all__ = ["einsum", "from_numpy", "as_tensor", "is_tensor", "allclose", "equal", "concat",
           "concatenate", "hstack", "vstack", "outer"]


def _cpu(self):
    """A local tensor on the CPU (``torch.Tensor.cpu``); a global tensor on a CPU
    placement is returned as is (move global tensors with ``to_global(placement=...)``)."""
    if self.is_local:
        return Tensor(self._local.cpu())
    if self.placement.type != "cpu":
        raise ValueError(f"cpu() of a global tensor on {self.placement!r}: move it with "
                         f"x.to_global(placement=sbpflow.placement('cpu', ranks), sbp=...)")
    return self


def _new(kind: str):
    def method(self, *args, dtype=None, device=None, requires_grad=False, **kw):
        dtype = dtype or self.dtype
        if self.is_local:
            fn = getattr(self._local, kind)
            out = fn(*args, dtype=dtype, device=device or self._local.device, **kw)
            return Tensor(out.requires_grad_(requires_grad))
        # Global: the same placement, replicated (torch: same dtype and device).
        whole = getattr(torch.empty(0, dtype=dtype), kind)(*args, dtype=dtype, **kw)
        return tensor(whole, placement=self.placement,
                      sbp=(broadcast,) * self.placement.ndim, requires_grad=requires_grad)

    method.__name__ = kind
    method.__doc__ = (f"``torch.Tensor.{kind}``: same dtype (and for a global tensor, the same "
                      f"placement, laid out B).")
    return method


def _mm(self, other):
    """``torch.mm``: 2-D x 2-D matrix product."""
    if self.ndim != 2 or other.ndim != 2:
        raise ValueError(f"mm: expected 2-D tensors, got shapes {tuple(self.shape)} and "
                         f"{tuple(other.shape)} (use matmul for batches)")
    return self @ other


def _bmm(self, other):
    """``torch.bmm``: 3-D x 3-D batched matrix product."""
    if self.ndim != 3 or other.ndim != 3:
        raise ValueError(f"bmm: expected 3-D tensors, got shapes {tuple(self.shape)} and "
                         f"{tuple(other.shape)}")
    return self @ other


def _argsort(self, dim: int = -1, descending: bool = False, stable: bool = False):
    return self.sort(dim=dim, descending=descending, stable=stable).indices


def _select(self, dim: int, index: int):
    dim %= self.ndim
    return self[(slice(None),) * dim + (index,)]


def _unbind(self, dim: int = 0):
    return tuple(_select(self, dim, i) for i in range(self.shape[dim]))


def _tile(self, *dims):
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    dims = (1,) * (self.ndim - len(dims)) + tuple(dims)
    return self.repeat(*dims)


def _movedim(self, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src = [s % self.ndim for s in src]
    dst = [d % self.ndim for d in dst]
    rest = [d for d in range(self.ndim) if d not in src]
    order = [None] * self.ndim
    for s, d in zip(src, dst):
        order[d] = s
    it = iter(rest)
    order = [o if o is not None else next(it) for o in order]
    return self.permute(*order)


def _isfinite(self):
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        return self == self  # integers are finite
    return (self.isinf() | self.isnan()).logical_not()


register("isclose", elementwise())(
    lambda a, b, *, rtol, atol, equal_nan: torch.isclose(a, b, rtol, atol, equal_nan))


def _isclose(self, other, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False):
    return apply("isclose", self, other, rtol=rtol, atol=atol, equal_nan=equal_nan)


def allclose(input, other, rtol: float = 1e-5, atol: float = 1e-8,  # noqa: A002
             equal_nan: bool = False) -> bool:
    """``torch.allclose`` (collective for global tensors: every rank gets the answer)."""
    return bool(_isclose(input, other, rtol, atol, equal_nan).all().item())


def equal(input, other) -> bool:  # noqa: A002
    """``torch.equal``: same shape and elements (collective for global tensors)."""
    return tuple(input.shape) == tuple(other.shape) and bool((input == other).all().item())


def outer(input, vec2):  # noqa: A002
    """``torch.outer`` of two 1-D tensors: (n,) x (m,) -> (n, m)."""
    return input.reshape(-1, 1) * vec2.reshape(1, -1)


def _einsum_kernel(*ts, spec):
    return torch.einsum(spec, *ts)


def _einsum_rules(metas, attrs):
    return _einsum_rule(attrs["spec"])(metas, attrs)


register("einsum", _einsum_rules)(_einsum_kernel)


def einsum(spec: str, *operands) -> Tensor:
    """``torch.einsum`` with explicit subscripts (``"bij,bjk->bik"``; ``...`` is expanded
    from the operand ranks). SBP rules come from the string: a kept letter may be split
    everywhere it appears; a contracted letter split in every operand gives P.

    Raises:
        ValueError: no ``->``.
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    spec = spec.replace(" ", "")
    if "->" not in spec:
        raise ValueError(f"einsum: give the output subscripts explicitly, e.g. 'ij,jk->ik'; "
                         f"got {spec!r}")
    if "..." in spec:
        ins, out = spec.split("->")
        parts = ins.split(",")
        used = set(spec) - set(".,->")
        free = [c for c in string.ascii_letters if c not in used]
        n = max(op.ndim - (len(p) - 3) for op, p in zip(operands, parts) if "..." in p)
        fill = "".join(free[:n])
        parts = [p.replace("...", fill[n - (op.ndim - (len(p) - 3)):]) for op, p in
                 zip(operands, parts)]
        spec = ",".join(parts) + "->" + out.replace("...", fill)
    return apply("einsum", *operands, spec=spec)


def from_numpy(a: np.ndarray) -> Tensor:
    """``torch.from_numpy``: a local tensor sharing the array's memory."""
    return Tensor(torch.from_numpy(a))


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``torch.as_tensor``: an sbpflow tensor is returned as is (cast if ``dtype``)."""
    if isinstance(data, Tensor):
        return data if dtype is None or dtype == data.dtype else data.to(dtype)
    return Tensor(torch.as_tensor(data, dtype=dtype, device=device))


def is_tensor(obj) -> bool:
    """True for sbpflow tensors (local or global)."""
    return isinstance(obj, Tensor)


def concat(tensors, dim: int = 0) -> Tensor:
    """Alias of :func:`sbpflow.cat`."""
    return cat(tensors, dim)


concatenate = concat


def hstack(tensors) -> Tensor:
    """``torch.hstack``: along dim 1 (dim 0 for 1-D tensors)."""
    tensors = list(tensors)
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


def vstack(tensors) -> Tensor:
    """``torch.vstack``: along dim 0, 1-D tensors as rows."""
    return cat([t.reshape(1, -1) if t.ndim == 1 else t for t in tensors], 0)


METHODS = {
    "cpu": _cpu,
    "new_zeros": _new("new_zeros"),
    "new_ones": _new("new_ones"),
    "new_full": _new("new_full"),
    "new_empty": _new("new_empty"),
    "view_as": lambda self, other: self.view(*other.shape),
    "reshape_as": lambda self, other: self.reshape(*other.shape),
    "mm": _mm,
    "bmm": _bmm,
    "outer": outer,
    "argsort": _argsort,
    "select": _select,
    "unbind": _unbind,
    "tile": _tile,
    "movedim": _movedim,
    "moveaxis": _movedim,
    "swapaxes": lambda self, a, b: self.transpose(a, b),
    "swapdims": lambda self, a, b: self.transpose(a, b),
    "isfinite": _isfinite,
    "isclose": _isclose,
    "allclose": allclose,
    "equal": equal,
}
