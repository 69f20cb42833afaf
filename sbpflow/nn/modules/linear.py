"""Identity, Linear, Flatten, Unflatten (torch.nn's arguments, names and initialisation)."""

from __future__ import annotations

import math

from .. import functional as F
from .. import init
from ..module import Module
from ._common import empty_param, optional_param

__all__ = ["Identity", "Linear", "Flatten", "Unflatten"]


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
