"""sbpflow.nn.functional: torch.nn.functional's ops on local and global tensors.

Every function takes torch's arguments and defaults. On local tensors it is the torch
function; on global tensors the output layout follows the inputs' (the registered ops,
their one-axis SBP rules and global algorithms are in :mod:`sbpflow.ops.nn`; every call
runs through :func:`sbpflow.ops.dispatch.dispatch`), with these distributed algorithms
instead of gathers:

* ``softmax``/``log_softmax`` over a split dim: local max, all-reduce MAX, local sum of
  exponentials, all-reduce SUM (each of shape ``dim`` -> 1);
* ``cross_entropy``/``nll_loss`` on class-split logits (vocabulary-parallel): the above,
  the target's log-probability picked by the rank holding its class (others 0, P),
  reductions that give P; the logits are never gathered;
* ``embedding`` with the weight split on the vocabulary (S(0)): each rank looks up the
  ids in its range, zeros elsewhere: output P;
* ``embedding_bag`` with the weight split by rows (S(0)): each rank deduplicates its ids,
  one all-gather of counts, an all-to-all of ids to the owners and one of rows back, local
  pooling (torch's kernel); backward two all-to-alls (:mod:`sbpflow.nn._sharded_lookup`);
* ``batch_norm`` on a split batch: statistics are means that give P and are all-reduced.
* ``softmin`` is ``softmax(-x)`` (same collectives); ``glu`` over a split dim re-splits
  another dim (all-to-all) or gathers; the other activations and pointwise losses are one
  elementwise op each (:mod:`sbpflow.ops.nn`).
* random ops (``dropout``, ``dropout1d/2d/3d``, ``alpha_dropout``,
  ``feature_alpha_dropout``, ``rrelu`` in training, ``gumbel_softmax``) are layout
  invariant: the noise is drawn whole as torch draws it, on every rank, and each rank
  keeps its part, so the result equals torch's on one process for the same seed;
* ``multi_head_attention_forward`` keeps the heads as a dim of their own, so a split
  batch stays split through the projections, the attention and the masks.

Losses with ``reduction`` ``'mean'``/``'sum'`` return a 0-dim tensor that is usually P
(box it with ``.to_global(sbp=broadcast)`` to read the same value everywhere; ``item()``
and ``numpy()`` do it for you).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from .. import random as _rng
from ..ops import api as _api
from ..ops.algorithms import unpartial as _no_partial
from ..ops.args import norm_dim
from ..ops.cast import in_float32
from ..ops.creation import full, full_like, rand, replay_draw, zeros_like
from ..ops.dispatch import dispatch, dispatch_inplace
from ..ops.index import one_hot  # torch.nn.functional.one_hot
from ..ops.matmul import einsum
from ..ops.nn import pick_target_layout
from ..ops.nn import prelu as _prelu_op
from ..ops.nn import softmax as _softmax_op
from ..ops.pointwise import where as sbp_where
from ..ops.random import dropout as _dropout
from ..ops.random import memory_order
from ..ops.view import cat as _cat
from ..sbp import broadcast
from ..tensor import Tensor
from ._embedding_bag import embedding_bag  # noqa: F401 - torch.nn.functional.embedding_bag

__all__ = [
    "one_hot", "leaky_relu", "elu", "normalize", "cosine_similarity", "smooth_l1_loss",
    "binary_cross_entropy", "celu", "cosine_embedding_loss", "glu", "hardshrink",
    "hardsigmoid", "hardswish", "hardtanh", "huber_loss", "kl_div", "logsigmoid",
    "margin_ranking_loss", "mish", "pairwise_distance", "prelu", "relu6", "selu", "softmin",
    "softshrink", "softsign", "tanhshrink", "threshold", "triplet_margin_loss",
    "adaptive_avg_pool2d", "avg_pool2d", "batch_norm", "binary_cross_entropy_with_logits",
    "conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d", "cross_entropy", "dropout",
    "embedding", "embedding_bag", "gelu", "group_norm", "max_pool1d", "avg_pool1d",
    "adaptive_avg_pool1d",
    "adaptive_max_pool2d", "pixel_shuffle", "pixel_unshuffle", "instance_norm", "dropout2d",
    "interpolate", "l1_loss", "layer_norm", "linear", "log_softmax", "max_pool2d",
    "mse_loss", "nll_loss", "pad", "relu", "rms_norm", "scaled_dot_product_attention",
    "sigmoid", "silu", "softmax", "softplus", "tanh",
    # structured ops (issue 21)
    "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool3d", "affine_grid",
    "avg_pool3d", "bilinear", "channel_shuffle", "conv3d", "conv_tbc", "conv_transpose3d",
    "fold", "fractional_max_pool2d", "fractional_max_pool3d", "grid_sample",
    "local_response_norm", "lp_pool1d", "lp_pool2d", "lp_pool3d", "max_pool3d",
    "max_unpool1d", "max_unpool2d", "max_unpool3d", "pdist", "unfold", "upsample",
    "upsample_bilinear", "upsample_nearest",
    # issue 21: random ops, in-place activations, losses, attention
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout3d", "gumbel_softmax",
    "rrelu", "rrelu_", "relu_", "elu_", "celu_", "selu_", "hardtanh_", "leaky_relu_",
    "threshold_", "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss",
    "soft_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "multilabel_margin_loss", "triplet_margin_with_distance_loss", "ctc_loss",
    "linear_cross_entropy", "multi_head_attention_forward", "grouped_mm",
]

_REDUCTIONS = ("none", "mean", "sum")


# ------------------------------------------------------------------ helpers
def _check(name: str, **tensors) -> None:
    """Tensors must be sbpflow Tensors, all local or all global on one placement."""
    given = {k: t for k, t in tensors.items() if t is not None}
    for k, t in given.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {k} is a {type(t).__name__}, expected an sbpflow.Tensor "
                            f"(wrap torch tensors with sbpflow.from_torch)")
    kinds = {k: t.is_global for k, t in given.items()}
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{k} {'global' if g else 'local'}" for k, g in kinds.items())
        raise TypeError(f"{name}: inputs mix local and global tensors ({desc}); convert the "
                        f"local ones with x.to_global(placement, sbp)")
    pls = {t.placement for t in given.values() if t.is_global}
    if len(pls) > 1:
        raise ValueError(f"{name}: inputs live on different placements {sorted(map(repr, pls))}; "
                         f"move them with x.to_global(placement=...)")


def _t(x):
    return None if x is None else x._local


def _opt(name: str, inputs, *pairs, **attrs) -> Tensor:
    """``dispatch(name, *inputs, <the given optional tensors>, parts=<their names>, **attrs)``."""
    given = [(k, t) for k, t in pairs if t is not None]
    return dispatch(name, *inputs, *(t for _, t in given), parts=tuple(k for k, _ in given),
                 **attrs)


def _dim(dim: int, ndim: int, name: str) -> int:
    return norm_dim(dim, ndim, f"{name}: dim")


def _reduce(loss: Tensor, reduction: str, denom=None) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if denom is None:
        return loss.mean()
    return loss.sum() / denom


def _check_reduction(name: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _map_local(x: Tensor, fn) -> Tensor:
    """A non-differentiable elementwise map of a (not P) global or local tensor."""
    with torch.no_grad():
        out = fn(x._local)
    if x.is_local:
        return Tensor(out)
    return Tensor(out, x.placement, x.sbp, x.shape)


# ------------------------------------------------------------------ linear, convolution
def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:  # noqa: A002
    """``y = input @ weight.T + bias`` (``torch.nn.functional.linear``).

    Shapes: input (..., in), weight (out, in), bias (out,) -> (..., out).
    SBP (from the einsum ``...i,oi->...o``): batch splits pass; column-parallel weight S(0)
    (bias S(0)) gives S(last); row-parallel weight S(1) with input S(last) gives P (bias P:
    a B bias is kept by one rank, no communication); P input or weight gives P.
    """
    _check("linear", input=input, weight=weight, bias=bias)
    return _opt("nn.linear", (input, weight), ("bias", bias))


def bilinear(input1, input2, weight, bias=None):
    """``y[..., o] = sum_ij input1[..., i] weight[o, i, j] input2[..., j] + bias[o]``
    (``torch.nn.functional.bilinear``).

    Shapes: input1 (..., in1), input2 (..., in2) with the same leading dims, weight
    (out, in1, in2), bias (out,) -> (..., out). Composed of two einsums as torch's
    ``_trilinear`` computes it (``...i,oij->...oj``, then ``...oj,...j->...o``), so their
    rules apply: batch splits pass; weight S(0) (bias S(0)) -> output split on its last
    dim; input1 S(last) with weight S(1), or input2 S(last) with weight S(2) -> P (bias
    P); P in one operand -> P.

    Raises:
        ValueError: shapes that do not fit together.
    """
    _check("bilinear", input1=input1, input2=input2, weight=weight, bias=bias)
    if weight.ndim != 3 or input1.ndim == 0 or input1.shape[:-1] != input2.shape[:-1] or \
            input1.shape[-1] != weight.shape[1] or input2.shape[-1] != weight.shape[2] or \
            (bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bilinear: expected input1 (..., in1), input2 (..., in2) with the "
                         f"same leading dims, weight (out, in1, in2) and bias (out,), got "
                         f"{tuple(input1.shape)}, {tuple(input2.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}")
    y = einsum("...oj,...j->...o", einsum("...i,oij->...oj", input1, weight), input2)
    return y if bias is None else y + bias


def _conv(name, spatial, input, weight, bias, stride, padding, dilation, groups):
    _check(name, input=input, weight=weight, bias=bias)
    if input.ndim not in (spatial + 1, spatial + 2):
        raise ValueError(f"{name}: expected a {spatial + 1}-D (unbatched) or {spatial + 2}-D "
                         f"input, got shape {tuple(input.shape)}")
    return _opt("nn." + name, (input, weight), ("bias", bias), stride=stride, padding=padding,
                dilation=dilation, groups=groups)


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """1-D convolution (``torch.nn.functional.conv1d``).

    Shapes: input (N, C_in, L) or (C_in, L), weight (C_out, C_in / groups, k), bias (C_out,).
    ``padding``: int, tuple, ``'valid'`` or ``'same'``. SBP: batch S(0) -> S(0); with
    ``groups == 1`` weight S(0) (bias S(0)) -> channel split, input and weight split on the
    input channels -> P (bias P); P input or weight -> P. Other layouts are gathered.
    """
    return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """2-D convolution (``torch.nn.functional.conv2d``); layouts as :func:`conv1d`.

    Shapes: input (N, C_in, H, W) or (C_in, H, W), weight (C_out, C_in / groups, kH, kW).
    """
    return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """3-D convolution (``torch.nn.functional.conv3d``); layouts as :func:`conv1d`.

    Shapes: input (N, C_in, D, H, W) or (C_in, D, H, W), weight (C_out, C_in / groups, kD,
    kH, kW), bias (C_out,) -> (N, C_out, D_out, H_out, W_out). SBP: batch S(0) -> S(0)
    (weight B: data parallel, no collective); with ``groups == 1`` weight S(0) (bias S(0))
    -> output channels split, input and weight split on the input channels -> P (bias P);
    P input or weight -> P. Other layouts (a split D, H or W) are gathered.

    Raises:
        ValueError: an input that is not 4-D or 5-D (torch's kernel checks the rest).
    """
    return _conv("conv3d", 3, input, weight, bias, stride, padding, dilation, groups)


def conv_tbc(input, weight, bias, pad=0):  # noqa: A002
    """1-D convolution over time-major sequences (``torch.conv_tbc``,
    ``torch.nn.functional.conv_tbc``): input (T, B, C_in), weight (k, C_in, C_out), bias
    (C_out,) -> (T + 2 * pad - k + 1, B, C_out).

    SBP: the batch S(1) -> S(1) (weight, bias B); weight S(2) (bias S(0)) -> output
    channels split S(2); input S(2) with weight S(1) (bias P) -> P (input channels
    contracted); P input or weight (bias P) -> P. A split T is gathered.

    Raises:
        ValueError: inputs that are not 3-D / 3-D / 1-D, or channels that do not match.
    """
    _check("conv_tbc", input=input, weight=weight, bias=bias)
    if input.ndim != 3 or weight.ndim != 3 or bias is None or bias.ndim != 1:
        raise ValueError(f"conv_tbc: expected input (T, B, C_in), weight (k, C_in, C_out) and "
                         f"bias (C_out,), got {tuple(input.shape)}, {tuple(weight.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    if input.shape[2] != weight.shape[1] or bias.shape[0] != weight.shape[2]:
        raise ValueError(f"conv_tbc: input channels {input.shape[2]} and bias {bias.shape[0]} "
                         f"must match the weight's dims 1 and 2, weight {tuple(weight.shape)}")
    return dispatch("nn.conv_tbc", input, weight, bias, pad=int(pad))


def _conv_transpose(name, spatial, input, weight, bias, stride, padding, output_padding,
                    groups, dilation):
    _check(name, input=input, weight=weight, bias=bias)
    if input.ndim not in (spatial + 1, spatial + 2):
        raise ValueError(f"{name}: expected a {spatial + 1}-D (unbatched) or {spatial + 2}-D "
                         f"input, got shape {tuple(input.shape)}")
    if weight.ndim != spatial + 2:
        raise ValueError(f"{name}: weight must be (C_in, C_out / groups, {'k, ' * spatial}"
                         f"...)-shaped with {spatial + 2} dims, got {tuple(weight.shape)}")
    c = input.shape[1 if input.ndim == spatial + 2 else 0]
    if c != weight.shape[0]:
        raise ValueError(f"{name}: input has {c} channels but weight {tuple(weight.shape)} "
                         f"expects {weight.shape[0]} (weight is (C_in, C_out / groups, k...))")
    return _opt("nn." + name, (input, weight), ("bias", bias), stride=stride, padding=padding,
                output_padding=output_padding, groups=groups, dilation=dilation)


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0,  # noqa: A002
                     groups=1, dilation=1):
    """1-D transposed convolution (``torch.nn.functional.conv_transpose1d``; note torch's
    argument order: ``groups`` before ``dilation``).

    Shapes: input (N, C_in, L) or (C_in, L), weight (C_in, C_out / groups, k), bias
    (C_out,) -> (N, C_out, (L - 1) * stride - 2 * padding + dilation * (k - 1) +
    output_padding + 1). SBP: batch S(0) -> S(0) (weight B); with ``groups == 1`` weight
    S(1) (bias S(0)) -> output channels split, input channels split with weight S(0) -> P
    (bias P); P input or weight -> P. Other layouts are gathered.

    Raises:
        ValueError: wrong ranks, or input channels that do not match the weight's dim 0.
    """
    return _conv_transpose("conv_transpose1d", 1, input, weight, bias, stride, padding,
                           output_padding, groups, dilation)


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0,  # noqa: A002
                     groups=1, dilation=1):
    """2-D transposed convolution (``torch.nn.functional.conv_transpose2d``); layouts and
    errors as :func:`conv_transpose1d`. Shapes: input (N, C_in, H, W) or (C_in, H, W),
    weight (C_in, C_out / groups, kH, kW)."""
    return _conv_transpose("conv_transpose2d", 2, input, weight, bias, stride, padding,
                           output_padding, groups, dilation)


def conv_transpose3d(input, weight, bias=None, stride=1, padding=0, output_padding=0,  # noqa: A002
                     groups=1, dilation=1):
    """3-D transposed convolution (``torch.nn.functional.conv_transpose3d``); layouts and
    errors as :func:`conv_transpose1d`. Shapes: input (N, C_in, D, H, W) or (C_in, D, H,
    W), weight (C_in, C_out / groups, kD, kH, kW), bias (C_out,)."""
    return _conv_transpose("conv_transpose3d", 3, input, weight, bias, stride, padding,
                           output_padding, groups, dilation)


# ------------------------------------------------------------------ pooling and resampling
_SPATIAL_NAMES = {1: "L", 2: "H, W", 3: "D, H, W"}


def _spatial_input(name: str, x: Tensor, ndims=(3, 4)) -> None:
    _check(name, input=x)
    if x.ndim not in ndims:
        sp = _SPATIAL_NAMES.get(max(ndims) - 2) if len(ndims) == 2 else None
        shapes = f"(N, C, {sp}) or (C, {sp})" if sp else "(N, C, *spatial)"
        raise ValueError(f"{name}: expected an input with {' or '.join(map(str, ndims))} dims "
                         f"({shapes}), got shape {tuple(x.shape)}")


def _ntuple(v, n: int) -> tuple:
    """torch's ``_single``/``_pair``/``_triple``: an int repeated, or the sequence as is."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    """2-D max pooling (``torch.nn.functional.max_pool2d``); input (N, C, H, W) or (C, H, W).

    SBP: batch and channel splits pass (H, W are gathered); with ``return_indices`` returns
    ``(values, indices)``, indices int64 laid out like the values.
    """
    _spatial_input("max_pool2d", input)
    kw = dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode)
    out = dispatch("nn.max_pool2d", _no_partial(input), **kw)
    if return_indices:
        return out, dispatch("nn.max_pool2d_indices", _no_partial(input).detach(), **kw)
    return out


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,  # noqa: A002
               count_include_pad=True, divisor_override=None):
    """2-D average pooling (``torch.nn.functional.avg_pool2d``). SBP: batch and channel
    splits pass; P -> P (linear)."""
    _spatial_input("avg_pool2d", input)
    return dispatch("nn.avg_pool2d", input, kernel_size=kernel_size, stride=stride, padding=padding,
                 ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                 divisor_override=divisor_override)


def adaptive_avg_pool2d(input, output_size):  # noqa: A002
    """Adaptive average pooling to ``output_size`` (``torch.nn.functional.
    adaptive_avg_pool2d``). SBP: batch and channel splits pass; P -> P."""
    _spatial_input("adaptive_avg_pool2d", input)
    return dispatch("nn.adaptive_avg_pool2d", input, output_size=output_size)


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    """1-D max pooling (``torch.nn.functional.max_pool1d``); input (N, C, L) or (C, L).
    SBP: batch and channel splits pass (L is gathered); P is summed first. With
    ``return_indices`` returns ``(values, indices)`` (int64, laid out like the values)."""
    _spatial_input("max_pool1d", input, (2, 3))
    kw = dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation,
              ceil_mode=ceil_mode)
    return dispatch("nn.max_pool1d", _no_partial(input), **kw, return_indices=return_indices)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False,  # noqa: A002
               count_include_pad=True):
    """1-D average pooling (``torch.nn.functional.avg_pool1d``); input (N, C, L) or (C, L).
    SBP: batch and channel splits pass; P -> P (linear)."""
    _spatial_input("avg_pool1d", input, (2, 3))
    return dispatch("nn.avg_pool1d", input, kernel_size=kernel_size, stride=stride,
                 padding=padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad)


def adaptive_avg_pool1d(input, output_size):  # noqa: A002
    """Adaptive average pooling of (N, C, L) or (C, L) to length ``output_size``
    (``torch.nn.functional.adaptive_avg_pool1d``). SBP: batch and channel splits pass;
    P -> P."""
    _spatial_input("adaptive_avg_pool1d", input, (2, 3))
    return dispatch("nn.adaptive_avg_pool1d", input, output_size=output_size)


def adaptive_max_pool2d(input, output_size, return_indices=False):  # noqa: A002
    """Adaptive max pooling of (N, C, H, W) or (C, H, W) to ``output_size``
    (``torch.nn.functional.adaptive_max_pool2d``). SBP: batch and channel splits pass; P
    is summed first. ``return_indices``: also the int64 indices, laid out like the values."""
    _spatial_input("adaptive_max_pool2d", input)
    out = dispatch("nn.adaptive_max_pool2d", _no_partial(input), output_size=output_size)
    if return_indices:
        return out, dispatch("nn.adaptive_max_pool2d_indices", _no_partial(input).detach(),
                          output_size=output_size)
    return out


def max_pool3d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    """3-D max pooling (``torch.nn.functional.max_pool3d``); input (N, C, D, H, W) or
    (C, D, H, W). SBP: batch and channel splits pass (D, H, W are gathered); a P input is
    summed first. With ``return_indices`` returns ``(values, indices)`` (int64 flat indices
    into each (n, c) volume, laid out like the values; :func:`max_unpool3d` takes them).

    Raises:
        ValueError: an input that is not 4-D or 5-D.
    """
    _spatial_input("max_pool3d", input, (4, 5))
    return dispatch("nn.max_pool3d", _no_partial(input), kernel_size=kernel_size, stride=stride,
                    padding=padding, dilation=dilation, ceil_mode=ceil_mode,
                    return_indices=return_indices)


def avg_pool3d(input, kernel_size, stride=None, padding=0, ceil_mode=False,  # noqa: A002
               count_include_pad=True, divisor_override=None):
    """3-D average pooling (``torch.nn.functional.avg_pool3d``); input (N, C, D, H, W) or
    (C, D, H, W). SBP: batch and channel splits pass; P -> P (linear).

    Raises:
        ValueError: an input that is not 4-D or 5-D.
    """
    _spatial_input("avg_pool3d", input, (4, 5))
    return dispatch("nn.avg_pool3d", input, kernel_size=kernel_size, stride=stride,
                    padding=padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                    divisor_override=divisor_override)


def adaptive_avg_pool3d(input, output_size):  # noqa: A002
    """Adaptive average pooling of (N, C, D, H, W) or (C, D, H, W) to ``output_size``
    (an int or (D_out, H_out, W_out), None keeping that dim; ``torch.nn.functional.
    adaptive_avg_pool3d``). SBP: batch and channel splits pass; P -> P."""
    _spatial_input("adaptive_avg_pool3d", input, (4, 5))
    return dispatch("nn.adaptive_avg_pool3d", input, output_size=output_size)


def adaptive_max_pool1d(input, output_size, return_indices=False):  # noqa: A002
    """Adaptive max pooling of (N, C, L) or (C, L) to length ``output_size``
    (``torch.nn.functional.adaptive_max_pool1d``). SBP: batch and channel splits pass; P
    is summed first. ``return_indices``: also the int64 indices, laid out like the values."""
    _spatial_input("adaptive_max_pool1d", input, (2, 3))
    return dispatch("nn.adaptive_max_pool1d", _no_partial(input), output_size=output_size,
                    return_indices=return_indices)


def adaptive_max_pool3d(input, output_size, return_indices=False):  # noqa: A002
    """Adaptive max pooling of (N, C, D, H, W) or (C, D, H, W) to ``output_size``
    (``torch.nn.functional.adaptive_max_pool3d``); layouts as :func:`adaptive_max_pool1d`."""
    _spatial_input("adaptive_max_pool3d", input, (4, 5))
    return dispatch("nn.adaptive_max_pool3d", _no_partial(input), output_size=output_size,
                    return_indices=return_indices)


def _lp_pool(n: int, input, norm_type, kernel_size, stride, ceil_mode):  # noqa: A002
    """torch's ``lp_pool{n}d``, composed as torch composes it (so the layouts are those of
    ``pow``, ``avg_pool{n}d`` and the pointwise ops): ``(sum over the window of x^p)^(1/p)``
    computed as ``(sign(a) * relu(|a|) * prod(kernel)) ^ (1/p)``, ``a = avg_pool(x^p)``;
    ``p = inf``: ``max_pool(|x|)``, ``p = -inf``: ``-max_pool(-|x|)``."""
    name = f"lp_pool{n}d"
    _spatial_input(name, input, (n + 1, n + 2))
    max_pool, avg_pool = {1: (max_pool1d, avg_pool1d), 2: (max_pool2d, avg_pool2d),
                          3: (max_pool3d, avg_pool3d)}[n]
    if isinstance(norm_type, (int, float)):
        if norm_type == math.inf:
            return max_pool(input.abs(), kernel_size, stride, 0, 1, ceil_mode)
        if norm_type == -math.inf:
            return -max_pool(-input.abs(), kernel_size, stride, 0, 1, ceil_mode)
    out = avg_pool(input.pow(norm_type), kernel_size, stride, 0, ceil_mode)
    size = math.prod(_ntuple(kernel_size, n))
    return (out.sign() * relu(out.abs())).mul(size).pow(1.0 / norm_type)


def lp_pool1d(input, norm_type, kernel_size, stride=None, ceil_mode=False):  # noqa: A002
    """Power-average pooling ``(sum_{window} x^p)^(1/p)`` over (N, C, L) or (C, L)
    (``torch.nn.functional.lp_pool1d``; ``stride`` defaults to ``kernel_size``; no padding).
    Composed as torch composes it, from ``pow``, :func:`avg_pool1d` and pointwise ops
    (``p = inf``: :func:`max_pool1d` of ``|x|``), so their layouts apply: batch and channel
    splits pass; a P input is summed first (``pow`` is not linear). A window whose sum of
    powers is 0 gets gradient 0, as torch's.

    Raises:
        ValueError: an input that is not 2-D or 3-D.
    """
    return _lp_pool(1, input, norm_type, kernel_size, stride, ceil_mode)


def lp_pool2d(input, norm_type, kernel_size, stride=None, ceil_mode=False):  # noqa: A002
    """Power-average pooling over (N, C, H, W) or (C, H, W) (``torch.nn.functional.
    lp_pool2d``); composition and layouts as :func:`lp_pool1d` (with :func:`avg_pool2d`)."""
    return _lp_pool(2, input, norm_type, kernel_size, stride, ceil_mode)


def lp_pool3d(input, norm_type, kernel_size, stride=None, ceil_mode=False):  # noqa: A002
    """Power-average pooling over (N, C, D, H, W) or (C, D, H, W) (``torch.nn.functional.
    lp_pool3d``); composition and layouts as :func:`lp_pool1d` (with :func:`avg_pool3d`)."""
    return _lp_pool(3, input, norm_type, kernel_size, stride, ceil_mode)


def _max_unpool(n: int, input, indices, kernel_size, stride, padding, output_size):  # noqa: A002
    name = f"max_unpool{n}d"
    _check(name, input=input, indices=indices)
    _spatial_input(name, input, (n + 1, n + 2))
    if tuple(indices.shape) != tuple(input.shape):
        raise ValueError(f"{name}: indices of shape {tuple(indices.shape)} must have the "
                         f"input's shape {tuple(input.shape)}")
    if indices.dtype != torch.int64:
        raise TypeError(f"{name}: elements in indices should be type int64 but got: "
                        f"{indices.dtype}")
    k = _ntuple(kernel_size, n)
    st = k if stride is None else _ntuple(stride, n)
    pad = _ntuple(padding, n)
    # torch's _unpool_output_size, on the global shape
    default = [(input.shape[input.ndim - n + d] - 1) * st[d] + k[d] - 2 * pad[d]
               for d in range(n)]
    if output_size is None:
        size = default
    else:
        size = list(output_size)
        if len(size) == n + 2:
            size = size[2:]
        if len(size) != n:
            raise ValueError(f"output_size should be a sequence containing {n} or {n + 2} "
                             f"elements, but it has a length of '{len(size)}'")
        for d in range(n):
            if not default[d] - st[d] < size[d] < default[d] + st[d]:
                raise ValueError(f'invalid output_size "{tuple(output_size)}" (dim {d} must '
                                 f"be between {default[d] - st[d]} and {default[d] + st[d]})")
    if any(v < 0 for v in size):
        raise ValueError(f"{name}: output_size must contain non-negative spatial dimensions, "
                         f"got {tuple(size)}")
    return dispatch("nn." + name, input, indices, kernel_size=k, stride=st, padding=pad,
                    output_size=tuple(int(v) for v in size))


def max_unpool1d(input, indices, kernel_size, stride=None, padding=0,  # noqa: A002
                 output_size=None):
    """Partial inverse of :func:`max_pool1d` (``torch.nn.functional.max_unpool1d``): the
    values of (N, C, L_in) or (C, L_in) are written at their ``indices`` (int64, the
    input's shape, as max pooling with ``return_indices`` gives them) of a zero
    (N, C, L_out) output; ``L_out = (L_in - 1) * stride + kernel_size - 2 * padding`` or
    ``output_size`` (within ``stride`` of it).

    SBP: the indices address each (n, c) row, so a batch or channel split passes when the
    input and the indices are split alike (the chooser boxes them to a common one); linear
    in the input: P input with B indices -> P.

    Raises:
        ValueError: wrong ranks, indices of another shape, an invalid ``output_size``.
        TypeError: indices that are not int64.
    """
    return _max_unpool(1, input, indices, kernel_size, stride, padding, output_size)


def max_unpool2d(input, indices, kernel_size, stride=None, padding=0,  # noqa: A002
                 output_size=None):
    """Partial inverse of :func:`max_pool2d` (``torch.nn.functional.max_unpool2d``) on
    (N, C, H, W) or (C, H, W); shapes, layouts and errors as :func:`max_unpool1d`."""
    return _max_unpool(2, input, indices, kernel_size, stride, padding, output_size)


def max_unpool3d(input, indices, kernel_size, stride=None, padding=0,  # noqa: A002
                 output_size=None):
    """Partial inverse of :func:`max_pool3d` (``torch.nn.functional.max_unpool3d``) on
    (N, C, D, H, W) or (C, D, H, W); shapes, layouts and errors as :func:`max_unpool1d`."""
    return _max_unpool(3, input, indices, kernel_size, stride, padding, output_size)


def _fractional_max_pool(n: int, input, kernel_size, output_size, output_ratio,  # noqa: A002
                         return_indices, _random_samples):
    name = f"fractional_max_pool{n}d"
    _check(name, input=input, _random_samples=_random_samples)
    _spatial_input(name, input, (n + 1, n + 2))
    if output_size is None and output_ratio is None:
        raise ValueError(f"{name} requires specifying either an output_size or an "
                         f"output_ratio")
    if output_size is None:
        if n == 2 and isinstance(output_ratio, (tuple, list)) and len(output_ratio) > 2:
            raise ValueError("fractional_max_pool2d requires output_ratio to either be a "
                             "single Int or tuple of Ints.")
        ratio = _ntuple(output_ratio, n)
        output_size = [int(input.shape[input.ndim - n + d] * ratio[d]) for d in range(n)]
    batched = input.ndim == n + 2
    x = input if batched else input.unsqueeze(0)
    samples = _random_samples
    if samples is None:
        # torch's draw: rand(N, C, n) in the input's dtype (N = 1 unbatched); drawn whole
        # on every rank (layout invariant: torch's samples for the same seed), B
        pl = x.placement
        samples = rand(x.shape[0], x.shape[1], n, dtype=x.dtype, device=x.device,
                       placement=pl, sbp=None if pl is None else (broadcast,) * pl.ndim)
    out = dispatch("nn." + name, _no_partial(x), samples, kernel_size=_ntuple(kernel_size, n),
                   output_size=_ntuple(output_size, n), return_indices=return_indices)
    if batched:
        return out
    return tuple(o.squeeze(0) for o in out) if return_indices else out.squeeze(0)


def fractional_max_pool2d(input, kernel_size, output_size=None, output_ratio=None,  # noqa: A002
                          return_indices=False, _random_samples=None):
    """Fractional max pooling (Graham, "Fractional Max-Pooling", arXiv:1412.6071;
    ``torch.nn.functional.fractional_max_pool2d``): ``kernel_size`` windows at
    pseudo-random steps chosen so that (N, C, H, W) or (C, H, W) becomes ``output_size``
    (or ``output_ratio`` times the input's H, W). ``return_indices``: also the int64 flat
    indices (for :func:`max_unpool2d`).

    Random, layout invariant: the step offsets ``_random_samples`` (N, C, 2) (N = 1
    unbatched) are drawn as torch draws them (``rand`` in the input's dtype), whole on
    every rank (:mod:`sbpflow.random`), so with the same seed the global result equals
    torch's on one process under every layout. Pass ``_random_samples`` (global, like the
    input) to fix them.

    SBP: a batch or channel split passes, the samples split alike (no communication); a
    split H or W is gathered; a P input is summed first.

    Raises:
        ValueError: neither ``output_size`` nor ``output_ratio``, an input that is not 3-D
            or 4-D (torch's kernel checks the window fits).
    """
    return _fractional_max_pool(2, input, kernel_size, output_size, output_ratio,
                                return_indices, _random_samples)


def fractional_max_pool3d(input, kernel_size, output_size=None, output_ratio=None,  # noqa: A002
                          return_indices=False, _random_samples=None):
    """Fractional max pooling of (N, C, T, H, W) or (C, T, H, W) (``torch.nn.functional.
    fractional_max_pool3d``), samples (N, C, 3); randomness, layouts and errors as
    :func:`fractional_max_pool2d`."""
    return _fractional_max_pool(3, input, kernel_size, output_size, output_ratio,
                                return_indices, _random_samples)


def _shuffle(name, input, factor, grow):  # noqa: A002
    _check(name, input=input)
    if input.ndim < 3:
        raise ValueError(f"{name}: expected an input with at least 3 dims (*, C, H, W), got "
                         f"shape {tuple(input.shape)}")
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"{name}: the factor must be a positive int, got {factor!r}")
    c, h, w = input.shape[-3:]
    if grow and c % (factor * factor):
        raise ValueError(f"pixel_shuffle: channels ({c}) must be divisible by "
                         f"upscale_factor ** 2 ({factor * factor})")
    if not grow and (h % factor or w % factor):
        raise ValueError(f"pixel_unshuffle: height ({h}) and width ({w}) must be divisible by "
                         f"downscale_factor ({factor})")
    key = "upscale_factor" if grow else "downscale_factor"
    return dispatch("nn." + name, input, **{key: factor})


def channel_shuffle(input, groups):  # noqa: A002
    """Interleave the channels of (N, C, *) in ``groups`` (ShuffleNet;
    ``torch.nn.functional.channel_shuffle``): channel ``g * (C / groups) + i`` moves to
    ``i * groups + g``.

    SBP: a split of any dim but C passes; P -> P (a permutation); a split C is gathered.

    Raises:
        ValueError: fewer than 3 dims, or C not divisible by ``groups``.
    """
    _check("channel_shuffle", input=input)
    if input.ndim < 3:
        raise ValueError(f"channel_shuffle expects input with > 2 dims, but got input with "
                         f"sizes {list(input.shape)}")
    if not isinstance(groups, int) or groups <= 0 or input.shape[1] % groups:
        raise ValueError(f"Number of channels must be divisible by groups. Got "
                         f"{input.shape[1]} channels and {groups} groups.")
    return dispatch("nn.channel_shuffle", input, groups=groups)


def pixel_shuffle(input, upscale_factor):  # noqa: A002
    """(*, C * r^2, H, W) -> (*, C, H * r, W * r) (``torch.nn.functional.pixel_shuffle``).
    SBP: splits of the leading (batch) dims pass; P -> P (a permutation)."""
    return _shuffle("pixel_shuffle", input, upscale_factor, True)


def pixel_unshuffle(input, downscale_factor):  # noqa: A002
    """(*, C, H * r, W * r) -> (*, C * r^2, H, W) (``torch.nn.functional.
    pixel_unshuffle``); layouts as :func:`pixel_shuffle`."""
    return _shuffle("pixel_unshuffle", input, downscale_factor, False)


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None,  # noqa: A002
                recompute_scale_factor=None, antialias=False):
    """Resize (``torch.nn.functional.interpolate``): input (N, C, *spatial), 1 to 3 spatial
    dims; modes as torch (nearest, linear, bilinear, bicubic, trilinear, area,
    nearest-exact). SBP: N and C splits pass; P -> P (every mode is linear)."""
    _spatial_input("interpolate", input, (3, 4, 5))
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size= and scale_factor=")
    return dispatch("nn.interpolate", input, size=size, scale_factor=scale_factor, mode=mode,
                 align_corners=align_corners, recompute_scale_factor=recompute_scale_factor,
                 antialias=antialias)


def upsample(input, size=None, scale_factor=None, mode="nearest", align_corners=None):  # noqa: A002
    """Deprecated alias of :func:`interpolate` (``torch.nn.functional.upsample``, with its
    warning): ``interpolate(input, size, scale_factor, mode, align_corners)``."""
    warnings.warn("`nn.functional.upsample` is deprecated. Use `nn.functional.interpolate` "
                  "instead.", stacklevel=2)
    return interpolate(input, size, scale_factor, mode, align_corners)


def upsample_nearest(input, size=None, scale_factor=None):  # noqa: A002
    """Deprecated (``torch.nn.functional.upsample_nearest``, with its warning):
    ``interpolate(input, size, scale_factor, mode='nearest')``."""
    warnings.warn("`nn.functional.upsample_nearest` is deprecated. Use "
                  "`nn.functional.interpolate` instead.", stacklevel=2)
    return interpolate(input, size, scale_factor, mode="nearest")


def upsample_bilinear(input, size=None, scale_factor=None):  # noqa: A002
    """Deprecated (``torch.nn.functional.upsample_bilinear``, with its warning):
    ``interpolate(input, size, scale_factor, mode='bilinear', align_corners=True)``; input
    (N, C, H, W)."""
    warnings.warn("`nn.functional.upsample_bilinear` is deprecated. Use "
                  "`nn.functional.interpolate` instead.", stacklevel=2)
    return interpolate(input, size, scale_factor, mode="bilinear", align_corners=True)


# ------------------------------------------------------------------ im2col, sampling grids
def unfold(input, kernel_size, dilation=1, padding=0, stride=1):  # noqa: A002
    """Sliding local blocks as columns (im2col; ``torch.nn.functional.unfold``): (N, C, H,
    W) or (C, H, W) -> (N, C * kh * kw, L) or (C * kh * kw, L), L the number of block
    positions; dim 1 runs over (c, i, j), channel outermost.

    SBP: a batch split passes; P -> P (a copy of entries); a split C, H or W is gathered
    (C * kh * kw splits differently from C).

    Raises:
        ValueError: an input that is not 3-D or 4-D.
    """
    _check("unfold", input=input)
    if input.ndim not in (3, 4):
        raise ValueError(f"unfold: Input Error: Only 3D or 4D input Tensors are supported "
                         f"(got {input.ndim}D, shape {tuple(input.shape)})")
    return dispatch("nn.unfold", input, kernel_size=_ntuple(kernel_size, 2),
                    dilation=_ntuple(dilation, 2), padding=_ntuple(padding, 2),
                    stride=_ntuple(stride, 2))


def fold(input, output_size, kernel_size, dilation=1, padding=0, stride=1):  # noqa: A002
    """Sum sliding local blocks back into an image (col2im; ``torch.nn.functional.fold``,
    the adjoint of :func:`unfold`): (N, C * kh * kw, L) or (C * kh * kw, L) -> (N, C,
    *output_size) or (C, *output_size); overlapping entries add.

    SBP: a batch split passes; P -> P (linear); other splits are gathered.

    Raises:
        ValueError: an input that is not 2-D or 3-D.
    """
    _check("fold", input=input)
    if input.ndim not in (2, 3):
        raise ValueError(f"fold: Input Error: Only unbatched (2D) or batched (3D) input "
                         f"Tensors are supported (got {input.ndim}D, shape "
                         f"{tuple(input.shape)})")
    return dispatch("nn.fold", input, output_size=_ntuple(output_size, 2),
                    kernel_size=_ntuple(kernel_size, 2), dilation=_ntuple(dilation, 2),
                    padding=_ntuple(padding, 2), stride=_ntuple(stride, 2))


def _align_corners(align_corners):
    if align_corners is None:
        warnings.warn("Default grid_sample and affine_grid behavior has changed to "
                      "align_corners=False since 1.3.0. Please specify align_corners=True if "
                      "the old behavior is desired. See the documentation of grid_sample "
                      "for details.", stacklevel=3)
        return False
    return bool(align_corners)


def affine_grid(theta, size, align_corners=None):
    """Sampling grids of affine maps (``torch.nn.functional.affine_grid``, spatial
    transformer networks): theta (N, 2, 3) and ``size`` (N, C, H, W) -> grid (N, H, W, 2);
    theta (N, 3, 4) and (N, C, D, H, W) -> (N, D, H, W, 3). Coordinates in [-1, 1] as
    :func:`grid_sample` reads them. ``align_corners=None`` warns and means False, as torch.

    SBP: a batch split of theta passes (each grid is its own theta's); P -> P (linear in
    theta).

    Raises:
        ValueError: a non-float theta, shapes that do not match ``size``, a non-positive
            size. NotImplementedError: ``size`` of other than 4 or 5 entries (as torch).
    """
    _check("affine_grid", theta=theta)
    align = _align_corners(align_corners)
    if not theta.dtype.is_floating_point:
        raise ValueError(f"Expected theta to have floating point type, but got {theta.dtype}")
    size = [int(v) for v in size]
    if len(size) not in (4, 5):
        raise NotImplementedError(f"affine_grid only supports 4D and 5D sizes, for 2D and 3D "
                                  f"affine transforms, respectively. Got size {size}.")
    rows = len(size) - 2
    if theta.ndim != 3 or tuple(theta.shape[1:]) != (rows, rows + 1):
        raise ValueError(f"Expected a batch of {rows}D affine matrices of shape "
                         f"Nx{rows}x{rows + 1} for size {size}. Got {tuple(theta.shape)}.")
    if theta.shape[0] != size[0]:
        raise ValueError(f"affine_grid: theta holds {theta.shape[0]} matrices but size "
                         f"{size} asks for N = {size[0]}")
    spatial = size[2:]
    if align and min(spatial) == 1:
        warnings.warn("Since version 1.3.0, affine_grid behavior has changed for unit-size "
                      "grids when align_corners=True. This is not an intended use case of "
                      "affine_grid. See the documentation of affine_grid for details.",
                      stacklevel=2)
    elif min(size) <= 0:
        raise ValueError(f"Expected non-zero, positive output size. Got {size}")
    return dispatch("nn.affine_grid", theta, size=tuple(size), align_corners=align)


def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):  # noqa: A002
    """Sample ``input`` at the points of ``grid`` (``torch.nn.functional.grid_sample``):
    input (N, C, H_in, W_in) with grid (N, H_out, W_out, 2) -> (N, C, H_out, W_out); 5-D
    input (N, C, D, H, W) with grid (N, D_out, H_out, W_out, 3). Grid points (x, y[, z])
    in [-1, 1] span the input; ``mode`` ``'bilinear'`` | ``'nearest'`` | ``'bicubic'``
    (4-D only), ``padding_mode`` ``'zeros'`` | ``'border'`` | ``'reflection'``;
    ``align_corners=None`` warns and means False, as torch.

    SBP: a batch split passes when input and grid are split alike; a channel split of the
    input passes with the grid B; a grid split on an output position dim (H_out, W_out,
    ...) passes with the input B (output split there); P input with B grid -> P (linear in
    the input). The gradient reaches the input and the grid.

    Raises:
        ValueError: a bad mode or padding mode, shapes that do not match.
    """
    _check("grid_sample", input=input, grid=grid)
    if mode not in ("bilinear", "nearest", "bicubic"):
        raise ValueError(f"nn.functional.grid_sample(): expected mode to be 'bilinear', "
                         f"'nearest' or 'bicubic', but got: '{mode}'")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise ValueError(f"nn.functional.grid_sample(): expected padding_mode to be 'zeros', "
                         f"'border', or 'reflection', but got: '{padding_mode}'")
    align = _align_corners(align_corners)
    if input.ndim not in (4, 5) or grid.ndim != input.ndim or grid.shape[0] != input.shape[0] \
            or grid.shape[-1] != input.ndim - 2:
        raise ValueError(f"grid_sample: expected input (N, C, H, W) with grid (N, H_out, "
                         f"W_out, 2) or input (N, C, D, H, W) with grid (N, D_out, H_out, "
                         f"W_out, 3), got {tuple(input.shape)} and {tuple(grid.shape)}")
    if mode == "bicubic" and input.ndim != 4:
        raise ValueError("grid_sample: mode='bicubic' supports only 4-D input")
    return dispatch("nn.grid_sample", input, grid, mode=mode, padding_mode=padding_mode,
                    align_corners=align)


def pad(input, pad, mode="constant", value=None):  # noqa: A002
    """Pad the last ``len(pad) // 2`` dims (``torch.nn.functional.pad``); ``pad`` is
    ``(left, right, top, bottom, ...)`` from the last dim backwards; modes ``constant``,
    ``reflect``, ``replicate``, ``circular``. SBP: splits of unpadded dims pass; P -> P
    except a constant pad with a non-zero ``value``."""
    _check("pad", input=input)
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) // 2 > input.ndim:
        raise ValueError(f"pad: {pad} must have an even length of at most 2 * {input.ndim} "
                         f"(two entries per padded dim)")
    return dispatch("nn.pad", input, pad=pad, mode=mode, value=value)


# ------------------------------------------------------------------ normalisation
def _norm_shape(name: str, x: Tensor, normalized_shape) -> tuple[int, ...]:
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.ndim - len(ns):]) != ns or len(ns) > x.ndim:
        raise ValueError(f"{name}: normalized_shape {ns} must be the last dims of the input's "
                         f"shape {tuple(x.shape)}")
    return ns


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # noqa: A002
    """Layer normalisation over the last ``len(normalized_shape)`` dims (``torch.nn.
    functional.layer_norm``). SBP: leading dims may stay split; the normalised dims are
    gathered if split; weight and bias are used whole (B); P input is summed first."""
    _check("layer_norm", input=input, weight=weight, bias=bias)
    ns = _norm_shape("layer_norm", input, normalized_shape)
    return _opt("nn.layer_norm", (_no_partial(input),), ("weight", weight), ("bias", bias),
                normalized_shape=ns, eps=eps)


def rms_norm(input, normalized_shape, weight=None, eps=None):  # noqa: A002
    """RMS normalisation (``torch.nn.functional.rms_norm``); layouts as :func:`layer_norm`."""
    _check("rms_norm", input=input, weight=weight)
    ns = _norm_shape("rms_norm", input, normalized_shape)
    return _opt("nn.rms_norm", (_no_partial(input),), ("weight", weight), normalized_shape=ns,
                eps=eps)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):  # noqa: A002
    """Group normalisation (``torch.nn.functional.group_norm``), input (N, C, *). SBP: N may
    stay split; weight and bias (C,) are used whole."""
    _check("group_norm", input=input, weight=weight, bias=bias)
    if input.ndim < 2 or input.shape[1] % num_groups:
        raise ValueError(f"group_norm: input of shape {tuple(input.shape)} needs (N, C, ...) "
                         f"with C divisible by num_groups={num_groups}")
    return _opt("nn.group_norm", (_no_partial(input),), ("weight", weight), ("bias", bias),
                num_groups=num_groups, eps=eps)


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,  # noqa: A002
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """Instance normalisation of (N, C, *) over the spatial dims of each (n, c)
    (``torch.nn.functional.instance_norm``); ``weight``/``bias`` (C,).

    ``use_input_stats`` (default): the statistics of each instance; ``running_mean`` /
    ``running_var`` (C,), when given, are updated in place as torch's (momentum, the mean
    over the batch of each instance's mean and unbiased variance). Otherwise the running
    statistics normalise (as :func:`batch_norm` in eval).

    SBP: N and C splits pass with no communication (a split spatial dim is gathered); P
    is summed first; weight and bias are used whole. Updating running statistics of a
    batch-split input all-reduces C values twice.

    Raises:
        ValueError: fewer than 2 dims, shapes that do not match C, or a single spatial
            value per instance when using input statistics.
    """
    _check("instance_norm", input=input, running_mean=running_mean, running_var=running_var,
           weight=weight, bias=bias)
    if input.ndim < 3:
        raise ValueError(f"instance_norm: expected an input (N, C, *spatial), got "
                         f"{tuple(input.shape)}")
    C = input.shape[1]
    for k, t in (("running_mean", running_mean), ("running_var", running_var),
                 ("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ValueError(f"instance_norm: {k} has shape {tuple(t.shape)}, expected ({C},)")
    count = math.prod(input.shape[2:])
    if use_input_stats and count <= 1:
        raise ValueError(f"instance_norm: expected more than 1 spatial element when training, "
                         f"got input of shape {tuple(input.shape)}")
    if input.is_local:
        return Tensor(F.instance_norm(input._local, _t(running_mean), _t(running_var),
                                      _t(weight), _t(bias), use_input_stats, momentum, eps))
    if not use_input_stats:
        if running_mean is None or running_var is None:
            raise ValueError("instance_norm: use_input_stats=False needs running_mean and "
                             "running_var")
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    x = _no_partial(input)
    out = _opt("nn.instance_norm", (x,), ("weight", weight), ("bias", bias), eps=eps)
    if running_mean is not None or running_var is not None:
        with torch.no_grad():
            xd = x.detach()
            dims = tuple(range(2, x.ndim))
            mean = xd.mean(dim=dims, keepdim=True)
            var = ((xd - mean) * (xd - mean)).sum(dim=dims) / (count - 1)
            for stat, value in ((running_mean, mean.reshape(x.shape[:2])), (running_var, var)):
                if stat is not None:
                    v = value.mean(dim=0).to_global(sbp=stat.sbp)
                    stat._local.mul_(1 - momentum).add_(v._local * momentum)
    return out


def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):  # noqa: A002
    """Local response normalisation across channels (Krizhevsky et al. 2012;
    ``torch.nn.functional.local_response_norm``): ``x / (k + alpha * mean_{window}
    (x^2)) ^ beta``, the mean over ``size`` neighbouring channels (zero padded:
    ``size // 2`` before, ``(size - 1) // 2`` after). Input (N, C, *), at least 3-D.

    SBP: every split but the channels' passes (batch and spatial positions are
    independent); a split C is gathered; a P input is summed first.

    Raises:
        ValueError: fewer than 3 dims.
    """
    _check("local_response_norm", input=input)
    if input.ndim < 3:
        raise ValueError(f"Expected 3D or higher dimensionality input (got {input.ndim} "
                         f"dimensions)")
    if input.numel() == 0:
        return input
    return dispatch("nn.local_response_norm", input, size=size, alpha=alpha, beta=beta, k=k)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,  # noqa: A002
               momentum=0.1, eps=1e-5):
    """Batch normalisation over (N, C, *) per channel (``torch.nn.functional.batch_norm``).

    ``training``: normalise with the batch's statistics (over N and the spatial dims of the
    GLOBAL tensor) and, when given, update ``running_mean``/``running_var`` (sbpflow
    tensors of shape (C,), any layout, updated in place like torch's: momentum-weighted,
    unbiased variance). Otherwise normalise with the running statistics.

    SBP: a split N or spatial dim gives statistics that are P and all-reduced (two
    all-reduces of C values: mean, then variance); a split C stays split; a P input is
    summed first. fp16/bf16 inputs: computed in float32 and rounded once, as torch's
    kernel (the output has the input's dtype).

    Raises:
        ValueError: fewer than 2 values per channel in training, missing running stats in
            eval, or shapes that do not match C.
    """
    _check("batch_norm", input=input, running_mean=running_mean, running_var=running_var,
           weight=weight, bias=bias)
    if input.ndim < 2:
        raise ValueError(f"batch_norm: expected an input (N, C, ...), got {tuple(input.shape)}")
    C = input.shape[1]
    for k, t in (("running_mean", running_mean), ("running_var", running_var),
                 ("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (C,):
            raise ValueError(f"batch_norm: {k} has shape {tuple(t.shape)}, expected ({C},)")
    if momentum is None or not 0.0 <= momentum <= 1.0:
        raise ValueError(f"batch_norm: momentum must be a number in [0, 1], got {momentum!r} "
                         f"(a cumulative average, momentum=None, is not supported)")
    if not training and (running_mean is None or running_var is None):
        raise ValueError("batch_norm: training=False needs running_mean and running_var")
    count = input.numel() // max(C, 1)
    if training and count <= 1:
        raise ValueError(f"batch_norm: expected more than 1 value per channel when training, "
                         f"got input of shape {tuple(input.shape)}")
    if input.is_local:
        return Tensor(F.batch_norm(input._local, _t(running_mean), _t(running_var), _t(weight),
                                   _t(bias), training, momentum, eps))
    dims = (0, *range(2, input.ndim))
    cshape = (1, C) + (1,) * (input.ndim - 2)

    def normalise(x):
        if training:
            mean = _no_partial(x.mean(dim=dims, keepdim=True))
            xc = x - mean
            var = _no_partial((xc * xc).mean(dim=dims, keepdim=True))
            if running_mean is not None or running_var is not None:
                with torch.no_grad():
                    for stat, value in ((running_mean, mean), (running_var,
                                                               var * (count / (count - 1)))):
                        if stat is not None:
                            v = value.detach().reshape(C).to_global(sbp=stat.sbp)
                            stat._local.mul_(1 - momentum).add_(v._local * momentum)
        else:
            xc = x - running_mean.detach().reshape(cshape)
            var = running_var.detach().reshape(cshape)
        y = xc * (var + eps).rsqrt()
        if weight is not None:
            y = y * weight.reshape(cshape)
        if bias is not None:
            y = y + bias.reshape(cshape)
        return y

    return in_float32(_no_partial(input), normalise)


# ------------------------------------------------------------------ activations
def _inplace(x: Tensor, out: Tensor, inplace: bool) -> Tensor:
    """``inplace=True``: ``x`` is rebound to the result (its old value is not overwritten,
    so autograd stays correct) and returned."""
    if not inplace:
        return out
    x._local, x._sbp = out._local, out._sbp
    return x


def relu(input, inplace=False):  # noqa: A002
    """``max(x, 0)`` elementwise (``torch.nn.functional.relu``); splits pass, P is summed
    first. ``inplace``: ``input`` is rebound to the result."""
    _check("relu", input=input)
    return _inplace(input, dispatch("relu", input), inplace)


def gelu(input, approximate="none"):  # noqa: A002
    """GELU (``torch.nn.functional.gelu``), ``approximate`` ``'none'`` or ``'tanh'``."""
    _check("gelu", input=input)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return dispatch("gelu", input, approximate=approximate)


def silu(input, inplace=False):  # noqa: A002
    """``x * sigmoid(x)`` (``torch.nn.functional.silu``); ``inplace`` as :func:`relu`."""
    _check("silu", input=input)
    return _inplace(input, dispatch("silu", input), inplace)


def softplus(input, beta=1.0, threshold=20.0):  # noqa: A002
    """``log(1 + exp(beta x)) / beta`` (linear above ``threshold``), as torch's."""
    _check("softplus", input=input)
    return dispatch("softplus", input, beta=beta, threshold=threshold)


def sigmoid(input):  # noqa: A002
    """Logistic sigmoid elementwise (``torch.sigmoid``)."""
    _check("sigmoid", input=input)
    return dispatch("sigmoid", input)


def tanh(input):  # noqa: A002
    """Hyperbolic tangent elementwise (``torch.tanh``)."""
    _check("tanh", input=input)
    return dispatch("tanh", input)


def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Dropout (``torch.nn.functional.dropout``), layout invariant: with the same seed the
    global result equals torch's on one process bit for bit, under every SBP (see
    :func:`sbpflow.ops.dropout`). ``inplace`` as :func:`relu`.

    Raises ``ValueError`` for ``p`` outside [0, 1].
    """
    _check("dropout", input=input)
    out = _dropout(input, p, training)
    return _inplace(input, out, inplace) if out is not input else out


def dropout2d(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Zero whole channels (``torch.nn.functional.dropout2d``): input (N, C, H, W); each
    (n, c) plane is kept with probability ``1 - p`` and scaled by ``1 / (1 - p)``. A 3-D
    input is taken as (N, C, L), as torch 2.x does (with its warning about it). Layout
    invariant: the (N, C, 1, ...) Bernoulli noise is drawn as torch draws it (whole, on
    every rank; see :mod:`sbpflow.random`) and each rank keeps its part, so the result
    equals torch's on one process for the same seed under every SBP; the output keeps the
    input's layout (P stays P). ``inplace`` as :func:`relu`.

    Raises:
        ValueError: ``p`` outside [0, 1] or an input that is not 3-D or 4-D.
    """
    _check("dropout2d", input=input)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if input.ndim not in (3, 4):
        raise ValueError(f"dropout2d: expected a 4-D (N, C, H, W) or 3-D (N, C, L) input, "
                         f"got shape {tuple(input.shape)}")
    if not training or p == 0.0:
        return input
    if p == 1.0:  # torch draws nothing here
        return _inplace(input, input * 0.0, inplace)
    shape = (*input.shape[:2], *(1,) * (input.ndim - 2))

    def noise(size, g):
        n = torch.empty(size, dtype=input.dtype, device=input._local.device)
        n.bernoulli_(1 - p, generator=g)
        return n.div_(1 - p)  # torch's feature dropout: input * (bernoulli / (1 - p))

    if input.is_local:
        out = input * Tensor(noise(shape, None))
    else:
        pl = input.placement
        # the noise is whole on P axes and on axes that split H, W (its dims of size 1)
        nd = tuple(broadcast if s.is_partial() or s.is_split() and s.dim >= 2 else s
                   for s in input.sbp)
        n = _rng.draw_shard(noise, shape, pl, nd)
        out = input * Tensor(n, pl, nd, shape)
    return _inplace(input, out, inplace)


# ------------------------------------------------------------------ more random ops (issue 21)
# Layout invariant as dropout and dropout2d: the noise is drawn whole, as torch draws it
# (every rank of the world, the same generator state), and each rank keeps its part.
_ALPHA_DROPOUT_ALPHA = 1.7580993408473766  # ATen's: SELU's scale * alpha (-it: saturation)


def _noise_dropout(name: str, input, p: float, training: bool, inplace: bool, *,  # noqa: A002
                   lead: int | None, alpha: bool) -> Tensor:
    """ATen's ``_dropout_impl`` (aten/src/ATen/native/Dropout.cpp) on local or global
    tensors: ``noise = bernoulli(1 - p)`` of the input's shape (``lead=None``) or of its
    first ``lead`` dims with size-1 dims after them (feature dropout: one draw per channel
    plane); then ``x * noise / (1 - p)``, or for alpha dropout ``x * (a noise) + b`` with
    ``a = 1 / sqrt((alpha^2 p + 1)(1 - p))``, ``b = (noise - 1) alpha a + alpha a p``
    (the same torch ops in the same order, so the values are torch's bit for bit)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0:  # torch draws nothing: x * 0
        return _inplace(input, input * 0.0, inplace)
    feature = lead is not None
    shape = (tuple(input.shape[:lead]) + (1,) * (input.ndim - lead) if feature
             else tuple(input.shape))
    dev = input._local.device
    # Elementwise noise is drawn into empty_like(x): in x's memory order (as dropout).
    perm = list(range(input.ndim)) if feature else memory_order(input._local)
    inverse = [perm.index(d) for d in range(len(perm))]

    def draw(size, g):
        n = torch.empty([size[d] for d in perm], dtype=input.dtype, device=dev)
        return n.bernoulli_(1 - p, generator=g).permute(inverse)

    if input.is_local:
        pl, nd, n = None, None, draw(shape, None)
    else:
        pl = input.placement
        # the noise is whole on P axes and on the size-1 dims of feature noise
        nd = tuple(broadcast if s.is_partial() or feature and s.is_split() and s.dim >= lead
                   else s for s in input.sbp)
        n = _rng.draw_shard(draw, shape, pl, nd)

    def wrap(t):
        return Tensor(t) if pl is None else Tensor(t, pl, nd, shape)

    if not alpha:
        return _inplace(input, input * wrap(n.div_(1 - p)), inplace)
    a = 1.0 / math.sqrt((_ALPHA_DROPOUT_ALPHA ** 2 * p + 1) * (1 - p))
    b = n.add(-1).mul_(_ALPHA_DROPOUT_ALPHA * a).add_(_ALPHA_DROPOUT_ALPHA * a * p)
    return _inplace(input, input * wrap(n.mul_(a)) + wrap(b), inplace)


def dropout1d(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Zero whole channels of (N, C, L) or unbatched (C, L) (``torch.nn.functional.
    dropout1d``): each channel row is kept with probability ``1 - p`` and scaled by
    ``1 / (1 - p)``. Layout invariant: the (N, C, 1) Bernoulli noise is drawn as torch
    draws it (whole, on every rank) and each rank keeps its part, so the result equals
    torch's on one process for the same seed under every SBP; the output keeps the
    input's layout (P stays P: dropout is linear in ``x``). ``inplace`` as :func:`relu`.

    Raises:
        ValueError: ``p`` outside [0, 1], an input that is not 2-D or 3-D.
    """
    _check("dropout1d", input=input)
    if input.ndim not in (2, 3):
        raise ValueError(f"dropout1d: expected a 2-D (C, L) or 3-D (N, C, L) input, got "
                         f"shape {tuple(input.shape)}")
    return _noise_dropout("dropout1d", input, p, training, inplace,
                          lead=2 if input.ndim == 3 else 1, alpha=False)


def dropout3d(input, p=0.5, training=True, inplace=False):  # noqa: A002
    """Zero whole channels of (N, C, D, H, W) or unbatched (C, D, H, W) (``torch.nn.
    functional.dropout3d``): each (n, c) volume is kept with probability ``1 - p`` and
    scaled by ``1 / (1 - p)``. Another number of dims is taken as unbatched, with torch's
    deprecation warning. Layouts and layout invariance as :func:`dropout1d`.

    Raises:
        ValueError: ``p`` outside [0, 1], a 0-d input.
    """
    _check("dropout3d", input=input)
    if input.ndim not in (4, 5):
        warnings.warn(f"dropout3d: Received a {input.ndim}-D input to dropout3d, which is "
                      f"deprecated and will result in an error in a future release. To retain "
                      f"the behavior and silence this warning, please use dropout instead.",
                      stacklevel=2)
        if input.ndim == 0:
            raise ValueError("dropout3d: feature dropout needs at least 1 dim (channels)")
    return _noise_dropout("dropout3d", input, p, training, inplace,
                          lead=2 if input.ndim == 5 else 1, alpha=False)


def alpha_dropout(input, p=0.5, training=False, inplace=False):  # noqa: A002
    """Alpha dropout (``torch.nn.functional.alpha_dropout``, Klambauer et al. 2017, for
    SELU networks): each element is dropped with probability ``p`` to SELU's negative
    saturation and the result is affinely rescaled to keep zero mean and unit variance.
    Note torch's default ``training=False``.

    Layout invariant: the Bernoulli noise of the global shape is drawn as torch draws it
    (whole, on every rank, in the input's memory order) and each rank keeps its shard;
    ATen's formula follows (:func:`_noise_dropout`). The output keeps the input's splits;
    a P input times the noise stays P and the affine shift ``b`` (B) is added once.
    ``inplace`` as :func:`relu`.

    Raises:
        ValueError: ``p`` outside [0, 1].
    """
    _check("alpha_dropout", input=input)
    return _noise_dropout("alpha_dropout", input, p, training, inplace, lead=None, alpha=True)


def feature_alpha_dropout(input, p=0.5, training=False, inplace=False):  # noqa: A002
    """Alpha dropout of whole channels (``torch.nn.functional.feature_alpha_dropout``):
    input (N, C, *), one Bernoulli draw per (n, c), then alpha dropout's affine rescaling
    (see :func:`alpha_dropout`). Layout invariant as :func:`dropout1d`.

    Raises:
        ValueError: ``p`` outside [0, 1], fewer than 2 dims.
    """
    _check("feature_alpha_dropout", input=input)
    if input.ndim < 2:
        raise ValueError(f"feature_alpha_dropout: feature dropout requires at least 2 "
                         f"dimensions in the input, got shape {tuple(input.shape)}")
    return _noise_dropout("feature_alpha_dropout", input, p, training, inplace, lead=2,
                          alpha=True)


def gumbel_softmax(logits, tau=1, hard=False, eps=1e-10, dim=-1):
    """Samples of the Gumbel-softmax distribution (``torch.nn.functional.gumbel_softmax``,
    Jang et al. 2016): ``softmax((logits + g) / tau, dim)`` with Gumbel(0, 1) noise ``g =
    -log(Exponential(1))``; ``hard``: the one-hot of the argmax in forward with the soft
    sample's gradient (straight through: ``y_hard - y_soft.detach() + y_soft``).
    ``eps`` is deprecated in torch and has no effect (a warning when set).

    Layout invariant: the exponential noise of the global shape is drawn as torch draws it
    (whole, contiguous, on every rank) and each rank keeps its shard; the softmax over a
    split ``dim`` is :func:`softmax`'s (all-reduce MAX and SUM, no gather). The output
    follows the logits' splits (a P input is summed first).

    Raises:
        IndexError: ``dim`` out of range.
    """
    _check("gumbel_softmax", logits=logits)
    if eps != 1e-10:
        warnings.warn("`eps` parameter is deprecated and has no effect.", stacklevel=2)
    d = _dim(dim, logits.ndim, "gumbel_softmax")
    shape = tuple(logits.shape)

    def draw(size, g):
        e = torch.empty(size, dtype=logits.dtype, device=logits._local.device)
        return e.exponential_(generator=g)

    if logits.is_local:
        e = Tensor(draw(shape, None))
    else:
        pl = logits.placement
        nd = tuple(broadcast if s.is_partial() else s for s in logits.sbp)
        e = Tensor(_rng.draw_shard(draw, shape, pl, nd), pl, nd, shape)
    gumbels = (logits + -e.log()) / tau
    y_soft = softmax(gumbels, d)
    if not hard:
        return y_soft
    index = y_soft.max(d, keepdim=True)[1]
    y_hard = zeros_like(y_soft).scatter_(d, index, 1.0)
    return y_hard - y_soft.detach() + y_soft


# ------------------------------------------------------------------ softmax
def _softmax(name: str, x: Tensor, dim, dtype, log: bool) -> Tensor:
    _check(name, input=x)
    return _softmax_op(x, dim, dtype, log=log, name=name)


def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """``exp(x) / exp(x).sum(dim)`` (``torch.nn.functional.softmax``).

    SBP: splits of other dims pass. Over a split ``dim``: local max, all-reduce MAX, local
    sum of ``exp(x - max)``, all-reduce SUM (both of the shape with ``dim`` -> 1); never a
    gather of ``x``. A P input is summed first. ``dtype`` casts the input first.
    """
    return _softmax("softmax", input, dim, dtype, log=False)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """``x - logsumexp(x, dim)`` (``torch.nn.functional.log_softmax``); layouts and
    collectives as :func:`softmax`."""
    return _softmax("log_softmax", input, dim, dtype, log=True)


# ------------------------------------------------------------------ attention
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """``softmax(q k^T * scale + mask) v`` (``torch.nn.functional.
    scaled_dot_product_attention``).

    Shapes: query (..., L, E), key (..., S, E), value (..., S, Ev), attn_mask broadcastable
    to (..., L, S), bool (True = attend) or float (added). Typically (B, H, T, D).
    SBP: batch and head dims may stay split (in q, k, v and the mask alike); the query
    length may stay split when not causal; value split on Ev gives an output split on
    its last dim; P value gives P.

    Raises:
        NotImplementedError: ``dropout_p > 0`` on global tensors (no layout-invariant mask).
    """
    _check("scaled_dot_product_attention", query=query, key=key, value=value,
           attn_mask=attn_mask)
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal=True, "
                         "not both")
    if query.ndim < 2 or key.ndim < 2 or value.ndim < 2:
        raise ValueError("scaled_dot_product_attention: query, key and value need >= 2 dims")
    if query.is_global and dropout_p > 0:
        return _sdpa_with_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa)
    # Linear in value only: P query, key or mask is summed first.
    mask = _no_partial(attn_mask) if attn_mask is not None else None
    return _opt("nn.scaled_dot_product_attention", (_no_partial(query), _no_partial(key), value),
                ("attn_mask", mask), dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)


