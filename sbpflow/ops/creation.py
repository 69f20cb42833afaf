"""Creation from other tensors and data: ``new_zeros``/``new_ones``/``new_full``/
``new_empty``, ``from_numpy``, ``as_tensor``, ``is_tensor``, ``tril_indices``/
``triu_indices``.
"""

from __future__ import annotations

import numpy as np
import torch

from .._creation import METHODS as _CREATION_METHODS
from .._creation import _deterministic
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor, tensor
from .api import function, method

S, B, P = Split, broadcast, partial_sum


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


def _tri_indices(name: str):
    fn = getattr(torch, name)

    def creator(row: int, col: int, offset: int = 0, *, dtype=torch.int64, device=None,
                layout=torch.strided, placement=None, sbp=None) -> Tensor:
        whole = fn(row, col, offset, dtype=dtype)
        return _deterministic(name, tuple(whole.shape), dtype, device, False, placement, sbp,
                              lambda region, local_shape, dev: whole[region].to(dev))

    creator.__name__ = name
    creator.__doc__ = (f"``torch.{name}(row, col, offset)``: the ``(2, N)`` int64 coordinates "
                       f"of the {'lower' if name.startswith('tril') else 'upper'} triangle of "
                       f"a ``row x col`` matrix. With ``placement``/``sbp`` each rank keeps its "
                       f"shard (computed locally, no communication; ``P``: coordinate 0 holds "
                       f"the values).")
    return creator


tril_indices = _tri_indices("tril_indices")


triu_indices = _tri_indices("triu_indices")


# ---------------------------------------------------------------- Tensor methods and functions
for _name in ("new_zeros", "new_ones", "new_full", "new_empty"):
    method(_name)(_new(_name))
function("from_numpy")(from_numpy)
function("as_tensor")(as_tensor)
function("is_tensor")(is_tensor)
function("tril_indices")(tril_indices)
function("triu_indices")(triu_indices)

for _name, _fn in sorted(_CREATION_METHODS.items()):  # bernoulli, multinomial
    method(_name)(_fn)
