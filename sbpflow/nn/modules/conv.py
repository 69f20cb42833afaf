"""Conv1d, Conv2d (torch.nn's arguments, names and initialisation)."""

from __future__ import annotations

import math

from .. import functional as F
from .. import init
from ..module import Module
from ._common import empty_param, optional_param

__all__ = ["Conv1d", "Conv2d"]


def _tuple(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class _ConvNd(Module):
    _n = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"must be divisible by groups ({groups})")
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode {padding_mode!r} is not supported; use 'zeros' "
                             f"or pad explicitly with F.pad")
        n = self._n
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride = _tuple(kernel_size, n), _tuple(stride, n)
        self.padding = padding if isinstance(padding, str) else _tuple(padding, n)
        self.dilation, self.padding_mode = _tuple(dilation, n), padding_mode
        self.weight = empty_param(out_channels, in_channels // groups, *self.kernel_size,
                                  device=device, dtype=dtype)
        optional_param(self, "bias", bias, out_channels, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # torch.nn.modules.conv._ConvNd.reset_parameters
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * math.prod(self.kernel_size)
            if fan_in != 0:
                bound = 1 / math.sqrt(fan_in)
                init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * self._n:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._n:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s


class Conv1d(_ConvNd):
    """1-D convolution over (batch, channels, length); ``weight`` (out, in/groups, k)."""

    _n = 1

    def forward(self, input):  # noqa: A002
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding,
                        self.dilation, self.groups)


class Conv2d(_ConvNd):
    """2-D convolution over (batch, channels, height, width); ``weight``
    (out, in/groups, kh, kw). Batch split (S(0)) input -> S(0) output with B weights (data
    parallel); weight S(0) splits output channels."""

    _n = 2

    def forward(self, input):  # noqa: A002
        return F.conv2d(input, self.weight, self.bias, self.stride, self.padding,
                        self.dilation, self.groups)