# ------------------------------------------------------------------ embedding
def _sdpa_with_dropout(q, k, v, attn_mask, p, is_causal, scale, enable_gqa):
    """Attention with dropout on global tensors, written out as torch's math path does it
    (``softmax(q k^T * scale + mask)``, dropout on the weights, ``@ v``): the dropout mask
    is then sbpflow's layout-invariant one, equal to torch's draw on one process."""
    if enable_gqa:
        raise NotImplementedError("scaled_dot_product_attention: enable_gqa with dropout_p > 0 "
                                  "on global tensors is not supported")
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:  # True = attend; built shard-locally (B, no communication)
        pl = q.placement
        attn_mask = full((L, S), True, dtype=torch.bool, placement=pl,
                         sbp=(broadcast,) * pl.ndim).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # True = attend
            attn_mask = _map_local(attn_mask, lambda t: torch.zeros(
                t.shape, dtype=scores.dtype, device=t.device).masked_fill(~t, float("-inf")))
        scores = scores + attn_mask
    return dropout(softmax(scores, -1), p) @ v


# ------------------------------------------------------------------ multi-head attention (issue 21)
def _canonical_mask(mask, name: str, dtype):
    """torch's ``_canonical_mask``: a bool mask (True = not allowed) as an additive float
    mask of ``dtype`` (``-inf`` where True, no communication); a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return _map_local(mask, lambda t: torch.zeros_like(t, dtype=dtype).masked_fill_(
            t, float("-inf")))
    if not mask.dtype.is_floating_point:
        raise TypeError(f"multi_head_attention_forward: only bool and floating types of "
                        f"{name} are supported, got {mask.dtype}")
    return mask


def _mha_batched(query, key, value, key_padding_mask, attn_mask, num_heads) -> bool:
    """torch's ``_mha_shape_check``: whether the inputs are batched (3-D query)."""
    if query.ndim not in (2, 3):
        raise ValueError(f"multi_head_attention_forward: query should be unbatched 2D or "
                         f"batched 3D tensor but received {query.ndim}-D query tensor")
    batched = query.ndim == 3
    if key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"multi_head_attention_forward: for a {query.ndim}-D query, key and "
                         f"value must be {query.ndim}-D, got {key.ndim}-D and {value.ndim}-D")
    if key_padding_mask is not None and key_padding_mask.ndim != query.ndim - 1:
        raise ValueError(f"multi_head_attention_forward: for a {query.ndim}-D query, "
                         f"key_padding_mask must be None or {query.ndim - 1}-D, got "
                         f"{key_padding_mask.ndim}-D")
    if attn_mask is not None:
        if attn_mask.ndim not in (2, 3):
            raise ValueError(f"multi_head_attention_forward: attn_mask must be None, 2-D or "
                             f"3-D, got {attn_mask.ndim}-D")
        want = (num_heads, query.shape[0], key.shape[0])
        if not batched and attn_mask.ndim == 3 and tuple(attn_mask.shape) != want:
            raise ValueError(f"multi_head_attention_forward: expected attn_mask of shape "
                             f"{want}, got {tuple(attn_mask.shape)}")
    return batched


