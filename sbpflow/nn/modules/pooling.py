"""Pooling (MaxPool1d/2d/3d, AvgPool1d/2d/3d, AdaptiveAvgPool1d/2d/3d,
AdaptiveMaxPool1d/2d/3d, LPPool1d/2d/3d, MaxUnpool1d/2d/3d, FractionalMaxPool2d/3d),
resampling and rearranging (Upsample, UpsamplingNearest2d, UpsamplingBilinear2d,
PixelShuffle, PixelUnshuffle, ChannelShuffle, Fold, Unfold) and Dropout, Dropout2d
(torch.nn's arguments and defaults)."""

from __future__ import annotations

from .. import functional as F
from ..module import Module

__all__ = ["MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
           "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "LPPool1d", "LPPool2d", "LPPool3d",
           "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d", "FractionalMaxPool2d",
           "FractionalMaxPool3d", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d",
           "PixelShuffle", "PixelUnshuffle", "ChannelShuffle", "Fold", "Unfold", "Dropout",
           "Dropout2d"]


def _ntuple(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


class MaxPool2d(Module):
    """``torch.nn.MaxPool2d`` over (N, C, H, W) or (C, H, W); ``return_indices`` returns
    ``(values, indices)`` (for :class:`MaxUnpool2d`)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False,
                 ceil_mode=False):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.dilation, self.ceil_mode = padding, dilation, ceil_mode
        self.return_indices = return_indices

    def forward(self, input):  # noqa: A002
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False,
                 count_include_pad=True, divisor_override=None):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.ceil_mode = padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, input):  # noqa: A002
        return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, input):  # noqa: A002
        return F.adaptive_avg_pool2d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class Dropout(Module):
    """Zeroes elements with probability ``p`` in training (layout-invariant masks: the same
    as torch's on one process for the same seed)."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input):  # noqa: A002
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


# ------------------------------------------------------------------ more dropouts (issue 21)
# Layout-invariant noise as Dropout2d's: with the same seed, torch's values under any SBP.
__all__ += ["AlphaDropout", "Dropout1d", "Dropout3d", "FeatureAlphaDropout"]


class Dropout1d(Dropout):
    """Zeroes whole channels of (N, C, L) or (C, L) with probability ``p`` in training
    (``torch.nn.Dropout1d``)."""

    def forward(self, input):  # noqa: A002
        return F.dropout1d(input, self.p, self.training, self.inplace)


class Dropout3d(Dropout):
    """Zeroes whole channels of (N, C, D, H, W) or (C, D, H, W) with probability ``p`` in
    training (``torch.nn.Dropout3d``)."""

    def forward(self, input):  # noqa: A002
        return F.dropout3d(input, self.p, self.training, self.inplace)


class AlphaDropout(Dropout):
    """Alpha dropout for SELU networks (``torch.nn.AlphaDropout``): keeps zero mean and
    unit variance. As torch's, ``inplace`` is stored but not used."""

    def forward(self, input):  # noqa: A002
        return F.alpha_dropout(input, self.p, self.training)


class FeatureAlphaDropout(Dropout):
    """Alpha dropout of whole channels of (N, C, *) (``torch.nn.FeatureAlphaDropout``);
    ``inplace`` stored, not used, as torch's."""

    def forward(self, input):  # noqa: A002
        return F.feature_alpha_dropout(input, self.p, self.training)


class MaxPool1d(Module):
    """``torch.nn.MaxPool1d`` over (N, C, L) or (C, L); ``return_indices`` returns
    ``(values, indices)``."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False,
                 ceil_mode=False):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.dilation, self.ceil_mode = padding, dilation, ceil_mode
        self.return_indices = return_indices

    def forward(self, input):  # noqa: A002
        return F.max_pool1d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class AvgPool1d(Module):
    """``torch.nn.AvgPool1d`` over (N, C, L) or (C, L)."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False,
                 count_include_pad=True):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.ceil_mode, self.count_include_pad = (padding, ceil_mode,
                                                                count_include_pad)

    def forward(self, input):  # noqa: A002
        return F.avg_pool1d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool1d(Module):
    """``torch.nn.AdaptiveAvgPool1d``: (N, C, L) -> (N, C, output_size)."""

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, input):  # noqa: A002
        return F.adaptive_avg_pool1d(input, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveMaxPool2d(Module):
    """``torch.nn.AdaptiveMaxPool2d``: (N, C, H, W) -> (N, C, *output_size)."""

    def __init__(self, output_size, return_indices=False):
        super().__init__()
        self.output_size, self.return_indices = output_size, return_indices

    def forward(self, input):  # noqa: A002
        return F.adaptive_max_pool2d(input, self.output_size, self.return_indices)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class Upsample(Module):
    """``torch.nn.Upsample``: :func:`sbpflow.nn.functional.interpolate` with fixed
    ``size`` or ``scale_factor`` (exactly one), ``mode`` and ``align_corners``."""

    def __init__(self, size=None, scale_factor=None, mode="nearest", align_corners=None,
                 recompute_scale_factor=None):
        super().__init__()
        if (size is None) == (scale_factor is None):
            raise ValueError("Upsample: give exactly one of size and scale_factor")
        self.size = size
        if isinstance(scale_factor, (tuple, list)):
            scale_factor = tuple(float(f) for f in scale_factor)
        self.scale_factor = float(scale_factor) if isinstance(scale_factor, (int, float)) \
            else scale_factor
        self.mode, self.align_corners = mode, align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input):  # noqa: A002
        return F.interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                             recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self) -> str:
        what = (f"scale_factor={self.scale_factor!r}" if self.scale_factor is not None
                else f"size={self.size!r}")
        return f"{what}, mode={self.mode!r}"


