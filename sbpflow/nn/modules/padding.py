"""Padding layers over :func:`sbpflow.nn.functional.pad` (torch.nn's names, arguments
and ``padding`` tuples: an int pads every side; tuples are (left, right[, top, bottom]))."""

from __future__ import annotations

from .. import functional as F
from ..module import Module

__all__ = ["ZeroPad1d", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d", "ReflectionPad1d",
           "ReflectionPad2d", "ReplicationPad1d", "ReplicationPad2d"]


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