def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads,
                                 in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn,
                                 dropout_p, out_proj_weight, out_proj_bias, training=True,
                                 key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None,
                                 k_proj_weight=None, v_proj_weight=None, static_k=None,
                                 static_v=None, average_attn_weights=True, is_causal=False):
    """Multi-head attention (``torch.nn.functional.multi_head_attention_forward``, what
    :class:`sbpflow.nn.MultiheadAttention` runs): torch's algorithm step for step, with
    the heads kept as a dim of their own, (N, heads, L, head_dim), instead of torch's
    (N * heads, L, head_dim), so that a split batch stays a split (no reshape across it).

    Shapes: query (L, N, E), key (S, N, E_k), value (S, N, E_v), or unbatched (L, E),
    (S, E_k), (S, E_v). ``in_proj_weight`` (3E, E) / ``in_proj_bias`` (3E,), or with
    ``use_separate_proj_weight`` ``q/k/v_proj_weight`` (E, E), (E, E_k), (E, E_v);
    ``bias_k``/``bias_v`` (1, 1, E) appended to the keys/values; ``add_zero_attn``
    appends a zero key and value; ``static_k``/``static_v`` (N * heads, S, head_dim)
    replace the projected keys/values. ``key_padding_mask`` (N, S) and ``attn_mask``
    (L, S) or (N * heads, L, S): bool (True = not allowed) or additive float.
    ``is_causal`` is a hint that ``attn_mask`` is causal (it is required, as in torch).
    Returns ``(attn_output (L, N, E), attn_weights)``: the weights (N, L, S) averaged over
    heads, (N, heads, L, S) with ``average_attn_weights=False``, or None without
    ``need_weights`` (then :func:`scaled_dot_product_attention` runs).

    SBP: the batch (dim 1; 0 unbatched) may stay split throughout, with masks split
    along N or B; the projections follow :func:`linear` (column-parallel in-projection
    weights give head-split activations, a row-parallel ``out_proj_weight`` a P output);
    dropout on the weights is layout invariant.

    Raises:
        ValueError: shapes that do not match (torch raises AssertionError or
            RuntimeError for these), ``is_causal`` without ``attn_mask``.
        TypeError: a mask that is neither bool nor floating.
    """
    name = "multi_head_attention_forward"
    _check(name, query=query, key=key, value=value, in_proj_weight=in_proj_weight,
           in_proj_bias=in_proj_bias, bias_k=bias_k, bias_v=bias_v,
           out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias,
           key_padding_mask=key_padding_mask, attn_mask=attn_mask, q_proj_weight=q_proj_weight,
           k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=static_k,
           static_v=static_v)
    batched = _mha_batched(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    L, N, E = query.shape
    S = key.shape[0]
    if key_padding_mask is not None and attn_mask is not None and \
            key_padding_mask.dtype != attn_mask.dtype:
        warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. "
                      "Use same type for both instead.", stacklevel=2)
    key_padding_mask = _canonical_mask(key_padding_mask, "key_padding_mask", query.dtype)
    if is_causal and attn_mask is None:
        raise ValueError(f"{name}: need attn_mask if specifying the is_causal hint (e.g. "
                         f"nn.Transformer.generate_square_subsequent_mask)")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the hint alone: scaled_dot_product_attention(is_causal=True)
    else:
        attn_mask = _canonical_mask(attn_mask, "attn_mask", query.dtype)
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal
    if E != embed_dim_to_check:
        raise ValueError(f"{name}: was expecting embedding dimension of {embed_dim_to_check}, "
                         f"but got {E}")
    h = num_heads
    d = E // h
    if d * h != E:
        raise ValueError(f"{name}: embed_dim {E} not divisible by num_heads {h}")
    if use_separate_proj_weight:
        if tuple(key.shape[:2]) != tuple(value.shape[:2]):
            raise ValueError(f"{name}: key's sequence and batch dims {tuple(key.shape[:2])} do "
                             f"not match value's {tuple(value.shape[:2])}")
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
        if any(w is None for w in weights):
            raise ValueError(f"{name}: use_separate_proj_weight needs q_proj_weight, "
                             f"k_proj_weight and v_proj_weight")
    else:
        if tuple(key.shape) != tuple(value.shape):
            raise ValueError(f"{name}: key shape {tuple(key.shape)} does not match value "
                             f"shape {tuple(value.shape)}")
        if in_proj_weight is None:
            raise ValueError(f"{name}: use_separate_proj_weight is False but in_proj_weight "
                             f"is None")
        weights = tuple(in_proj_weight[i * E:(i + 1) * E] for i in range(3))
    biases = (None,) * 3 if in_proj_bias is None else tuple(
        in_proj_bias[i * E:(i + 1) * E] for i in range(3))
    q, k, v = (linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    mask = None  # additive, broadcastable to (N, h, L, S)
    if attn_mask is not None:
        want = (L, S) if attn_mask.ndim == 2 else (N * h, L, S)
        if tuple(attn_mask.shape) != want:
            raise ValueError(f"{name}: the shape of the {attn_mask.ndim}D attn_mask is "
                             f"{tuple(attn_mask.shape)}, but should be {want}")
        mask = attn_mask.reshape(1, 1, L, S) if attn_mask.ndim == 2 else \
            attn_mask.reshape(N, h, L, S)
    kpm = key_padding_mask
    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise ValueError(f"{name}: bias cannot be added to a static key or value")
        k = _cat([k, bias_k.repeat(1, N, 1)])
        v = _cat([v, bias_v.repeat(1, N, 1)])
        mask = pad(mask, (0, 1)) if mask is not None else None
        kpm = pad(kpm, (0, 1)) if kpm is not None else None
    elif bias_k is not None or bias_v is not None:
        raise ValueError(f"{name}: give both bias_k and bias_v, or neither")

    def heads(x, n):  # (n, N, E) -> (N, h, n, d)
        return x.reshape(n, N, h, d).permute(1, 2, 0, 3)

    def static(t, what):  # (N * h, S, d) -> (N, h, S, d)
        if t.shape[0] != N * h or t.shape[2] != d:
            raise ValueError(f"{name}: expecting {what} of shape ({N * h}, S, {d}), got "
                             f"{tuple(t.shape)}")
        return t.reshape(N, h, t.shape[1], d)

    q = heads(q, L)
    k = heads(k, k.shape[0]) if static_k is None else static(static_k, "static_k")
    v = heads(v, v.shape[0]) if static_v is None else static(static_v, "static_v")
    if add_zero_attn:
        k = _cat([k, zeros_like(k.narrow(2, 0, 1))], dim=2)
        v = _cat([v, zeros_like(v.narrow(2, 0, 1))], dim=2)
        mask = pad(mask, (0, 1)) if mask is not None else None
        kpm = pad(kpm, (0, 1)) if kpm is not None else None
    S = k.shape[2]
    if kpm is not None:
        if tuple(kpm.shape) != (N, S):
            raise ValueError(f"{name}: expected key_padding_mask of shape ({N}, {S}), got "
                             f"{tuple(kpm.shape)}")
        kpm = kpm.reshape(N, 1, 1, S)
        mask = kpm if mask is None else mask + kpm
    if not training:
        dropout_p = 0.0
    if need_weights:
        scores = (q * math.sqrt(1.0 / float(d))) @ k.transpose(-2, -1)
        attn = softmax(scores if mask is None else mask + scores, dim=-1)
        if dropout_p > 0.0:
            attn = dropout(attn, p=dropout_p)
        out = attn @ v
        if average_attn_weights:
            attn = attn.mean(dim=1)
    else:
        out = scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
        attn = None
    out = linear(out.permute(2, 0, 1, 3).reshape(L, N, E), out_proj_weight, out_proj_bias)
    if not batched:
        out = out.squeeze(1)
        attn = attn.squeeze(0) if attn is not None else None
    return out, attn


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,  # noqa: A002
              scale_grad_by_freq=False, sparse=False):
    """Rows of ``weight`` (V, D) at integer ``input`` (any shape) -> (*input.shape, D)
    (``torch.nn.functional.embedding``); ``padding_idx`` rows get no gradient.

    SBP per mesh axis: the ids may have any layout. Weight B: the output follows the ids.
    Weight S(0) (vocabulary-parallel): each rank looks up the ids that fall in its
    vocabulary range and writes zeros elsewhere, output P (no gather of the weight).
    Weight S(1): output split on its last dim. Weight P: output P.

    Raises:
        TypeError: non-integer ids. ValueError: ``padding_idx`` out of range.
        NotImplementedError: ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` on
        global tensors.
    """
    _check("embedding", input=input, weight=weight)
    if input.dtype.is_floating_point or input.dtype == torch.bool:
        raise TypeError(f"embedding: ids must be an integer tensor, got {input.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight must be (num_embeddings, dim), got "
                         f"{tuple(weight.shape)}")
    V = weight.shape[0]
    if padding_idx is not None:
        if not -V <= padding_idx < V:
            raise ValueError(f"embedding: padding_idx {padding_idx} is out of range for "
                             f"{V} embeddings")
        padding_idx %= V
    if input.is_local:
        return Tensor(F.embedding(input._local, weight._local, padding_idx, max_norm, norm_type,
                                  scale_grad_by_freq, sparse))
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding: max_norm, scale_grad_by_freq and sparse are "
                                  "supported on local tensors only")
    return dispatch("nn.embedding", input, weight, padding_idx=padding_idx)


