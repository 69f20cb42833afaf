"""Conv1d/2d/3d, ConvTranspose1d/2d/3d and their Lazy forms (torch.nn's arguments, names
and initialisation)."""

from __future__ import annotations

import math

import torch

from .. import functional as F
from .. import init
from ..module import Module, UninitializedParameter
from ._common import empty_param, optional_param
from .lazy import LazyModuleMixin

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
           "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d",
           "LazyConvTranspose2d", "LazyConvTranspose3d"]


def _tuple(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class _ConvNd(Module):
    _n = 0

    _transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
        super().__init__()
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive integer, got {groups!r}")
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
        # torch's layouts: (out, in / groups, k...); transposed (in, out / groups, k...)
        shape = ((in_channels, out_channels // groups) if self._transposed
                 else (out_channels, in_channels // groups))
        self.weight = empty_param(*shape, *self.kernel_size, device=device, dtype=dtype)
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


class Conv3d(_ConvNd):
    """3-D convolution over (batch, channels, depth, height, width) (``torch.nn.Conv3d``);
    ``weight`` (out, in/groups, kd, kh, kw), torch's initialisation. Layouts as
    :func:`sbpflow.nn.functional.conv3d` (batch S(0) with B weights: data parallel, no
    collective; weight S(0) splits the output channels)."""

    _n = 3

    def forward(self, input):  # noqa: A002
        return F.conv3d(input, self.weight, self.bias, self.stride, self.padding,
                        self.dilation, self.groups)


class _ConvTransposeNd(_ConvNd):
    _transposed = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 output_padding=0, groups=1, bias=True, dilation=1, padding_mode="zeros",
                 device=None, dtype=None):
        if isinstance(padding, str):
            raise ValueError(f"padding={padding!r} is not supported by "
                             f"{type(self).__name__}; give ints")
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for '
                             f"{type(self).__name__}, got {padding_mode!r}")
        self.output_padding = _tuple(output_padding, self._n)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype)

    def _output_padding(self, input, output_size) -> tuple:  # noqa: A002
        """torch's ``_ConvTransposeNd._output_padding``: the padding that gives
        ``output_size`` (spatial, or with the leading (N, C) dims)."""
        if output_size is None:
            return self.output_padding
        n = self._n
        lead = input.ndim - n
        size = list(output_size)
        if len(size) == lead + n:
            size = size[lead:]
        if len(size) != n:
            raise ValueError(f"ConvTranspose{n}D: for {input.ndim}D input, output_size must "
                             f"have {n} or {lead + n} elements (got {len(output_size)})")
        out = []
        for d in range(n):
            lo = ((input.shape[lead + d] - 1) * self.stride[d] - 2 * self.padding[d]
                  + self.dilation[d] * (self.kernel_size[d] - 1) + 1)
            hi = lo + self.stride[d] - 1
            if not lo <= size[d] <= hi:
                raise ValueError(f"requested an output size of {tuple(output_size)}, but valid "
                                 f"sizes of dim {d} range from {lo} to {hi} (for an input of "
                                 f"{tuple(input.shape[lead:])})")
            out.append(size[d] - lo)
        return tuple(out)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.output_padding != (0,) * self._n:
            s += f", output_padding={self.output_padding}"
        return s


class ConvTranspose1d(_ConvTransposeNd):
    """1-D transposed convolution over (batch, channels, length) (``torch.nn.
    ConvTranspose1d``); ``weight`` (in, out/groups, k), torch's initialisation.
    ``forward(input, output_size=None)``. SBP as :func:`sbpflow.nn.functional.
    conv_transpose1d` (batch S(0) with B weights: data parallel, no collective)."""

    _n = 1

    def forward(self, input, output_size=None):  # noqa: A002
        return F.conv_transpose1d(input, self.weight, self.bias, self.stride, self.padding,
                                  self._output_padding(input, output_size), self.groups,
                                  self.dilation)


class ConvTranspose2d(_ConvTransposeNd):
    """2-D transposed convolution over (batch, channels, height, width) (``torch.nn.
    ConvTranspose2d``); ``weight`` (in, out/groups, kh, kw). ``forward(input,
    output_size=None)``; layouts as :class:`ConvTranspose1d`."""

    _n = 2

    def forward(self, input, output_size=None):  # noqa: A002
        return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding,
                                  self._output_padding(input, output_size), self.groups,
                                  self.dilation)


