"""Padding layers over :func:`sbpflow.nn.functional.pad` (torch.nn's names, arguments
and ``padding`` tuples: an int pads every side; tuples are (left, right[, top, bottom[,
front, back]])). Splits of the unpadded dims pass; P passes except a non-zero constant."""

from __future__ import annotations

from .. import functional as F
from ..module import Module

__all__ = ["ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
           "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d",
           "ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d",
           "CircularPad2d", "CircularPad3d"]


class _PadNd(Module):
    _n = 1  # padded dims
    _mode = "constant"

    def __init__(self, padding, value: float = 0.0):
        super().__init__()
        if isinstance(padding, int):
            padding = (padding,) * (2 * self._n)
        padding = tuple(padding)
        if len(padding) != 2 * self._n or not all(isinstance(p, int) for p in padding):
            raise ValueError(f"{type(self).__name__}: padding must be an int or {2 * self._n} "
                             f"ints, got {padding!r}")
        self.padding, self.value = padding, value

    def forward(self, input):  # noqa: A002
        if self._mode == "constant":
            return F.pad(input, self.padding, "constant", self.value)
        return F.pad(input, self.padding, self._mode)

    def extra_repr(self) -> str:
        return f"{self.padding}" + (f", value={self.value}" if self._mode == "constant" else "")


class ConstantPad1d(_PadNd):
    """``torch.nn.ConstantPad1d(padding, value)``: pads the last dim with ``value``."""

    def __init__(self, padding, value: float):
        super().__init__(padding, value)


class ConstantPad2d(ConstantPad1d):
    """``torch.nn.ConstantPad2d(padding, value)``: pads the last two dims."""

    _n = 2


class ZeroPad1d(_PadNd):
    """``torch.nn.ZeroPad1d(padding)``: pads the last dim with zeros."""


class ZeroPad2d(_PadNd):
    """``torch.nn.ZeroPad2d(padding)``: pads the last two dims with zeros."""

    _n = 2


class ReflectionPad1d(_PadNd):
    """``torch.nn.ReflectionPad1d(padding)`` (reflection of the input at the border)."""

    _mode = "reflect"


class ReflectionPad2d(ReflectionPad1d):
    """``torch.nn.ReflectionPad2d(padding)``."""

    _n = 2


class ReplicationPad1d(_PadNd):
    """``torch.nn.ReplicationPad1d(padding)`` (repeats the border value)."""

    _mode = "replicate"


class ReplicationPad2d(ReplicationPad1d):
    """``torch.nn.ReplicationPad2d(padding)``."""

    _n = 2


class ConstantPad3d(ConstantPad1d):
    """``torch.nn.ConstantPad3d(padding, value)``: pads the last three dims."""

    _n = 3


class ZeroPad3d(_PadNd):
    """``torch.nn.ZeroPad3d(padding)``: pads the last three dims with zeros."""

    _n = 3


class ReflectionPad3d(ReflectionPad1d):
    """``torch.nn.ReflectionPad3d(padding)`` of (N, C, D, H, W) or (C, D, H, W)."""

    _n = 3


class ReplicationPad3d(ReplicationPad1d):
    """``torch.nn.ReplicationPad3d(padding)`` of (N, C, D, H, W) or (C, D, H, W)."""

    _n = 3


class CircularPad1d(_PadNd):
    """``torch.nn.CircularPad1d(padding)``: pads the last dim of (N, C, L) or (C, L) with
    the values from its other end (periodic).

    Raises:
        ValueError: an input of another rank (torch's check).
    """

    _mode = "circular"

    def forward(self, input):  # noqa: A002
        n = self._n
        if input.ndim not in (n + 1, n + 2):
            raise ValueError(f"expected {n + 1}D or {n + 2}D input (got {input.ndim}D input)")
        return super().forward(input)


class CircularPad2d(CircularPad1d):
    """``torch.nn.CircularPad2d(padding)``: the last two dims of (N, C, H, W) or (C, H, W),
    periodic."""

    _n = 2


class CircularPad3d(CircularPad1d):
    """``torch.nn.CircularPad3d(padding)``: the last three dims of (N, C, D, H, W) or (C, D,
    H, W), periodic."""

    _n = 3