# ------------------------------------------------------------------ losses
def _class_weight(name, input, weight):  # noqa: A002
    """(class dim, number of classes, the class weight detached and whole, or None)."""
    if input.ndim == 0:
        raise ValueError(f"{name}: input must have a class dim, got a 0-dim tensor")
    cdim = 0 if input.ndim == 1 else 1
    C = input.shape[cdim]
    if weight is not None:
        if tuple(weight.shape) != (C,):
            raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, expected ({C},)")
        if weight.is_global:
            weight = weight.detach().to_global(sbp=(broadcast,) * weight.placement.ndim)
        else:
            weight = weight.detach()
    return cdim, C, weight


def _nll(name, logp, target, weight, ignore_index, reduction):
    """Per element ``-weight[t] * logp[t]`` (0 where ``t == ignore_index``).

    Returns ``(loss, w, class dim, C, target)``: ``w`` holds each element's weight (0 where
    ignored; its sum is the ``'mean'`` divisor), laid out like the boxed ``target``.
    Targets out of [0, C) other than ``ignore_index`` raise on local tensors (torch's
    gather) but pick 0 on global ones (checking would cost a collective)."""
    cdim, C, weight = _class_weight(name, logp, weight)
    want = tuple(s for d, s in enumerate(logp.shape) if d != cdim)
    if tuple(target.shape) != want:
        raise ValueError(f"{name}: input of shape {tuple(logp.shape)} (classes on dim {cdim}) "
                         f"needs a target of shape {want} (class indices) or "
                         f"{tuple(logp.shape)} (probabilities), got {tuple(target.shape)}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"{name}: class-index targets must be integers, got {target.dtype}")
    if logp.is_local:
        t = target._local
        mine = t != ignore_index
        picked = Tensor(logp._local.gather(cdim, torch.where(mine, t, 0).unsqueeze(cdim))
                        .squeeze(cdim) * mine.to(logp.dtype))
        tgt = target
    else:
        want = pick_target_layout(logp.sbp, target.sbp, cdim)
        tgt = target if target.sbp == want else target.to_global(sbp=want)
        picked = dispatch("nn.pick", logp, tgt, dim=cdim, ignore_index=ignore_index)

    def weights(t):
        mine = t != ignore_index
        w = mine.to(logp.dtype)
        if weight is not None:
            w = w * weight._local[torch.where(mine, t, 0).clamp(0, C - 1)]
        return w

    w = _map_local(tgt, weights)
    loss = -(picked * w) if weight is not None else -picked
    return loss, w, cdim, C, tgt


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,  # noqa: A002
             reduction="mean"):
    """Negative log-likelihood of ``input`` (log-probabilities (N, C, d...), (N, C) or (C,))
    at integer ``target`` ((N, d...), (N,) or ()) (``torch.nn.functional.nll_loss``).

    ``'mean'`` divides by the sum of the targets' class weights (ignored targets count 0).
    SBP: class-split input: the rank holding each target's class picks it, output P (no
    gather); batch splits pass. ``size_average``/``reduce`` (deprecated) raise.
    """
    _legacy("nll_loss", size_average, reduce)
    _check("nll_loss", input=input, target=target, weight=weight)
    _check_reduction("nll_loss", reduction)
    loss, w, *_ = _nll("nll_loss", input, target, weight, ignore_index, reduction)
    return _reduce(loss, reduction, w.sum())


