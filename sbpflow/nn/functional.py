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
from ..ops.creation import full, rand
from ..ops.dispatch import dispatch
from ..ops.index import one_hot  # torch.nn.functional.one_hot
from ..ops.matmul import einsum
from ..ops.nn import pick_target_layout
from ..ops.nn import prelu as _prelu_op
from ..ops.nn import softmax as _softmax_op
from ..ops.pointwise import where as sbp_where
from ..ops.random import dropout as _dropout
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


# torch.nn.functional's functions called with sbpflow tensors run these (a table built once)
_api.route_module(F, globals())