class ConvTranspose3d(_ConvTransposeNd):
    """3-D transposed convolution over (batch, channels, depth, height, width)
    (``torch.nn.ConvTranspose3d``); ``weight`` (in, out/groups, kd, kh, kw). ``forward(
    input, output_size=None)``; layouts as :class:`ConvTranspose1d`."""

    _n = 3

    def forward(self, input, output_size=None):  # noqa: A002
        return F.conv_transpose3d(input, self.weight, self.bias, self.stride, self.padding,
                                  self._output_padding(input, output_size), self.groups,
                                  self.dilation)


# ------------------------------------------------------------------ lazy forms
class _LazyConvMixin(LazyModuleMixin):
    """torch's ``_LazyConvXdMixin``: ``in_channels`` is the first input's channel dim
    (dim 1 batched, dim 0 unbatched); the weight and bias then materialise and initialise
    as the concrete layer's (see :mod:`sbpflow.nn.modules.lazy`)."""

    def _lazy_init(self, out_channels: int, bias: bool, device, dtype) -> None:
        self.weight = UninitializedParameter(device=device, dtype=dtype)
        self.out_channels = out_channels
        if bias:
            self.bias = UninitializedParameter(device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params() and self.in_channels != 0:
            super().reset_parameters()

    def initialize_parameters(self, input, *args, **kwargs) -> None:  # noqa: A002
        if not self.has_uninitialized_params():
            if self.in_channels == 0:  # materialised by load_state_dict
                w = self.weight.shape
                self.in_channels = w[0] if self._transposed else w[1] * self.groups
            return
        n = self._n
        if input.ndim not in (n + 1, n + 2):
            raise RuntimeError(f"Expected {n + 1}D (unbatched) or {n + 2}D (batched) input to "
                               f"{type(self).__name__}, but got input of size: "
                               f"{tuple(input.shape)}")
        self.in_channels = input.shape[1] if input.ndim == n + 2 else input.shape[0]
        if self.in_channels % self.groups:
            raise ValueError("in_channels must be divisible by groups")
        with torch.no_grad():
            g = self.groups
            shape = ((self.in_channels, self.out_channels // g) if self._transposed
                     else (self.out_channels, self.in_channels // g))
            self.weight.materialize((*shape, *self.kernel_size))
            if self.bias is not None:
                self.bias.materialize((self.out_channels,))
            self.reset_parameters()


def _lazy_conv(concrete):
    class LazyConv(_LazyConvMixin, concrete):
        cls_to_become = concrete

        def __init__(self, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                     groups=1, bias=True, padding_mode="zeros", device=None, dtype=None):
            super().__init__(0, 0, kernel_size, stride, padding, dilation, groups, False,
                             padding_mode, device, dtype)
            self._lazy_init(out_channels, bias, device, dtype)

    name = "Lazy" + concrete.__name__
    LazyConv.__name__ = LazyConv.__qualname__ = name
    LazyConv.__doc__ = (f"A :class:`{concrete.__name__}` whose ``in_channels`` is inferred "
                        f"from the first input (``torch.nn.{name}``); then it initialises and "
                        f"becomes a ``{concrete.__name__}`` (:mod:`sbpflow.nn.modules.lazy`).")
    return LazyConv


def _lazy_conv_transpose(concrete):
    class LazyConvTranspose(_LazyConvMixin, concrete):
        cls_to_become = concrete

        def __init__(self, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                     groups=1, bias=True, dilation=1, padding_mode="zeros", device=None,
                     dtype=None):
            super().__init__(0, 0, kernel_size, stride, padding, output_padding, groups, False,
                             dilation, padding_mode, device, dtype)
            self._lazy_init(out_channels, bias, device, dtype)

    name = "Lazy" + concrete.__name__
    LazyConvTranspose.__name__ = LazyConvTranspose.__qualname__ = name
    LazyConvTranspose.__doc__ = (
        f"A :class:`{concrete.__name__}` whose ``in_channels`` is inferred from the first "
        f"input (``torch.nn.{name}``); then it initialises and becomes a "
        f"``{concrete.__name__}`` (:mod:`sbpflow.nn.modules.lazy`).")
    return LazyConvTranspose


LazyConv1d = _lazy_conv(Conv1d)
LazyConv2d = _lazy_conv(Conv2d)
LazyConv3d = _lazy_conv(Conv3d)
LazyConvTranspose1d = _lazy_conv_transpose(ConvTranspose1d)
LazyConvTranspose2d = _lazy_conv_transpose(ConvTranspose2d)
LazyConvTranspose3d = _lazy_conv_transpose(ConvTranspose3d)