class PixelShuffle(Module):
    """``torch.nn.PixelShuffle``: (*, C r^2, H, W) -> (*, C, H r, W r)."""

    def __init__(self, upscale_factor: int):
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, input):  # noqa: A002
        return F.pixel_shuffle(input, self.upscale_factor)

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"


class PixelUnshuffle(Module):
    """``torch.nn.PixelUnshuffle``: (*, C, H r, W r) -> (*, C r^2, H, W)."""

    def __init__(self, downscale_factor: int):
        super().__init__()
        self.downscale_factor = downscale_factor

    def forward(self, input):  # noqa: A002
        return F.pixel_unshuffle(input, self.downscale_factor)

    def extra_repr(self) -> str:
        return f"downscale_factor={self.downscale_factor}"


class Dropout2d(Dropout):
    """Zeroes whole channels of (N, C, H, W) (or (N, C, L)) with probability ``p`` in
    training (``torch.nn.Dropout2d``; layout-invariant noise, equal to torch's for the
    same seed)."""

    def forward(self, input):  # noqa: A002
        return F.dropout2d(input, self.p, self.training, self.inplace)


class MaxPool3d(MaxPool2d):
    """``torch.nn.MaxPool3d`` over (N, C, D, H, W) or (C, D, H, W); ``return_indices``
    returns ``(values, indices)`` (for :class:`MaxUnpool3d`)."""

    def forward(self, input):  # noqa: A002
        return F.max_pool3d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)


class AvgPool3d(AvgPool2d):
    """``torch.nn.AvgPool3d`` over (N, C, D, H, W) or (C, D, H, W)."""

    def forward(self, input):  # noqa: A002
        return F.avg_pool3d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)