def _legacy(name, size_average, reduce):
    if size_average is not None or reduce is not None:
        raise ValueError(f"{name}: size_average and reduce are deprecated in torch; use "
                         f"reduction='mean'|'sum'|'none'")


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,  # noqa: A002
                  reduce=None, reduction="mean", label_smoothing=0.0):
    """Cross entropy of logits ``input`` (N, C, d...), (N, C) or (C,) against class indices
    (int64, shape without C) or class probabilities (input's shape)
    (``torch.nn.functional.cross_entropy``), with ``weight`` (C,), ``ignore_index``,
    ``label_smoothing`` and ``reduction`` as torch's (``'mean'`` over class indices divides
    by the sum of the targets' weights).

    Vocabulary-parallel on class-split logits (C split, any mesh axis): ``log_softmax``
    runs a local max + all-reduce MAX and a local sum of exponentials + all-reduce SUM
    (each one value per row), the target logit is picked by the rank that holds its class
    (others 0: P), and the reductions give a P loss. Backward: the local softmax gradient
    plus one all-reduce of one value per row. The logits are never gathered.

    Raises:
        ValueError: shapes, reduction or label_smoothing out of range; TypeError: targets
        of the wrong dtype.
    """
    _legacy("cross_entropy", size_average, reduce)
    _check("cross_entropy", input=input, target=target, weight=weight)
    _check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got "
                         f"{label_smoothing}")
    cdim = 0 if input.ndim == 1 else 1
    logp = log_softmax(input, dim=cdim)
    eps = float(label_smoothing)
    if target.dtype.is_floating_point and tuple(target.shape) == tuple(input.shape):
        _, C, weight = _class_weight("cross_entropy", input, weight)
        t = target * (1 - eps) + eps / C if eps else target
        prod = logp * t
        if weight is not None:
            prod = prod * _class_view(weight, input.ndim, cdim)
        loss = -prod.sum(dim=cdim)
        n = max(input.numel() // max(C, 1), 1)
        return _reduce(loss, reduction, None) if reduction != "mean" else loss.sum() / n
    loss, w, cdim, C, tgt = _nll("cross_entropy", logp, target, weight, ignore_index, reduction)
    if eps:
        wl = logp * _class_view(weight, input.ndim, cdim) if weight is not None else logp
        mine = _map_local(tgt, lambda t: (t != ignore_index).to(input.dtype))
        smooth = -(wl.sum(dim=cdim) * mine)
        loss = loss * (1 - eps) + smooth * (eps / C)
    return _reduce(loss, reduction, w.sum())


def _class_view(weight: Tensor, ndim: int, cdim: int) -> Tensor:
    return weight.reshape(tuple(weight.shape[0] if d == cdim else 1 for d in range(ndim)))


def _elementwise_loss(name, input, target, reduction, size_average=None, reduce=None):  # noqa: A002
    _legacy(name, size_average, reduce)
    _check(name, input=input, target=target)
    _check_reduction(name, reduction)
    return _reduce(dispatch("nn." + name, _no_partial(input), _no_partial(target)), reduction)


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):  # noqa: A002
    """Squared error ``(input - target) ** 2`` reduced (``torch.nn.functional.mse_loss``).
    SBP: elementwise (splits pass), then a sum/mean that gives P over split dims."""
    if weight is not None:
        raise NotImplementedError("mse_loss: weight= is not supported")
    return _elementwise_loss("mse_loss", input, target, reduction, size_average, reduce)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):  # noqa: A002
    """Absolute error ``|input - target|`` reduced (``torch.nn.functional.l1_loss``);
    layouts as :func:`mse_loss`."""
    if weight is not None:
        raise NotImplementedError("l1_loss: weight= is not supported")
    return _elementwise_loss("l1_loss", input, target, reduction, size_average, reduce)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None,  # noqa: A002
                                     reduce=None, reduction="mean", pos_weight=None):
    """Sigmoid + binary cross entropy, stable (``torch.nn.functional.
    binary_cross_entropy_with_logits``): ``weight`` broadcasts to the input, ``pos_weight``
    (C,) weighs positives per class (last dim). SBP: elementwise with broadcasting, then a
    sum/mean that gives P over split dims."""
    _legacy("binary_cross_entropy_with_logits", size_average, reduce)
    _check("binary_cross_entropy_with_logits", input=input, target=target, weight=weight,
           pos_weight=pos_weight)
    _check_reduction("binary_cross_entropy_with_logits", reduction)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"binary_cross_entropy_with_logits: target shape "
                         f"{tuple(target.shape)} must equal the input's {tuple(input.shape)}")
    loss = _opt("nn.bce_with_logits", (_no_partial(input), _no_partial(target)),
                ("weight", _no_partial(weight) if weight is not None else None),
                ("pos_weight", _no_partial(pos_weight) if pos_weight is not None else None))
    return _reduce(loss, reduction)


