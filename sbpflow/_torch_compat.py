"""torch functions and ``torch.Tensor`` methods called with sbpflow tensors.

``sbpflow.Tensor.__torch_function__`` sends them here: a function of ``torch`` runs
``sbpflow.<name>``, one of ``torch.nn.functional`` runs ``sbpflow.nn.functional.<name>``,
one of ``torch.nn.init`` runs ``sbpflow.nn.init.<name>``, and a ``torch.Tensor`` method or
operator runs the sbpflow method of the same name on the first argument. ``torch.Tensor``
arguments (and those inside lists and tuples) become local sbpflow tensors first, so
``torch_tensor + x`` works for a local ``x`` and gives sbpflow's local/global error for a
global one.

Layer: above ``nn/`` (it maps to ``sbpflow.nn.functional`` and ``sbpflow.nn.init``) and
below the package root, whose namespace (``sbpflow.<name>``) it searches: the root hands
it over in :func:`install`, which also sets :attr:`sbpflow.Tensor._torch_function` to
:func:`dispatch` (the Tensor layer does not import this module).
"""

from __future__ import annotations

import types

import torch

from .nn import functional as F
from .nn import init
from .tensor import Tensor

__all__ = ["dispatch", "install"]

# The module whose attributes are ``sbpflow.<name>`` (the package root), set by install().
_root: types.ModuleType | None = None


def install(root: types.ModuleType) -> None:
    """Route torch functions called with sbpflow tensors to ``root``'s functions (the
    ``sbpflow`` package, passed by its ``__init__``): set ``Tensor._torch_function``."""
    global _root
    _root = root
    Tensor._torch_function = staticmethod(dispatch)


def _wrap(v):
    if isinstance(v, torch.Tensor):
        return Tensor(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_wrap(i) for i in v)
    return v


def _target(func):
    name = getattr(func, "__name__", None) or ""
    qual = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", "") or ""
    if qual.startswith(("Tensor.", "TensorBase.", "_TensorBase.")) or \
            getattr(func, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        return "method", name
    if module.startswith("torch.nn.functional"):
        return "function", getattr(F, name, None) or getattr(_root, name, None)
    if module.startswith("torch.nn.init"):
        return "function", getattr(init, name, None)
    return "function", getattr(_root, name, None)


def dispatch(func, args, kwargs):
    kind, target = _target(func)
    args, kwargs = _wrap(tuple(args)), {k: _wrap(v) for k, v in kwargs.items()}
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if kind == "method":
        if name.endswith(("__get__", "__set__")):  # properties (x.shape via torch.Tensor...)
            raise TypeError(f"torch property {name} on an sbpflow tensor; use the sbpflow "
                            f"tensor's own attribute")
        self = args[0] if args and isinstance(args[0], Tensor) else None
        method = getattr(self, target, None) if self is not None else None
        if method is not None:
            return method(*args[1:], **kwargs)
    elif target is not None:
        return target(*args, **kwargs)
    raise TypeError(f"torch's {name} was called with an sbpflow tensor, and sbpflow has no op "
                    f"of that name; use sbpflow's API, or compute on this rank's shard with "
                    f"x.to_local().to_torch() (a torch.Tensor)")
