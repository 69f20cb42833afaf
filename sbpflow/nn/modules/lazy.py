"""``LazyModuleMixin``: layers that infer their input size from the first input
(``torch.nn.modules.lazy``'s semantics).

A lazy layer (``LazyLinear``, ``LazyConv2d``, ``LazyBatchNorm1d``, ...) is built without
its input size: its weights are :class:`~sbpflow.nn.UninitializedParameter` s (its
running statistics :class:`~sbpflow.nn.UninitializedBuffer` s). A forward pre-hook runs
``initialize_parameters(*args, **kwargs)`` on the first call: the layer reads the size
from the input, materialises its tensors and runs ``reset_parameters`` (torch's
initialisation, drawing from the generator at that moment, so with the same seed the
values are torch's lazy layer's bit for bit); then the hook is removed and the object
becomes ``cls_to_become`` (``LazyLinear`` -> ``Linear``), as in torch.

Layouts (sbpflow's part): ``module.to_global(placement, sbp)`` before the first call
lays out the tensors that exist and records the layout for the others, which get it when
they materialise (a per-name ``sbp`` callable or dict sees their dotted names). Without
a recorded layout, a first input that is global puts the layer's local tensors on its
placement, replicated (B): the layer then behaves as ``to_global(placement, B)`` had
been called (data parallel with a batch-split input). A ``load_state_dict`` before the
first call materialises the tensors with the checkpoint's shapes (torch's lazy load
hook); the first call then only lays them out.
"""

from __future__ import annotations

import itertools

import torch

from ...sbp import SBP, broadcast
from ...tensor import Tensor
from ..module import _rebind, is_lazy

__all__ = ["LazyModuleMixin"]


class LazyModuleMixin:
    """Mixin of the ``Lazy*`` layers (see the module doc). Subclasses define
    ``initialize_parameters(*args, **kwargs)`` and ``cls_to_become``."""

    cls_to_become = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._initialize_hook = self.register_forward_pre_hook(_infer_parameters,
                                                               with_kwargs=True)

    def has_uninitialized_params(self) -> bool:
        """Whether a parameter or buffer of this module (not its children) is still
        uninitialised."""
        return any(is_lazy(t) for t in itertools.chain(self._parameters.values(),
                                                        self._buffers.values()))

    def initialize_parameters(self, *args, **kwargs) -> None:
        """Infer the sizes from the first input and materialise (subclasses)."""
        raise NotImplementedError(f"initialize_parameters is not implemented for "
                                  f"{type(self).__name__}")


def _infer_parameters(module, args, kwargs):
    """The forward pre-hook of a lazy layer (torch's ``_infer_parameters``), plus the
    layout of the materialised tensors (the module doc)."""
    module.initialize_parameters(*args, **(kwargs or {}))
    if module.has_uninitialized_params():
        raise RuntimeError(f"module {module._get_name()} has not been fully initialized")
    module._initialize_hook.remove()
    del module.__dict__["_initialize_hook"]
    layout = module.__dict__.pop("_lazy_layout", None)
    if layout is not None:
        placement, sbp, prefix = layout
        if callable(sbp) and not isinstance(sbp, SBP) and prefix:
            sbp = _prefixed(sbp, prefix)
        module.to_global(placement, sbp)
    else:
        x = next((a for a in args if isinstance(a, Tensor) and a.is_global), None)
        if x is not None:
            pl = x.placement
            for t in itertools.chain(module._parameters.values(), module._buffers.values()):
                if t is not None and t.is_local:
                    with torch.no_grad():
                        _rebind(t, t.detach().to_global(pl, (broadcast,) * pl.ndim))
    if module.cls_to_become is not None:
        module.__class__ = module.cls_to_become
    return None


def _prefixed(sbp, prefix: str):
    """A per-name layout written for the root module, asked with this module's names."""
    return lambda name, t: sbp(prefix + name, t)