# ------------------------------------------------------------------ more activations
# Elementwise, one registered op each (kernels and rules in sbpflow.ops.nn):
# splits pass, a P input is boxed first (none is linear). ``inplace`` as :func:`relu`.
def _activation(name: str, input: Tensor, inplace: bool = False, **attrs) -> Tensor:  # noqa: A002
    _check(name, input=input)
    return _inplace(input, dispatch("nn." + name, input, **attrs), inplace)


def leaky_relu(input, negative_slope: float = 0.01, inplace: bool = False):  # noqa: A002
    """``x`` where ``x > 0`` else ``negative_slope * x`` (``torch.nn.functional.leaky_relu``)."""
    return _activation("leaky_relu", input, inplace, negative_slope=negative_slope)


def elu(input, alpha: float = 1.0, inplace: bool = False):  # noqa: A002
    """``x`` where ``x > 0`` else ``alpha * (exp(x) - 1)`` (``torch.nn.functional.elu``)."""
    return _activation("elu", input, inplace, alpha=alpha)


def celu(input, alpha: float = 1.0, inplace: bool = False):  # noqa: A002
    """``max(0, x) + min(0, alpha * (exp(x / alpha) - 1))`` (``torch.nn.functional.celu``).

    Raises:
        ValueError: ``alpha == 0``.
    """
    if alpha == 0:
        raise ValueError("celu: alpha must not be 0 (it divides x)")
    return _activation("celu", input, inplace, alpha=alpha)


def selu(input, inplace: bool = False):  # noqa: A002
    """``scale * elu(x, alpha)`` with SELU's constants (``torch.nn.functional.selu``)."""
    return _activation("selu", input, inplace)


def relu6(input, inplace: bool = False):  # noqa: A002
    """``min(max(x, 0), 6)`` (``torch.nn.functional.relu6``)."""
    return _activation("relu6", input, inplace)


def hardtanh(input, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):  # noqa: A002
    """``x`` clamped to ``[min_val, max_val]`` (``torch.nn.functional.hardtanh``; the
    gradient is 0 outside the open interval).

    Raises:
        ValueError: ``min_val > max_val``.
    """
    if min_val > max_val:
        raise ValueError(f"hardtanh: min_val ({min_val}) cannot be greater than max_val "
                         f"({max_val})")
    return _activation("hardtanh", input, inplace, min_val=min_val, max_val=max_val)


def hardsigmoid(input, inplace: bool = False):  # noqa: A002
    """``relu6(x + 3) / 6`` (``torch.nn.functional.hardsigmoid``)."""
    return _activation("hardsigmoid", input, inplace)


def hardswish(input, inplace: bool = False):  # noqa: A002
    """``x * relu6(x + 3) / 6`` (``torch.nn.functional.hardswish``, MobileNetV3)."""
    return _activation("hardswish", input, inplace)


def mish(input, inplace: bool = False):  # noqa: A002
    """``x * tanh(softplus(x))`` (``torch.nn.functional.mish``)."""
    return _activation("mish", input, inplace)


def logsigmoid(input):  # noqa: A002
    """``log(sigmoid(x))``, stable (``torch.nn.functional.logsigmoid``)."""
    return _activation("logsigmoid", input)


def softsign(input):  # noqa: A002
    """``x / (1 + |x|)`` (``torch.nn.functional.softsign``)."""
    return _activation("softsign", input)


def tanhshrink(input):  # noqa: A002
    """``x - tanh(x)`` (``torch.nn.functional.tanhshrink``)."""
    return _activation("tanhshrink", input)


def _lambd(name: str, lambd: float) -> float:
    if lambd < 0:
        raise ValueError(f"{name}: lambd must be >= 0, got {lambd}")
    return lambd


def softshrink(input, lambd: float = 0.5):  # noqa: A002
    """``x - lambd`` above ``lambd``, ``x + lambd`` below ``-lambd``, else 0
    (``torch.nn.functional.softshrink``). Raises ValueError for ``lambd < 0``."""
    return _activation("softshrink", input, lambd=_lambd("softshrink", lambd))


def hardshrink(input, lambd: float = 0.5):  # noqa: A002
    """``x`` where ``|x| > lambd`` else 0 (``torch.nn.functional.hardshrink``)."""
    return _activation("hardshrink", input, lambd=lambd)


def threshold(input, threshold: float, value: float, inplace: bool = False):  # noqa: A002
    """``x`` where ``x > threshold`` else ``value`` (``torch.nn.functional.threshold``)."""
    return _activation("threshold", input, inplace, threshold=threshold, value=value)


def glu(input, dim: int = -1):  # noqa: A002
    """Gated linear unit (``torch.nn.functional.glu``): ``a * sigmoid(b)`` with ``a, b``
    the halves of ``input`` along ``dim``; shape (..., 2n, ...) -> (..., n, ...).

    SBP: splits of the other dims pass; a split ``dim`` is gathered first (its halves
    live on different ranks); a P input is summed first.

    Raises:
        ValueError: ``input`` is 0-d or ``dim`` has an odd size. IndexError: ``dim`` out
        of range.
    """
    _check("glu", input=input)
    if input.ndim == 0:
        raise ValueError("glu: does not support 0-dim (scalar) tensors")
    d = _dim(dim, input.ndim, "glu")
    if input.shape[d] % 2:
        raise ValueError(f"glu: halving dimension must be even, but dim {dim} of shape "
                         f"{tuple(input.shape)} has size {input.shape[d]}")
    return dispatch("nn.glu", input, dim=d)