class AdaptiveAvgPool3d(AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool3d``: (N, C, D, H, W) -> (N, C, *output_size)."""

    def forward(self, input):  # noqa: A002
        return F.adaptive_avg_pool3d(input, self.output_size)


class AdaptiveMaxPool1d(AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool1d``: (N, C, L) -> (N, C, output_size)."""

    def forward(self, input):  # noqa: A002
        return F.adaptive_max_pool1d(input, self.output_size, self.return_indices)


class AdaptiveMaxPool3d(AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool3d``: (N, C, D, H, W) -> (N, C, *output_size)."""

    def forward(self, input):  # noqa: A002
        return F.adaptive_max_pool3d(input, self.output_size, self.return_indices)


class _LPPoolNd(Module):
    _n = 1

    def __init__(self, norm_type: float, kernel_size, stride=None, ceil_mode: bool = False):
        super().__init__()
        self.norm_type, self.kernel_size = norm_type, kernel_size
        self.stride, self.ceil_mode = stride, ceil_mode

    def forward(self, input):  # noqa: A002
        lp = (F.lp_pool1d, F.lp_pool2d, F.lp_pool3d)[self._n - 1]
        return lp(input, float(self.norm_type), self.kernel_size, self.stride, self.ceil_mode)

    def extra_repr(self) -> str:
        return (f"norm_type={self.norm_type}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, ceil_mode={self.ceil_mode}")


class LPPool1d(_LPPoolNd):
    """``torch.nn.LPPool1d``: ``(sum over the window of x^p)^(1/p)`` over (N, C, L) or
    (C, L) (:func:`sbpflow.nn.functional.lp_pool1d`; ``p = inf``: max pooling)."""


class LPPool2d(_LPPoolNd):
    """``torch.nn.LPPool2d`` over (N, C, H, W) or (C, H, W)."""

    _n = 2


class LPPool3d(_LPPoolNd):
    """``torch.nn.LPPool3d`` over (N, C, D, H, W) or (C, D, H, W)."""

    _n = 3


class _MaxUnpoolNd(Module):
    _n = 1

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        n = self._n
        self.kernel_size = _ntuple(kernel_size, n)
        self.stride = _ntuple(stride if stride is not None else kernel_size, n)
        self.padding = _ntuple(padding, n)

    def forward(self, input, indices, output_size=None):  # noqa: A002
        unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[self._n - 1]
        return unpool(input, indices, self.kernel_size, self.stride, self.padding, output_size)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxUnpool1d(_MaxUnpoolNd):
    """``torch.nn.MaxUnpool1d``: ``forward(input, indices, output_size=None)`` writes the
    values at the indices of :class:`MaxPool1d` (``return_indices=True``) into zeros
    (:func:`sbpflow.nn.functional.max_unpool1d`: batch and channel splits pass)."""


class MaxUnpool2d(_MaxUnpoolNd):
    """``torch.nn.MaxUnpool2d``: the partial inverse of :class:`MaxPool2d`; see
    :class:`MaxUnpool1d`."""

    _n = 2


class MaxUnpool3d(_MaxUnpoolNd):
    """``torch.nn.MaxUnpool3d``: the partial inverse of :class:`MaxPool3d`; see
    :class:`MaxUnpool1d`."""

    _n = 3


class _FractionalMaxPoolNd(Module):
    _n = 2

    def __init__(self, kernel_size, output_size=None, output_ratio=None,
                 return_indices: bool = False, _random_samples=None):
        super().__init__()
        n = self._n
        name = type(self).__name__
        self.kernel_size = _ntuple(kernel_size, n)
        self.return_indices = return_indices
        self.register_buffer("_random_samples", _random_samples)
        self.output_size = _ntuple(output_size, n) if output_size is not None else None
        self.output_ratio = _ntuple(output_ratio, n) if output_ratio is not None else None
        if output_size is None and output_ratio is None:
            raise ValueError(f"{name} requires specifying either an output size, or a "
                             f"pooling ratio")
        if output_size is not None and output_ratio is not None:
            raise ValueError("only one of output_size and output_ratio may be specified")
        if self.output_ratio is not None and not all(0 < r < 1 for r in self.output_ratio):
            raise ValueError(f"output_ratio must be between 0 and 1 (got {output_ratio})")

    def forward(self, input):  # noqa: A002
        pool = F.fractional_max_pool2d if self._n == 2 else F.fractional_max_pool3d
        return pool(input, self.kernel_size, self.output_size, self.output_ratio,
                    self.return_indices, _random_samples=self._random_samples)


class FractionalMaxPool2d(_FractionalMaxPoolNd):
    """``torch.nn.FractionalMaxPool2d`` (Graham, arXiv:1412.6071) over (N, C, H, W) or
    (C, H, W): random pooling regions, drawn layout invariantly (with the same seed the
    global result is torch's on one process, under every layout; see
    :func:`sbpflow.nn.functional.fractional_max_pool2d`). ``_random_samples`` (a buffer,
    None by default) fixes them.

    Raises:
        ValueError: neither or both of ``output_size`` and ``output_ratio``, or a ratio
            outside (0, 1).
    """


class FractionalMaxPool3d(_FractionalMaxPoolNd):
    """``torch.nn.FractionalMaxPool3d`` over (N, C, T, H, W) or (C, T, H, W); see
    :class:`FractionalMaxPool2d`."""

    _n = 3


class UpsamplingNearest2d(Upsample):
    """``torch.nn.UpsamplingNearest2d``: :class:`Upsample` with ``mode='nearest'``."""

    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """``torch.nn.UpsamplingBilinear2d``: :class:`Upsample` with ``mode='bilinear'`` and
    ``align_corners=True``."""

    def __init__(self, size=None, scale_factor=None):
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


class ChannelShuffle(Module):
    """``torch.nn.ChannelShuffle(groups)``: :func:`sbpflow.nn.functional.channel_shuffle`
    of (N, C, *) (every split but the channels' passes)."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, input):  # noqa: A002
        return F.channel_shuffle(input, self.groups)

    def extra_repr(self) -> str:
        return f"groups={self.groups}"


class Fold(Module):
    """``torch.nn.Fold``: columns (N, C * prod(kernel_size), L) summed back into (N, C,
    *output_size) (col2im; :func:`sbpflow.nn.functional.fold`, batch split passes)."""

    def __init__(self, output_size, kernel_size, dilation=1, padding=0, stride=1):
        super().__init__()
        self.output_size, self.kernel_size = output_size, kernel_size
        self.dilation, self.padding, self.stride = dilation, padding, stride

    def forward(self, input):  # noqa: A002
        return F.fold(input, self.output_size, self.kernel_size, self.dilation, self.padding,
                      self.stride)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, padding={self.padding}, stride={self.stride}")


class Unfold(Module):
    """``torch.nn.Unfold``: sliding blocks of (N, C, H, W) as columns (N, C *
    prod(kernel_size), L) (im2col; :func:`sbpflow.nn.functional.unfold`)."""

    def __init__(self, kernel_size, dilation=1, padding=0, stride=1):
        super().__init__()
        self.kernel_size, self.dilation, self.padding, self.stride = (kernel_size, dilation,
                                                                      padding, stride)

    def forward(self, input):  # noqa: A002
        return F.unfold(input, self.kernel_size, self.dilation, self.padding, self.stride)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, dilation={self.dilation}, "
                f"padding={self.padding}, stride={self.stride}")
