"""``sbpflow.nn.init``: torch.nn.init's functions on local and global tensors.

Layout invariance (ARCHITECTURE): with the same seed, initialising a global tensor gives
the tensor that ``torch.nn.init`` gives on one process, whatever its placement and SBP.
Each function runs torch's own initialiser on a whole-shape tensor on every rank (so
torch's generator advances exactly as on one process) and keeps this rank's shard:
memory is one whole tensor per rank while it runs (free afterwards). Fans and gains are
computed from the global shape. A P tensor gets the value on mesh coordinate 0 of each P
axis and zeros elsewhere (its sum is the initialised value). In place; returns the tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.init as _tinit

from ..ops import api as _api
from ..tensor import Tensor

__all__ = ["calculate_gain", "constant_", "dirac_", "eye_", "kaiming_normal_",
           "kaiming_uniform_", "normal_", "ones_", "orthogonal_", "trunc_normal_", "uniform_",
           "xavier_normal_", "xavier_uniform_", "zeros_"]

calculate_gain = _tinit.calculate_gain


def _shard_of_whole(t: Tensor, whole: torch.Tensor) -> torch.Tensor:
    pl = t.placement
    coord = pl.coord()
    if coord is None:
        return t._local
    out = whole[pl.shard_slices(tuple(t.shape), t.sbp)]
    if any(s.is_partial() and c != 0 for s, c in zip(t.sbp, coord)):
        out = torch.zeros_like(out)
    return out


def _wrap(torch_fn):
    @functools.wraps(torch_fn)
    def init(tensor: Tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor):
            return torch_fn(tensor, *args, **kwargs)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"nn.init.{torch_fn.__name__} takes an sbpflow Tensor, got "
                            f"{type(tensor).__name__}")
        with torch.no_grad():
            if tensor.is_local:
                torch_fn(tensor._local, *args, **kwargs)
                return tensor
            whole = torch.empty(tuple(tensor.shape), dtype=tensor.dtype,
                                device=tensor._local.device)
            torch_fn(whole, *args, **kwargs)
            tensor._local.copy_(_shard_of_whole(tensor, whole))
        return tensor

    init.__doc__ = (f"``torch.nn.init.{torch_fn.__name__}`` on a local or global sbpflow "
                    f"tensor (layout-invariant; see :mod:`sbpflow.nn.init`).")
    return init


uniform_ = _wrap(_tinit.uniform_)
normal_ = _wrap(_tinit.normal_)
trunc_normal_ = _wrap(_tinit.trunc_normal_)
constant_ = _wrap(_tinit.constant_)
ones_ = _wrap(_tinit.ones_)
zeros_ = _wrap(_tinit.zeros_)
eye_ = _wrap(_tinit.eye_)
dirac_ = _wrap(_tinit.dirac_)
xavier_uniform_ = _wrap(_tinit.xavier_uniform_)
xavier_normal_ = _wrap(_tinit.xavier_normal_)
kaiming_uniform_ = _wrap(_tinit.kaiming_uniform_)
kaiming_normal_ = _wrap(_tinit.kaiming_normal_)
orthogonal_ = _wrap(_tinit.orthogonal_)

# torch.nn.init's functions called with sbpflow tensors run these (a table built once)
_api.route_module(_tinit, globals())