def softmin(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002
    """``softmax(-x, dim)`` (``torch.nn.functional.softmin``); layouts and collectives as
    :func:`softmax` (over a split ``dim``: all-reduce MAX and SUM, no gather)."""
    _check("softmin", input=input)
    return softmax(-input, dim, dtype=dtype)


def prelu(input, weight):  # noqa: A002
    """``x`` where ``x >= 0`` else ``weight * x`` (``torch.nn.functional.prelu``); see
    :func:`sbpflow.ops.nn.prelu` (shapes, SBP, errors)."""
    _check("prelu", input=input, weight=weight)
    return _prelu_op(input, weight)


# ------------------------------------------------------------------ in-place activations (issue 21)
# ``F.<name>_(x, ...)``: torch's in-place forms, through the one in-place dispatch path
# (:func:`sbpflow.ops.dispatch.dispatch_inplace`) with the activation ops registered in
# :mod:`sbpflow.ops.nn`: x keeps its storage and layout (a split or B shard is rewritten
# locally; a P tensor's value is computed, then boxed back into P). A leaf that requires
# grad raises as in torch.
def _inplace_activation(name: str, op: str, input, run, **attrs) -> Tensor:  # noqa: A002
    _check(name, input=input)
    return dispatch_inplace(input, name, op, (), attrs, run)


def relu_(input):  # noqa: A002
    """In place ``max(x, 0)`` (``torch.nn.functional.relu_``)."""
    return _inplace_activation("relu_", "relu", input, torch.relu_)


def elu_(input, alpha: float = 1.0):  # noqa: A002
    """In place :func:`elu` (``torch.nn.functional.elu_``)."""
    return _inplace_activation("elu_", "nn.elu", input, lambda t: F.elu_(t, alpha),
                               alpha=alpha)


def celu_(input, alpha: float = 1.0):  # noqa: A002
    """In place :func:`celu` (``torch.nn.functional.celu_``). Raises ValueError for
    ``alpha == 0``."""
    if alpha == 0:
        raise ValueError("celu_: alpha must not be 0 (it divides x)")
    return _inplace_activation("celu_", "nn.celu", input, lambda t: F.celu_(t, alpha),
                               alpha=alpha)


def selu_(input):  # noqa: A002
    """In place :func:`selu` (``torch.nn.functional.selu_``)."""
    return _inplace_activation("selu_", "nn.selu", input, F.selu_)


def hardtanh_(input, min_val: float = -1.0, max_val: float = 1.0):  # noqa: A002
    """In place :func:`hardtanh` (``torch.nn.functional.hardtanh_``). Raises ValueError
    for ``min_val > max_val``."""
    if min_val > max_val:
        raise ValueError(f"hardtanh_: min_val ({min_val}) cannot be greater than max_val "
                         f"({max_val})")
    return _inplace_activation("hardtanh_", "nn.hardtanh", input,
                               lambda t: F.hardtanh_(t, min_val, max_val),
                               min_val=min_val, max_val=max_val)


def leaky_relu_(input, negative_slope: float = 0.01):  # noqa: A002
    """In place :func:`leaky_relu` (``torch.nn.functional.leaky_relu_``)."""
    return _inplace_activation("leaky_relu_", "nn.leaky_relu", input,
                               lambda t: F.leaky_relu_(t, negative_slope),
                               negative_slope=negative_slope)


def threshold_(input, threshold: float, value: float):  # noqa: A002
    """In place :func:`threshold` (``torch.nn.functional.threshold_``)."""
    return _inplace_activation("threshold_", "nn.threshold", input,
                               lambda t: F.threshold_(t, threshold, value),
                               threshold=threshold, value=value)


def _rrelu_train(input, lower: float, upper: float) -> Tensor:  # noqa: A002
    """rrelu in training: torch draws one uniform slope in [lower, upper] per element
    ``<= 0``, in order, so the draw depends on the values: the input is made whole (B) and
    every rank runs torch's rrelu on it from the same generator state, keeping its shard
    (:func:`sbpflow.ops.creation.replay_draw`; per-shard mode: each rank its region)."""
    if input.is_local:
        return Tensor(torch.rrelu(input._local, lower, upper, True))
    pl, shape = input.placement, tuple(input.shape)
    nd = tuple(broadcast if s.is_partial() else s for s in input.sbp)
    local = replay_draw("rrelu", lambda x, generator: torch.rrelu(x, lower, upper, True,
                                                                  generator),
                        [input], shape, pl, nd, None,
                        lambda i, s, dev: torch.zeros(s, dtype=input.dtype, device=dev),
                        input.dtype)
    return Tensor(local, pl, nd, shape)


def rrelu(input, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False,  # noqa: A002
          inplace: bool = False):
    """Randomized leaky ReLU (``torch.nn.functional.rrelu``, Xu et al. 2015): ``x`` where
    ``x > 0``, else ``a * x`` with ``a`` drawn uniformly from ``[lower, upper]`` per element
    in training, and ``a = (lower + upper) / 2`` (a :func:`leaky_relu`) otherwise.

    Training is layout invariant: torch draws one uniform per element ``<= 0``, in order,
    so the input is made whole (B; a P input is summed) and every rank runs torch's rrelu
    from the same generator state, keeping its shard of the result (memory and time of
    the whole tensor per rank, plus the gather). The output keeps the input's splits (P
    -> B). Ranks outside the placement advance their generator by a stand-in draw of the
    same shape, which need not consume as many numbers (the count depends on the values).
    Evaluation: elementwise, no communication. ``inplace`` (training) as :func:`relu`.

    Raises:
        ValueError: ``lower > upper``.
    """
    _check("rrelu", input=input)
    if lower > upper:
        raise ValueError(f"rrelu: lower bound ({lower}) must not be greater than upper bound "
                         f"({upper})")
    if not training:
        return _activation("leaky_relu", input, inplace, negative_slope=(lower + upper) / 2)
    return _inplace(input, _rrelu_train(input, lower, upper), inplace)


def rrelu_(input, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False):  # noqa: A002
    """In place :func:`rrelu` (``torch.nn.functional.rrelu_``): evaluation writes the leaky
    ReLU into ``input`` (:func:`leaky_relu_`); training runs torch's in-place rrelu on a
    local tensor and, on a global one, rebinds ``input`` to the layout-invariant result
    (as ``inplace=True`` does elsewhere; the autograd graph of the old value is kept)."""
    _check("rrelu_", input=input)
    if lower > upper:
        raise ValueError(f"rrelu_: lower bound ({lower}) must not be greater than upper bound "
                         f"({upper})")
    if not training:
        slope = (lower + upper) / 2
        return _inplace_activation("rrelu_", "nn.leaky_relu", input,
                                   lambda t: F.leaky_relu_(t, slope), negative_slope=slope)
    if input.is_local:
        torch.rrelu_(input._local, lower, upper, True)
        return input
    return _inplace(input, _rrelu_train(input, lower, upper), True)


# ------------------------------------------------------------------ more losses
# Pointwise losses are one registered op each (reduction='none', splits pass), then the
# reduction: a sum or mean over split dims gives P (the global-batch value), no gather.
def _check_loss(name, reduction, size_average, reduce, allowed=_REDUCTIONS, **tensors):
    _legacy(name, size_average, reduce)
    _check(name, **tensors)
    if reduction not in allowed:
        raise ValueError(f"{name}: reduction must be one of {allowed}, got {reduction!r}")


def kl_div(input, target, size_average=None, reduce=None, reduction: str = "mean",  # noqa: A002
           log_target: bool = False):
    """Kullback-Leibler divergence of log-probabilities ``input`` from ``target``
    (``torch.nn.functional.kl_div``): pointwise ``target * (log(target) - input)``
    (``exp(target) * (target - input)`` with ``log_target``), 0 where ``target == 0``.

    ``reduction``: ``'none'``, ``'sum'``, ``'mean'`` (over all elements), ``'batchmean'``
    (sum / batch size ``input.shape[0]``: the mathematical KL divergence). SBP: pointwise,
    then a sum that gives P over split dims.
    """
    _check_loss("kl_div", reduction, size_average, reduce, (*_REDUCTIONS, "batchmean"),
                input=input, target=target)
    loss = dispatch("nn.kl_div", input, target, log_target=log_target)
    if reduction == "batchmean":
        return loss.sum() / input.shape[0] if input.ndim else loss.sum()
    return _reduce(loss, reduction)


def smooth_l1_loss(input, target, size_average=None, reduce=None,  # noqa: A002
                   reduction: str = "mean", beta: float = 1.0):
    """``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta``, ``d = input -
    target`` (``torch.nn.functional.smooth_l1_loss``); reduced as :func:`mse_loss`.

    Raises:
        ValueError: ``beta < 0``, a bad ``reduction``.
    """
    _check_loss("smooth_l1_loss", reduction, size_average, reduce, input=input, target=target)
    if beta < 0:
        raise ValueError(f"smooth_l1_loss: beta must be >= 0, got {beta}")
    return _reduce(dispatch("nn.smooth_l1_loss", input, target, beta=beta), reduction)


def huber_loss(input, target, reduction: str = "mean", delta: float = 1.0,  # noqa: A002
               weight=None):
    """``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)``
    (``torch.nn.functional.huber_loss``); ``weight`` (input's shape) multiplies the
    pointwise loss before the reduction.

    Raises:
        ValueError: ``delta <= 0``, a ``weight`` not of the input's shape, a bad reduction.
    """
    _check_loss("huber_loss", reduction, None, None, input=input, target=target, weight=weight)
    if delta <= 0:
        raise ValueError(f"huber_loss: delta must be > 0, got {delta}")
    loss = dispatch("nn.huber_loss", input, target, delta=delta)
    if weight is not None:
        if tuple(weight.shape) != tuple(input.shape):
            raise ValueError(f"huber_loss: weight of shape {tuple(weight.shape)} must have the "
                             f"input's shape {tuple(input.shape)}")
        loss = loss * weight
    return _reduce(loss, reduction)


def binary_cross_entropy(input, target, weight=None, size_average=None,  # noqa: A002
                         reduce=None, reduction: str = "mean"):
    """Binary cross entropy of probabilities ``input`` in [0, 1] against ``target``
    (``torch.nn.functional.binary_cross_entropy``; logs clamped at -100 as torch's);
    ``weight`` broadcasts to the input and rescales each element. SBP: pointwise with
    broadcasting (the weight split where it has full size), then a sum/mean that gives P.

    Raises:
        ValueError: ``target`` not of the input's shape, a bad reduction.
    """
    _check_loss("binary_cross_entropy", reduction, size_average, reduce, input=input,
                target=target, weight=weight)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"binary_cross_entropy: target of shape {tuple(target.shape)} must "
                         f"have the input's shape {tuple(input.shape)}")
    extra = () if weight is None else (weight,)
    return _reduce(dispatch("nn.binary_cross_entropy", input, target, *extra), reduction)


def margin_ranking_loss(input1, input2, target, margin: float = 0.0, size_average=None,
                        reduce=None, reduction: str = "mean"):
    """``max(0, -target * (input1 - input2) + margin)`` (``torch.nn.functional.
    margin_ranking_loss``), ``target`` of 1 or -1; pointwise with broadcasting, then
    reduced (P over split dims).

    Raises:
        ValueError: inputs of different numbers of dims, a bad reduction.
    """
    _check_loss("margin_ranking_loss", reduction, size_average, reduce, input1=input1,
                input2=input2, target=target)
    if not input1.ndim == input2.ndim == target.ndim:
        raise ValueError(f"margin_ranking_loss: all inputs need the same number of dims, got "
                         f"shapes {tuple(input1.shape)}, {tuple(input2.shape)}, "
                         f"{tuple(target.shape)}")
    return _reduce(dispatch("nn.margin_ranking_loss", input1, input2, target, margin=margin),
                   reduction)


# ------------------------------------------------------------------ distances (compositions)
def normalize(input, p: float = 2.0, dim: int = 1, eps: float = 1e-12):  # noqa: A002
    """``torch.nn.functional.normalize``: ``x / max(||x||_p over dim, eps)``."""
    return input / input.norm(p, dim=dim, keepdim=True).clamp(min=eps)


def cosine_similarity(x1, x2, dim: int = 1, eps: float = 1e-8):
    """``torch.nn.functional.cosine_similarity``: ``sum(x1/|x1| * x2/|x2|)`` over ``dim``
    with broadcasting, each norm clamped at ``eps``. SBP: the norms and the sum over a
    split ``dim`` are P, all-reduced where a non-linear step needs them."""
    _check("cosine_similarity", x1=x1, x2=x2)
    n1 = x1.norm(2, dim=dim, keepdim=True).clamp(min=eps)
    n2 = x2.norm(2, dim=dim, keepdim=True).clamp(min=eps)
    return ((x1 / n1) * (x2 / n2)).sum(dim=dim)


def pairwise_distance(x1, x2, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False):
    """``||x1 - x2 + eps||_p`` over the last dim (``torch.nn.functional.pairwise_distance``,
    ``torch.pairwise_distance``); shapes broadcast, (N, D) -> (N,). SBP: a split batch
    passes; a split last dim gives a norm over it (sum of powers P, all-reduced once)."""
    _check("pairwise_distance", x1=x1, x2=x2)
    dim = max(x1.ndim, x2.ndim) - 1
    return (x1 - x2 + eps).norm(p, dim=dim, keepdim=keepdim)


def pdist(input, p: float = 2.0):  # noqa: A002
    """p-norm distances between every pair of rows of (N, M) -> (N * (N - 1) / 2,), the
    upper triangle of ``cdist(input, input)`` row by row (``torch.nn.functional.pdist``,
    ``torch.pdist``).

    SBP: none (every row meets every other): the input is gathered (B, a P input summed)
    and the output is B.

    Raises:
        ValueError: an input that is not 2-D, or ``p < 0``.
    """
    _check("pdist", input=input)
    if input.ndim != 2:
        raise ValueError(f"pdist only supports 2D tensors, got: {input.ndim}D")
    if p < 0:
        raise ValueError(f"pdist only supports non-negative p values, got {p}")
    return dispatch("nn.pdist", input, p=float(p))


def cosine_embedding_loss(input1, input2, target, margin: float = 0.0, size_average=None,
                          reduce=None, reduction: str = "mean"):
    """``1 - cos(x1, x2)`` where ``target == 1``, ``max(0, cos(x1, x2) - margin)`` where
    ``target == -1`` (``torch.nn.functional.cosine_embedding_loss``, ATen's formula:
    ``cos = <x1, x2> / sqrt((|x1|^2 + 1e-12)(|x2|^2 + 1e-12))``). Shapes: inputs (N, D) and
    target (N,), or (D,) and (). SBP: as :func:`cosine_similarity`, then reduced.

    Raises:
        ValueError: shapes other than those, a bad reduction.
    """
    _check_loss("cosine_embedding_loss", reduction, size_average, reduce, input1=input1,
                input2=input2, target=target)
    if target.ndim not in (0, 1) or input1.ndim != target.ndim + 1 or \
            input2.ndim != target.ndim + 1:
        raise ValueError(f"cosine_embedding_loss: expected inputs (N, D) with target (N,) or "
                         f"(D,) with (), got {tuple(input1.shape)}, {tuple(input2.shape)} and "
                         f"{tuple(target.shape)}")
    d = target.ndim
    eps = 1e-12
    prod = (input1 * input2).sum(dim=d)
    mag = ((input1 * input1).sum(dim=d) + eps) * ((input2 * input2).sum(dim=d) + eps)
    cos = prod / mag.sqrt()
    pos = sbp_where(target == 1, 1 - cos, 0.0)
    neg = sbp_where(target == -1, (cos - margin).clamp(min=0), 0.0)
    return _reduce(pos + neg, reduction)


def triplet_margin_loss(anchor, positive, negative, margin: float = 1.0, p: float = 2,
                        eps: float = 1e-6, swap: bool = False, size_average=None, reduce=None,
                        reduction: str = "mean"):
    """``max(d(a, p) - d(a, n) + margin, 0)`` with :func:`pairwise_distance` ``d``
    (``torch.nn.functional.triplet_margin_loss``); ``swap``: ``d(a, n)`` is the smaller of
    it and ``d(p, n)``. Inputs (N, D) or (D,) (distances over the last dim). SBP as
    :func:`pairwise_distance`.

    Raises:
        ValueError: inputs of different or unsupported numbers of dims, ``margin <= 0``.
    """
    _check_loss("triplet_margin_loss", reduction, size_average, reduce, anchor=anchor,
                positive=positive, negative=negative)
    if not anchor.ndim == positive.ndim == negative.ndim:
        raise ValueError(f"triplet_margin_loss: anchor, positive and negative need the same "
                         f"number of dims, got shapes {tuple(anchor.shape)}, "
                         f"{tuple(positive.shape)}, {tuple(negative.shape)}")
    if margin <= 0:
        raise ValueError(f"triplet_margin_loss: margin must be > 0, got {margin}")
    d_pos = pairwise_distance(anchor, positive, p, eps)
    d_neg = pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_neg = d_neg.minimum(pairwise_distance(positive, negative, p, eps))
    return _reduce((d_pos - d_neg + margin).clamp(min=0), reduction)


# ------------------------------------------------------------------ more losses (issue 21)
# Pointwise ones: one elementwise op (reduction='none', registered in sbpflow.ops.nn), then
# the reduction, so a split batch gives a P loss, never a gather. Per-sample ones (multi
# margin, multilabel margin, CTC): an op that takes a batch split, then the reduction.
# ``size_average``/``reduce`` (deprecated in torch) raise, as for the other losses.
def poisson_nll_loss(input, target, log_input: bool = True, full: bool = False,  # noqa: A002
                     size_average=None, eps: float = 1e-8, reduce=None,
                     reduction: str = "mean"):
    """Poisson negative log-likelihood (``torch.nn.functional.poisson_nll_loss``):
    ``exp(input) - target * input`` (``log_input``) or ``input - target * log(input +
    eps)``; ``full`` adds Stirling's ``target log(target) - target + 0.5 log(2 pi target)``
    where ``target > 1``. Shapes broadcast. SBP: elementwise (splits pass; a P input is
    summed first), then a sum/mean that gives P over split dims.

    Raises:
        ValueError: a bad ``reduction``, ``size_average``/``reduce`` given.
    """
    _check_loss("poisson_nll_loss", reduction, size_average, reduce, input=input,
                target=target)
    return _reduce(dispatch("nn.poisson_nll_loss", input, target, log_input=log_input,
                            full=full, eps=eps), reduction)


