"""Identity, Linear, Bilinear, LazyLinear, Flatten, Unflatten (torch.nn's arguments,
names and initialisation)."""

from __future__ import annotations

import math

import torch

from .. import functional as F
from .. import init
from ..module import Module, UninitializedParameter
from ._common import empty_param, optional_param
from .lazy import LazyModuleMixin

__all__ = ["Identity", "Linear", "Bilinear", "LazyLinear", "Flatten", "Unflatten"]


class Identity(Module):
    """Returns its input (extra constructor arguments are ignored, as in torch)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):  # noqa: A002
        return input


class Linear(Module):
    """``y = x W^T + b``; ``weight`` (out_features, in_features), ``bias`` (out_features).

    Initialisation as ``torch.nn.Linear``: weight kaiming-uniform with ``a = sqrt(5)``,
    bias uniform in ``+-1/sqrt(in_features)`` (layout-invariant under any SBP). Tensor
    parallel: weight ``S(0)`` (and bias ``S(0)``) is Megatron's column-parallel layer (output
    split on its last dim); weight ``S(1)`` with bias ``B`` the row-parallel one (input split
    on its last dim, output P).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, device=device, dtype=dtype)
        optional_param(self, "bias", bias, out_features, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):  # noqa: A002
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Bilinear(Module):
    """``y = x1^T A x2 + b`` (``torch.nn.Bilinear``): input1 (..., in1_features), input2
    (..., in2_features) -> (..., out_features); ``weight`` (out, in1, in2), ``bias``
    (out,), both uniform in ``+-1/sqrt(in1_features)`` as torch's. Layouts as
    :func:`sbpflow.nn.functional.bilinear` (batch split with B parameters: data parallel;
    weight and bias S(0): output features split).

    Raises:
        ValueError: ``in1_features <= 0`` (torch's check).
    """

    def __init__(self, in1_features: int, in2_features: int, out_features: int,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in1_features, self.in2_features = in1_features, in2_features
        self.out_features = out_features
        self.weight = empty_param(out_features, in1_features, in2_features, device=device,
                                  dtype=dtype)
        optional_param(self, "bias", bias, out_features, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.in1_features <= 0:
            raise ValueError(f"in1_features must be > 0, but got (in1_features="
                             f"{self.in1_features})")
        bound = 1 / math.sqrt(self.weight.shape[1])
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input1, input2):
        return F.bilinear(input1, input2, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in1_features={self.in1_features}, in2_features={self.in2_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class LazyLinear(LazyModuleMixin, Linear):
    """A :class:`Linear` whose ``in_features`` is ``input.shape[-1]`` of the first input
    (``torch.nn.LazyLinear``): it then initialises as ``Linear`` (torch's draw at that
    moment) and becomes a ``Linear``. Layouts of the new parameters: see
    :mod:`sbpflow.nn.modules.lazy` (a global first input makes them B on its placement).
    """

    cls_to_become = Linear

    def __init__(self, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(0, 0, False, device, dtype)
        self.weight = UninitializedParameter(device=device, dtype=dtype)
        self.out_features = out_features
        if bias:
            self.bias = UninitializedParameter(device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params() and self.in_features != 0:
            super().reset_parameters()

    def initialize_parameters(self, input) -> None:  # noqa: A002
        if self.has_uninitialized_params():
            with torch.no_grad():
                self.in_features = input.shape[-1]
                self.weight.materialize((self.out_features, self.in_features))
                if self.bias is not None:
                    self.bias.materialize((self.out_features,))
                self.reset_parameters()
        if self.in_features == 0:  # materialised by load_state_dict
            if input.shape[-1] != self.weight.shape[-1]:
                raise ValueError(f"The in_features inferred from input: {input.shape[-1]} is "
                                 f"not equal to in_features from self.weight: "
                                 f"{self.weight.shape[-1]}")
            self.in_features = input.shape[-1]


class Flatten(Module):
    """``input.flatten(start_dim, end_dim)`` (defaults 1, -1 as torch.nn.Flatten)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):  # noqa: A002
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    """``input.unflatten(dim, unflattened_size)``."""

    def __init__(self, dim: int, unflattened_size):
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input):  # noqa: A002
        return input.unflatten(self.dim, self.unflattened_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"
