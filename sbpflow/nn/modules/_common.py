"""Helpers shared by the layer files: parameter creation like torch's factory kwargs."""

from __future__ import annotations

import torch

from ...tensor import Tensor
from ..module import Parameter


def empty_param(*shape: int, device=None, dtype=None, requires_grad: bool = True) -> Parameter:
    """An uninitialised local parameter (``torch.empty`` with factory kwargs), to be filled
    by the layer's ``reset_parameters`` with :mod:`sbpflow.nn.init` as torch's does."""
    return Parameter(Tensor(torch.empty(shape, device=device, dtype=dtype)), requires_grad)


def optional_param(module, name: str, enabled: bool, *shape: int, device=None,
                   dtype=None) -> None:
    """Register parameter ``name`` of ``shape`` (uninitialised) or, when not ``enabled``,
    ``None`` (torch layers' ``bias=False`` / ``affine=False``)."""
    if enabled:
        setattr(module, name, empty_param(*shape, device=device, dtype=dtype))
    else:
        module.register_parameter(name, None)