def gaussian_nll_loss(input, target, var, full: bool = False, eps: float = 1e-6,  # noqa: A002
                      reduction: str = "mean"):
    """Gaussian negative log-likelihood (``torch.nn.functional.gaussian_nll_loss``):
    ``0.5 (log(max(var, eps)) + (input - target)^2 / max(var, eps))`` (+ ``0.5 log(2 pi)``
    with ``full``); the clamp at ``eps`` passes no gradient, as torch's.

    Shapes: input and target (N, *); ``var`` the input's shape, one dim short of it (one
    variance per sample: unsqueezed), broadcastable to it with one dim of size 1, or a
    float. SBP: elementwise with broadcasting (var split where it has full size), then a
    sum/mean that gives P over split dims.

    Raises:
        ValueError: ``var`` of another shape, a negative ``var`` (checked on the values
            each rank holds: no collective), a bad ``reduction``.
    """
    _check_loss("gaussian_nll_loss", reduction, None, None, input=input, target=target,
                var=var if isinstance(var, Tensor) else None)
    if not isinstance(var, Tensor):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = full_like(input.detach(), float(var))
    else:
        var = _no_partial(var)  # (a P variance's summands may be negative)
        with torch.no_grad():
            if bool((var._local < 0).any()):
                raise ValueError("var has negative entry/entries")
    if tuple(var.shape) != tuple(input.shape):
        if tuple(input.shape[:-1]) == tuple(var.shape):
            var = var.unsqueeze(-1)
        elif not (input.ndim == var.ndim and sum(
                v for i, v in zip(input.shape, var.shape) if i != v) == 1):
            raise ValueError(f"gaussian_nll_loss: var of shape {tuple(var.shape)} is of "
                             f"incorrect size for input of shape {tuple(input.shape)}")
    return _reduce(dispatch("nn.gaussian_nll_loss", input, target, var, full=full, eps=eps),
                   reduction)


def hinge_embedding_loss(input, target, margin: float = 1.0, size_average=None,  # noqa: A002
                         reduce=None, reduction: str = "mean"):
    """``x`` where ``target == 1``, ``max(0, margin - x)`` where ``target == -1``
    (``torch.nn.functional.hinge_embedding_loss``; ATen's: other target values add both
    terms). Shapes broadcast. SBP as :func:`poisson_nll_loss`.

    Raises:
        ValueError: a bad ``reduction``, ``size_average``/``reduce`` given.
    """
    _check_loss("hinge_embedding_loss", reduction, size_average, reduce, input=input,
                target=target)
    return _reduce(dispatch("nn.hinge_embedding_loss", input, target, margin=margin),
                   reduction)


def soft_margin_loss(input, target, size_average=None, reduce=None,  # noqa: A002
                     reduction: str = "mean"):
    """Two-class logistic loss ``log(1 + exp(-target * input))`` (``torch.nn.functional.
    soft_margin_loss``), ``target`` of 1 or -1; ``'mean'`` over all elements. SBP as
    :func:`poisson_nll_loss`.

    Raises:
        ValueError: a bad ``reduction``, ``size_average``/``reduce`` given.
    """
    _check_loss("soft_margin_loss", reduction, size_average, reduce, input=input,
                target=target)
    return _reduce(dispatch("nn.soft_margin_loss", input, target), reduction)


def multilabel_soft_margin_loss(input, target, weight=None, size_average=None,  # noqa: A002
                                reduce=None, reduction: str = "mean"):
    """Multi-label one-versus-all logistic loss (``torch.nn.functional.
    multilabel_soft_margin_loss``): per sample ``-mean_c(y_c logsigmoid(x_c) + (1 - y_c)
    logsigmoid(-x_c))``, each class term times ``weight`` when given; torch's composition,
    op for op. Shapes: input and target (N, C) (or (C,)), weight broadcastable to them.

    SBP: elementwise, then the sum over the class dim: a split class dim gives a P loss
    per sample (no gather); a split batch stays split, and its mean/sum gives P.

    Raises:
        ValueError: a bad ``reduction``, ``size_average``/``reduce`` given.
    """
    _check_loss("multilabel_soft_margin_loss", reduction, size_average, reduce, input=input,
                target=target, weight=weight)
    loss = -(target * logsigmoid(input) + (1 - target) * logsigmoid(-input))
    if weight is not None:
        loss = loss * weight
    class_dim = input.ndim - 1
    C = input.shape[class_dim]
    loss = loss.sum(dim=class_dim) / C
    return _reduce(loss, reduction)


def _per_sample_target(name: str, input, target, want) -> None:  # noqa: A002
    if input.ndim not in (1, 2):
        raise ValueError(f"{name}: expected an input (N, C) or (C,), got shape "
                         f"{tuple(input.shape)}")
    if tuple(target.shape) != tuple(want):
        raise ValueError(f"{name}: input of shape {tuple(input.shape)} needs a target of "
                         f"shape {tuple(want)}, got {tuple(target.shape)}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"{name}: targets must be integer class indices, got {target.dtype}")


def multi_margin_loss(input, target, p: int = 1, margin: float = 1.0, weight=None,  # noqa: A002
                      size_average=None, reduce=None, reduction: str = "mean"):
    """Multi-class hinge loss (``torch.nn.functional.multi_margin_loss``): per sample
    ``sum_{i != y} w[y] max(0, margin - x[y] + x[i])^p / C``.

    Shapes: input (N, C) or (C,), target (N,) or () class indices, weight (C,).
    SBP: a batch split passes (torch's kernel on each shard; the class dim whole, a split
    one is re-split on the batch or gathered; the weight is used whole), then the
    mean/sum gives P. A P input is summed first.

    Raises:
        ValueError: ``p`` not 1 or 2, a weight that is not (C,), shapes, a bad
            ``reduction``. TypeError: non-integer targets.
    """
    _check_loss("multi_margin_loss", reduction, size_average, reduce, input=input,
                target=target, weight=weight)
    if p not in (1, 2):
        raise ValueError("multi_margin_loss: only p == 1 and p == 2 supported")
    _per_sample_target("multi_margin_loss", input, target, input.shape[:-1])
    if weight is not None and tuple(weight.shape) != (input.shape[-1],):
        raise ValueError(f"multi_margin_loss: weight must be one-dimensional of shape "
                         f"({input.shape[-1]},), got {tuple(weight.shape)}")
    w = () if weight is None else (weight.detach(),)  # torch: no gradient for weight
    return _reduce(dispatch("nn.multi_margin_loss", input, target, *w, p=p, margin=margin),
                   reduction)


def multilabel_margin_loss(input, target, size_average=None, reduce=None,  # noqa: A002
                           reduction: str = "mean"):
    """Multi-label hinge loss (``torch.nn.functional.multilabel_margin_loss``): per sample
    ``sum_{j, i} max(0, 1 - (x[y_j] - x[i])) / C`` over the target classes ``y_j`` (the
    target row's leading non-negative entries, up to the first -1) and the other classes
    ``i``. Shapes: input (N, C) or (C,), target of the same shape, int64. SBP as
    :func:`multi_margin_loss`.

    Raises:
        ValueError: shapes, a bad ``reduction``. TypeError: non-integer targets.
    """
    _check_loss("multilabel_margin_loss", reduction, size_average, reduce, input=input,
                target=target)
    _per_sample_target("multilabel_margin_loss", input, target, input.shape)
    return _reduce(dispatch("nn.multilabel_margin_loss", input, target), reduction)


def triplet_margin_with_distance_loss(anchor, positive, negative, *, distance_function=None,
                                      margin: float = 1.0, swap: bool = False,
                                      reduction: str = "mean"):
    """``max(margin + d(a, p) - d(a, n), 0)`` with a distance function ``d`` of two
    tensors (``torch.nn.functional.triplet_margin_with_distance_loss``; default
    :func:`pairwise_distance`); ``swap``: ``d(a, n)`` is the smaller of it and ``d(p, n)``.
    ``distance_function`` receives sbpflow tensors and must return one (any composition
    of sbpflow ops). SBP: the distance's (a split batch passes; a split feature dim gives
    P distances, all-reduced for the clamp), then the reduction (P over a split batch).

    Raises:
        ValueError: inputs of different numbers of dims, ``margin <= 0``, a bad
            ``reduction``.
    """
    _check_loss("triplet_margin_with_distance_loss", reduction, None, None, anchor=anchor,
                positive=positive, negative=negative)
    if margin <= 0:
        raise ValueError(f"triplet_margin_with_distance_loss: margin must be greater than 0, "
                         f"got {margin}")
    if not anchor.ndim == positive.ndim == negative.ndim:
        raise ValueError(f"triplet_margin_with_distance_loss: anchor, positive and negative "
                         f"need the same number of dims, got shapes {tuple(anchor.shape)}, "
                         f"{tuple(positive.shape)}, {tuple(negative.shape)}")
    dist = pairwise_distance if distance_function is None else distance_function
    dist_pos = dist(anchor, positive)
    dist_neg = dist(anchor, negative)
    if swap:
        dist_neg = dist_neg.minimum(dist(positive, negative))
    return _reduce((margin + dist_pos - dist_neg).clamp(min=0), reduction)


def _lengths(name: str, lengths, like: Tensor) -> Tensor:
    """CTC lengths as an int64 sbpflow tensor: a tuple/list of ints becomes a local tensor,
    or a B global one on ``like``'s placement."""
    if isinstance(lengths, Tensor):
        return lengths
    if isinstance(lengths, torch.Tensor):
        raise TypeError(f"ctc_loss: {name} is a torch.Tensor; wrap it with "
                        f"sbpflow.from_torch or pass a tuple of ints")
    t = torch.as_tensor(list(lengths), dtype=torch.int64)
    if like.is_local:
        return Tensor(t)
    return Tensor(t.to(like._local.device), like.placement,
                  (broadcast,) * like.placement.ndim, tuple(t.shape))


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank: int = 0,
             reduction: str = "mean", zero_infinity: bool = False):
    """Connectionist Temporal Classification loss (``torch.nn.functional.ctc_loss``, Graves
    et al. 2006), torch's kernel per sample.

    Shapes: log_probs (T, N, C) (log-softmax over C) or unbatched (T, C); targets (N, S)
    padded, or the targets of all samples concatenated (sum(target_lengths),);
    input_lengths and target_lengths (N,) int tensors or tuples of ints. ``'mean'``
    divides each sample's loss by its target length (at least 1), then averages over the
    batch; ``zero_infinity`` zeroes infinite losses and their gradients.

    SBP: the batch split: log_probs S(1) with padded targets and lengths S(0) gives the
    (N,) losses S(0) and a P ``'mean'``/``'sum'`` (other layouts are boxed to it);
    concatenated targets and unbatched inputs run whole (B). A P input is summed first.

    Raises:
        ValueError: shapes that do not match, a bad ``reduction``.
    """
    _check_reduction("ctc_loss", reduction)
    _check("ctc_loss", log_probs=log_probs, targets=targets)
    input_lengths = _lengths("input_lengths", input_lengths, log_probs)
    target_lengths = _lengths("target_lengths", target_lengths, log_probs)
    _check("ctc_loss", log_probs=log_probs, targets=targets, input_lengths=input_lengths,
           target_lengths=target_lengths)
    if log_probs.ndim not in (2, 3):
        raise ValueError(f"ctc_loss: log_probs must be (T, N, C) or (T, C), got shape "
                         f"{tuple(log_probs.shape)}")
    n = (log_probs.shape[1],) if log_probs.ndim == 3 else ()
    for k, t in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if tuple(t.shape) != n:
            raise ValueError(f"ctc_loss: {k} must have shape {n} for log_probs of shape "
                             f"{tuple(log_probs.shape)}, got {tuple(t.shape)}")
    loss = dispatch("nn.ctc_loss", log_probs, targets, input_lengths, target_lengths,
                    blank=blank, zero_infinity=zero_infinity)
    if reduction == "mean":
        return (loss / target_lengths.to(loss.dtype).clamp(min=1)).mean()
    return _reduce(loss, reduction)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None,  # noqa: A002
                         reduction: str = "mean", ignore_index: int | None = None,
                         label_smoothing: float = 0.0, options=None):
    """Cross entropy of the logits ``linear(input, linear_weight, linear_bias)``
    (``torch.nn.functional.linear_cross_entropy``; torch's reference path: the linear,
    reshaped to (N, C, d_1, ..., d_K), then :func:`cross_entropy`).

    Shapes: input (in_features,) or (N, in_features); linear_weight (C, in_features) or
    (C, d_1, ..., d_K, in_features) (K-dimensional loss, batched input only);
    linear_bias (C, d_1, ..., d_K); target class indices () / (N,) / (N, d_1, ...) or
    probabilities of the logits' shape. ``ignore_index`` None means -100 for class
    indices and is refused with probabilities, as torch.

    ``options`` (torch's ``LinearCrossEntropyOptions``, a chunking of the batch to save
    memory) is accepted and not used: the values are the reference path's. On global
    tensors a class-split weight (S(0), vocabulary-parallel) gives class-split logits and
    :func:`cross_entropy`'s algorithm (all-reduces of one value per row, no gather of the
    logits); a split batch passes.

    Raises:
        ValueError: shapes, ``ignore_index`` with probabilities, and what
            :func:`cross_entropy` raises.
    """
    _check("linear_cross_entropy", input=input, linear_weight=linear_weight, target=target,
           linear_bias=linear_bias, weight=weight)
    if input.ndim not in (1, 2):
        raise ValueError(f"linear_cross_entropy: expected input with dimensionality 1 or 2, "
                         f"got {input.ndim}")
    if linear_weight.ndim < 2:
        raise ValueError(f"linear_cross_entropy: expected linear_weight with dimensionality "
                         f"at least 2, got {linear_weight.ndim}")
    batch, in_features = tuple(input.shape[:-1]), input.shape[-1]
    if in_features != linear_weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: expected equal input and linear_weight last "
                         f"dimensions (in_features), got {in_features} and "
                         f"{linear_weight.shape[-1]}")
    C, out_features = linear_weight.shape[0], tuple(linear_weight.shape[1:-1])
    if linear_bias is not None and tuple(linear_bias.shape) != (C, *out_features):
        raise ValueError(f"linear_cross_entropy: expected linear_bias shape "
                         f"{(C, *out_features)}, got {tuple(linear_bias.shape)}")
    if out_features and not batch:
        raise ValueError(f"linear_cross_entropy: K-dimensional loss defined by linear_weight "
                         f"shape {tuple(linear_weight.shape)} requires batched input "
                         f"(N, {in_features}), got shape {tuple(input.shape)}")
    logits_shape = (*batch, C, *out_features)
    if tuple(target.shape) == logits_shape and ignore_index is not None:
        raise ValueError("linear_cross_entropy: ignore_index cannot be specified when target "
                         "contains probabilities")
    ignore_index = -100 if ignore_index is None else ignore_index
    if out_features:
        n = math.prod(out_features, start=C)
        linear_weight = linear_weight.reshape(n, in_features)
        if linear_bias is not None:
            linear_bias = linear_bias.reshape(n)
    logits = linear(input, linear_weight, linear_bias)
    if out_features:
        logits = logits.reshape(logits_shape)
    return cross_entropy(logits, target, weight=weight, reduction=reduction,
                         ignore_index=ignore_index, label_smoothing=label_smoothing)


# ------------------------------------------------------------------ grouped GEMM (issue 21)
def grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """Grouped matrix multiply (``torch.nn.functional.grouped_mm``, torch's CPU kernel;
    mixture-of-experts layers): one GEMM per group, the groups enumerated by a 3-D
    operand's dim 0 or delimited along a 2-D operand's jagged dim by ``offs`` (int32,
    increasing ends).

    Shapes: (M, K) x (G, K, N) with offs -> (M, N); (G, M, K) x (G, K, N) -> (G, M, N);
    (M, K) x (K, N) with offs (K jagged) -> (G, M, N); (G, M, K) x (K, N) with offs ->
    (M, N). torch's CPU kernel wants strides that are multiples of 16 bytes.

    SBP: 3-D x 3-D without bias: the group split (S(0) both) and a split of A's rows
    (S(1), B) pass; every other form runs replicated (inputs boxed to B).
    """
    _check("grouped_mm", mat_a=mat_a, mat_b=mat_b, offs=offs, bias=bias)
    return _opt("nn.grouped_mm", (mat_a, mat_b), ("offs", offs), ("bias", bias),
                out_dtype=out_dtype)


# torch.nn.functional's functions called with sbpflow tensors run these (a table built once)
_api.route_module(F, globals())
