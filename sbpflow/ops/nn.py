"""Registered ops of :mod:`sbpflow.nn.functional`, their one-axis SBP rules, and the few
global helpers that run their own collectives (all-reduce MAX for a softmax over a split
dim, lookups into a split vocabulary / class dim).

Op names carry an ``nn.`` prefix (``nn.linear``...), apart from the core activations.
Rules (one mesh axis):

=================================== ================================================
op                                  signatures besides all-B
=================================== ================================================
linear ``(x, w[, b])``              einsum ``...i,oi->...o`` (:func:`._rules.einsum`):
                                    batch S -> S; w S(0) (b S(0)) -> S(last);
                                    x S(last), w S(1) (b P) -> P; P in x or w (b P) -> P
conv{1,2,3}d ``(x, w[, b])``        x S(0) -> S(0); groups == 1: w S(0) (b S(0)) -> S(C);
                                    x S(C), w S(1) (b P) -> P; P in x or w (b P) -> P
conv_transpose{1,2,3}d              as conv with the weight's dims swapped (C_in, C_out):
                                    w S(1) (b S(0)) -> S(C); x S(C), w S(0) -> P
conv_tbc ``(x (T,B,C), w, b)``      x S(1) -> S(1); w S(2) (b S(0)) -> S(2); x S(2),
                                    w S(1) (b P) -> P; P in x or w (b P) -> P
pools, interpolate, pad             leading (batch, channel) splits pass; P -> P when
                                    the op is linear (avg pools, interpolate, replicate
                                    and reflect pads, constant pad with value 0)
max_unpool{1,2,3}d ``(x, idx)``     leading splits pass in x and idx alike; (P, B) -> P
fractional_max_pool{2,3}d           N or C split in x and the samples (N, C, k) alike
unfold, fold                        batch split passes (im2col's dim 1 is C * kh * kw:
                                    a channel split does not); P -> P
local_response_norm, cross_map_lrn  every split but the channels' passes
channel_shuffle                     every split but the channels' passes; P -> P
affine_grid ``(theta)``             batch split passes; P -> P
grid_sample ``(x, grid)``           N split in both; x S(1) with grid B; grid split on
                                    an output position dim with x B; (P, B) -> P
pdist                               none (all-B: every row meets every other)
pixel_shuffle, pixel_unshuffle      batch splits pass (C is mixed with H, W); P -> P
instance_norm (no running stats)    N and C splits pass (statistics per (n, c))
layer_norm, rms_norm, group_norm    leading splits pass (normalised dims whole; weight
                                    and bias B)
softmax, log_softmax (whole dim)    splits of the other dims pass
scaled_dot_product_attention        batch/head splits pass (k, v and mask split where
                                    they are full size); query-length split when not
                                    causal; v S(last) -> S(last); v P -> P
mse, l1, bce_with_logits (none)     :func:`._rules.elementwise`
poisson_nll, gaussian_nll, hinge    :func:`._rules.elementwise` (reduction 'none')
embedding, soft_margin (none)
multi_margin, multilabel_margin     (N, C) input and targets S(0) (weight B) -> S(0)
ctc_loss                            log_probs S(1), padded targets and lengths S(0)
                                    -> S(0); concatenated targets: all-B
grouped_mm (3-D x 3-D, no offs)     groups S(0) both -> S(0); A's rows S(1) -> S(1)
=================================== ================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..boxing.steps import HALF, upcast
from ..distributed import all_reduce, tracing
from ..sbp import SBP, Split, broadcast, partial_sum
from ..tensor import Tensor
from .algorithms import AxisSum
from .api import method
from .args import norm_dim
from .cast import cast
from .chooser import axis_collectives_cost, split_axes
from .dispatch import dispatch
from .registry import Meta, probing, register, register_algorithm
from .rules import elementwise

S, B, P = Split, broadcast, partial_sum


# ------------------------------------------------------------------ rule helpers
def _optional(kernel):
    """Kernel wrapper: trailing tensors are the optional arguments named in ``parts``."""

    def run(*tensors, parts=(), **attrs):
        n = len(tensors) - len(parts)
        return kernel(*tensors[:n], **dict(zip(parts, tensors[n:])), **attrs)

    return run


def _leading(count, linear=False):
    """Rule: splits of the first ``count(meta0, attrs)`` dims of input 0 pass to the output
    (other inputs B); ``linear``: (P, B...) -> P when ``linear(attrs)`` is true."""

    def rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
        rest = (B,) * (len(metas) - 1)
        sigs = [(Split(d), *rest, Split(d)) for d in range(count(metas[0], attrs))]
        if linear and linear(attrs):
            sigs.append((P, *rest, P))
        return sigs

    return rule


def _empty_safe(kernel, out_dim):
    """Kernel wrapper for uneven splits that leave a rank an empty shard (torch's kernels
    reject some empty inputs): each empty dim is grown to 1 with zeros, the kernel runs,
    and the output dim ``out_dim(i, d, shapes)`` that input ``i``'s dim ``d`` maps to is
    cut back to 0 (``None``: a contracted dim, whose zeros add nothing)."""

    def run(*ts, **attrs):
        if all(t.numel() for t in ts):
            return kernel(*ts, **attrs)
        shapes = [tuple(t.shape) for t in ts]
        cut, grown = set(), []
        for i, t in enumerate(ts):
            if t.numel():
                grown.append(t)
                continue
            for d, n in enumerate(t.shape):
                o = out_dim(i, d, shapes) if n == 0 else None
                if o is not None:
                    cut.add(o)
            g = t.new_zeros([max(n, 1) for n in t.shape])
            grown.append(g + t.sum() if t.requires_grad else g)  # keeps the graph
        out = kernel(*grown, **attrs)

        def back(t):
            for o in cut:
                t = t.narrow(o % t.ndim, 0, 0)
            return t

        return tuple(back(t) for t in out) if isinstance(out, tuple) else back(out)

    return run


def _same_dim(i, d, shapes):
    return d if i == 0 else None


def _always(attrs) -> bool:
    return True


def _conv_rule(spatial: int, transposed: bool = False):
    """x S(0) -> S(0); groups == 1: the weight split along its output channels (conv:
    dim 0; transposed conv, weight (C_in, C_out, k...): dim 1) with b S(0) -> channels
    split, x S(C) with the weight split along its input channels (b P) -> P (contracted);
    P in x or w (b P) -> P."""
    w_out, w_in = (1, 0) if transposed else (0, 1)

    def rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
        x = metas[0]
        bias = len(metas) == 3
        c = 1 if x.ndim == spatial + 2 else 0  # unbatched input: channels first

        def sig(xs, ws, bs, out):
            return (xs, ws, bs, out) if bias else (xs, ws, out)

        sigs = [sig(Split(0), B, B, Split(0))] if c == 1 else []
        if attrs["groups"] == 1:
            sigs.append(sig(B, Split(w_out), Split(0), Split(c)))  # output channels
            sigs.append(sig(Split(c), Split(w_in), P, P))  # input channels: contracted
        sigs += [sig(P, B, P, P), sig(B, P, P, P)]
        return sigs

    return rule


def _conv_dims(spatial: int):
    def out_dim(i, d, shapes):
        batched = len(shapes[0]) == spatial + 2
        if i == 0:
            return 0 if batched and d == 0 else None
        return (1 if batched else 0) if d == 0 else None  # weight/bias: output channels

    return out_dim


register("nn.conv1d", _conv_rule(1))(_empty_safe(_optional(F.conv1d), _conv_dims(1)))
register("nn.conv2d", _conv_rule(2))(_empty_safe(_optional(F.conv2d), _conv_dims(2)))
register("nn.conv3d", _conv_rule(3))(_empty_safe(_optional(F.conv3d), _conv_dims(3)))


def _conv_transpose_dims(spatial: int):
    def out_dim(i, d, shapes):
        batched = len(shapes[0]) == spatial + 2
        ch = 1 if batched else 0
        if i == 0:
            return 0 if batched and d == 0 else None
        if i == 1:
            return ch if d == 1 else None  # weight (C_in, C_out / groups, k...)
        return ch  # bias (C_out,)

    return out_dim


register("nn.conv_transpose1d", _conv_rule(1, transposed=True))(
    _empty_safe(_optional(F.conv_transpose1d), _conv_transpose_dims(1)))
register("nn.conv_transpose2d", _conv_rule(2, transposed=True))(
    _empty_safe(_optional(F.conv_transpose2d), _conv_transpose_dims(2)))
register("nn.conv_transpose3d", _conv_rule(3, transposed=True))(
    _empty_safe(_optional(F.conv_transpose3d), _conv_transpose_dims(3)))


def _conv_tbc_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``conv_tbc(x (T, B, C_in), w (k, C_in, C_out), b (C_out,))``: the batch S(1) passes
    (weight and bias B); w S(2) (b S(0)) -> S(2) (output channels); x S(2) with w S(1)
    (b P) -> P (input channels contracted); P in x or w (b P) -> P."""
    return [(S(1), B, B, S(1)), (B, S(2), S(0), S(2)), (S(2), S(1), P, P), (P, B, P, P),
            (B, P, P, P)]


def _conv_tbc_dims(i, d, shapes):
    if i == 0:
        return 1 if d == 1 else None  # batch; the input channels are contracted
    if i == 1:
        return 2 if d == 2 else None  # output channels
    return 2  # bias (C_out,)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (a shard of a boxed gradient
    is often a strided slice)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _conv_tbc(x, w, b, *, pad):
    # torch's conv_tbc views its input and its output gradient: both must be contiguous
    return _ContiguousGrad.apply(torch.conv_tbc(x.contiguous(), w, b, pad))


register("nn.conv_tbc", _conv_tbc_rule)(_empty_safe(_conv_tbc, _conv_tbc_dims))


# ------------------------------------------------------------------ pooling, resampling, pad
def _lead2(m: Meta, attrs) -> int:
    return m.ndim - 2


register("nn.max_pool2d", _leading(_lead2))(_empty_safe(F.max_pool2d, _same_dim))
register("nn.max_pool2d_indices", _leading(_lead2))(
    _empty_safe(lambda x, **kw: F.max_pool2d(x, **kw, return_indices=True)[1], _same_dim))
register("nn.avg_pool2d", _leading(_lead2, _always))(_empty_safe(F.avg_pool2d, _same_dim))
register("nn.adaptive_avg_pool2d", _leading(_lead2, _always))(
    _empty_safe(F.adaptive_avg_pool2d, _same_dim))


def _lead1(m: Meta, attrs) -> int:
    return m.ndim - 1


register("nn.max_pool1d", _leading(_lead1))(
    _empty_safe(F.max_pool1d, _same_dim))
register("nn.avg_pool1d", _leading(_lead1, _always))(_empty_safe(F.avg_pool1d, _same_dim))
register("nn.adaptive_avg_pool1d", _leading(_lead1, _always))(
    _empty_safe(F.adaptive_avg_pool1d, _same_dim))
register("nn.adaptive_max_pool2d", _leading(_lead2))(
    _empty_safe(F.adaptive_max_pool2d, _same_dim))
register("nn.adaptive_max_pool2d_indices", _leading(_lead2))(
    _empty_safe(lambda x, **kw: F.adaptive_max_pool2d(x, **kw, return_indices=True)[1],
                _same_dim))
# pixel (un)shuffle mixes channels with H and W: only the dims before C pass; a
# permutation of elements, so P -> P.
register("nn.pixel_shuffle", _leading(lambda m, a: m.ndim - 3, _always))(
    _empty_safe(F.pixel_shuffle, _same_dim))
register("nn.pixel_unshuffle", _leading(lambda m, a: m.ndim - 3, _always))(
    _empty_safe(F.pixel_unshuffle, _same_dim))


def _lead3(m: Meta, attrs) -> int:
    return m.ndim - 3


# The 3-D pools and adaptive max pools return (values, indices) when the attr
# return_indices is set (both laid out as the signature's output).
register("nn.max_pool3d", _leading(_lead3))(_empty_safe(F.max_pool3d, _same_dim))
register("nn.avg_pool3d", _leading(_lead3, _always))(_empty_safe(F.avg_pool3d, _same_dim))
register("nn.adaptive_avg_pool3d", _leading(_lead3, _always))(
    _empty_safe(F.adaptive_avg_pool3d, _same_dim))
register("nn.adaptive_max_pool1d", _leading(_lead1))(
    _empty_safe(F.adaptive_max_pool1d, _same_dim))
register("nn.adaptive_max_pool3d", _leading(_lead3))(
    _empty_safe(F.adaptive_max_pool3d, _same_dim))


def _unpool_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``max_unpool(x, indices)``: the indices address each (n, c) plane, so splits of the
    leading (batch, channel) dims pass when x and the indices are split alike; linear in
    x: (P, B) -> P."""
    x = metas[0]
    lead = x.ndim - len(attrs["output_size"])
    return [(S(d), S(d), S(d)) for d in range(lead)] + [(P, B, P)]


def _unpool_kernel(fn, spatial: int):
    def out_dim(i, d, shapes):
        return d if d < len(shapes[i]) - spatial else None  # leading dims; spatial whole

    return _empty_safe(fn, out_dim)


register("nn.max_unpool1d", _unpool_rule)(_unpool_kernel(F.max_unpool1d, 1))
register("nn.max_unpool2d", _unpool_rule)(_unpool_kernel(F.max_unpool2d, 2))
register("nn.max_unpool3d", _unpool_rule)(_unpool_kernel(F.max_unpool3d, 3))


def _fractional_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``fractional_max_pool(x (N, C, *spatial), samples (N, C, k))``: the samples are per
    (n, c), so an N or C split passes with the samples split alike."""
    return [(S(0), S(0), S(0)), (S(1), S(1), S(1))]


def _fractional_dims(i, d, shapes):
    return d if d < 2 else None


register("nn.fractional_max_pool2d", _fractional_rule)(_empty_safe(
    lambda x, s, **kw: F.fractional_max_pool2d(x, _random_samples=s, **kw), _fractional_dims))
register("nn.fractional_max_pool3d", _fractional_rule)(_empty_safe(
    lambda x, s, **kw: F.fractional_max_pool3d(x, _random_samples=s, **kw), _fractional_dims))
# im2col / col2im: every (n) is independent (batch splits pass); both are linear. A
# channel split does not pass: unfold's dim 1 is C * kh * kw, whose even split is not
# the channels' (5 channels over 2 ranks: 3 and 2; 5 * 4 columns: 10 and 10).
register("nn.unfold", _leading(lambda m, a: 1 if m.ndim == 4 else 0, _always))(
    _empty_safe(F.unfold, _same_dim))
register("nn.fold", _leading(lambda m, a: 1 if m.ndim == 3 else 0, _always))(
    _empty_safe(F.fold, _same_dim))


def _across_channels(linear: bool):
    """Rule of ops that mix only the channels (dim 1) of each (n, spatial) position: a
    split of every other dim passes; ``linear``: P -> P."""

    def rule(metas, attrs) -> list[tuple[SBP, ...]]:
        sigs = [(S(d), S(d)) for d in range(metas[0].ndim) if d != 1]
        return sigs + [(P, P)] if linear else sigs

    return rule


register("nn.local_response_norm", _across_channels(False))(
    _empty_safe(F.local_response_norm, _same_dim))
register("nn.channel_shuffle", _across_channels(True))(
    _empty_safe(lambda x, *, groups: F.channel_shuffle(x, groups), _same_dim))


def _cross_map_lrn2d(x, *, size, alpha, beta, k):
    """torch.nn.CrossMapLRN2d's own autograd Function (its window and gradient, legacy
    quirks included), on a shard."""
    from torch.nn.modules._functions import CrossMapLRN2d

    return CrossMapLRN2d.apply(x, size, alpha, beta, k)


# Its Python forward loops over channels with out= writes: the meta is the input's.
register("nn.cross_map_lrn2d", _across_channels(False), meta=lambda metas, attrs: metas[0])(
    _empty_safe(_cross_map_lrn2d, _same_dim))


def _affine_grid(theta, *, size, align_corners):
    # size's N is the global batch; a shard's is its own part of theta
    return torch.affine_grid_generator(theta, [theta.shape[0], *size[1:]], align_corners)


# grid = base grid @ theta^T per sample: batch splits pass, linear in theta (P -> P)
register("nn.affine_grid", lambda metas, attrs: [(S(0), S(0)), (P, P)])(
    _empty_safe(_affine_grid, lambda i, d, shapes: 0 if d == 0 else None))


def _grid_sample_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``grid_sample(x (N, C, *in), grid (N, *out, k))``: N split in both passes; a C
    split passes with the grid B; a split output-position dim of the grid passes with x
    B (each output position reads its own grid point); linear in x: (P, B) -> P."""
    grid = metas[1]
    sigs = [(S(0), S(0), S(0)), (S(1), B, S(1)), (P, B, P)]
    return sigs + [(B, S(d), S(d + 1)) for d in range(1, grid.ndim - 1)]


def _grid_sample_dims(i, d, shapes):
    if i == 0:
        return d if d < 2 else None
    return 0 if d == 0 else d + 1 if d < len(shapes[1]) - 1 else None


register("nn.grid_sample", _grid_sample_rule)(_empty_safe(
    lambda x, g, *, mode, padding_mode, align_corners: F.grid_sample(
        x, g, mode, padding_mode, align_corners), _grid_sample_dims))
# pdist mixes every row with every other: no rule, so it runs all-B (gathers)
register("nn.pdist")(lambda x, *, p: F.pdist(x, p))


def _instance_norm_rule(metas, attrs):
    """Statistics per (n, c): an N split passes (weight, bias B); a C split passes with
    weight and bias split along C."""
    rest = len(metas) - 1
    return [(Split(0), *(B,) * rest, Split(0)), (Split(1), *(Split(0),) * rest, Split(1))]


register("nn.instance_norm", _instance_norm_rule)(
    _empty_safe(_optional(lambda x, **kw: F.instance_norm(x, **kw)), _same_dim))
register("nn.interpolate", _leading(lambda m, a: 2, _always))(_empty_safe(F.interpolate, _same_dim))
register("nn.pad", _leading(lambda m, a: m.ndim - len(a["pad"]) // 2,
                         lambda a: a["mode"] != "constant" or not a["value"]))(
    _empty_safe(F.pad, _same_dim))
# ------------------------------------------------------------------ normalisation
register("nn.layer_norm", _leading(lambda m, a: m.ndim - len(a["normalized_shape"])))(
    _empty_safe(_optional(F.layer_norm), _same_dim))
register("nn.rms_norm", _leading(lambda m, a: m.ndim - len(a["normalized_shape"])))(
    _empty_safe(_optional(F.rms_norm), _same_dim))
register("nn.group_norm", _leading(lambda m, a: 1))(_empty_safe(_optional(F.group_norm), _same_dim))


# ------------------------------------------------------------------ softmax
_other_dims = _leading(lambda m, a: m.ndim)


def _softmax_rule(metas, attrs):
    """Every split passes: another dim's split locally, a split ``dim`` through the global
    algorithm (an all-reduce MAX and an all-reduce SUM of ``dim``-reduced tensors); no P
    (softmax is not linear)."""
    return _other_dims(metas, attrs)


def _softmax_cost(metas, attrs, ins, out, pl):
    (m,) = metas
    axes = split_axes(ins[0], (attrs["dim"],), pl)
    itemsize = 4 if m.dtype in HALF else m.dtype.itemsize  # half types: run in float32
    reduced = math.prod(n for d, n in enumerate(m.shape) if d != attrs["dim"]) * itemsize
    return axis_collectives_cost(pl, reduced, 2 * len(axes))


def _softmax_algorithm(log: bool):
    kernel = torch.log_softmax if log else torch.softmax

    def algorithm(call, x, *, dim):
        axes = call.axes(0, (dim,))
        if not axes:
            return kernel(x, dim)
        if x.dtype in HALF:
            # torch's kernel computes a half softmax in float32 and rounds once; summed in
            # fp16, 65536 classes' exponentials overflow
            return _split_softmax(call, upcast(x), dim, axes, log).to(x.dtype)
        return _split_softmax(call, x, dim, axes, log)

    return algorithm


def _split_softmax(call, x, dim: int, axes, log: bool):
    """(log-)softmax of shard ``x`` along ``dim``, split over mesh ``axes``: the global max
    (all-reduce MAX, no gradient: softmax is shift-invariant), then the sum of exponentials
    all-reduced (differentiable), in ``x``'s dtype."""
    with torch.no_grad():
        if x.shape[dim] == 0:  # an empty shard (dim smaller than the mesh axis)
            m = x.new_full([1 if d == dim else n for d, n in enumerate(x.shape)], -math.inf)
        else:
            m = x.amax(dim, keepdim=True)
        for a in axes:
            m = all_reduce(m, call.group(a), axis=a, op="max")
        m = torch.where(m.isinf(), torch.zeros_like(m), m)
    z = x - m
    e = z.exp()
    s = e.sum(dim, keepdim=True)
    for a in axes:
        s = AxisSum.apply(s, call.group(a), a)
    return z - s.log() if log else e / s


register_algorithm("nn.softmax", kernel=lambda x, *, dim: torch.softmax(x, dim),
                   rule=_softmax_rule, cost=_softmax_cost)(_softmax_algorithm(False))
register_algorithm("nn.log_softmax", kernel=lambda x, *, dim: torch.log_softmax(x, dim),
                   rule=_softmax_rule, cost=_softmax_cost)(_softmax_algorithm(True))


def softmax(x: Tensor, dim: int, dtype=None, *, log: bool = False, name: str = "softmax"):
    """``exp(x) / exp(x).sum(dim)`` (``log``: ``x - logsumexp(x, dim)``), as
    ``torch.softmax`` / ``torch.log_softmax``; ``dtype`` casts the input first.

    SBP: splits of other dims pass. Over a split ``dim``: local max, all-reduce MAX, local
    sum of ``exp(x - max)``, all-reduce SUM (both of the shape with ``dim`` -> 1); never a
    gather of ``x``. A P input is boxed first. fp16/bf16 over a split ``dim``: computed in
    float32 (its all-reduces too) and rounded once, as torch's kernel.

    Raises:
        ValueError: ``dim`` is None (torch's implicit choice is deprecated). IndexError:
            ``dim`` out of range.
    """
    if dim is None:
        raise ValueError(f"{name}: give dim= (torch's implicit dim choice is deprecated)")
    d = norm_dim(dim, x.ndim, f"{name}: dim")
    x = cast(x, dtype)
    return dispatch("nn.log_softmax" if log else "nn.softmax", x, dim=d)


# ------------------------------------------------------------------ attention
def _sdpa_rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    q, k, v = metas[:3]
    mask = metas[3] if len(metas) == 4 else None
    nd = q.ndim
    sigs = []

    def dim_of(m: Meta, d: int, size: int) -> SBP:
        """Split ``m`` on output dim ``d`` (right-aligned) if it has it at full size."""
        i = d - nd + m.ndim
        return Split(i) if i >= 0 and m.shape[i] == size and size > 1 else B

    for d in range(nd - 2):  # batch and head dims
        size = q.shape[d]
        ins = [Split(d), dim_of(k, d, size), dim_of(v, d, size)]
        if mask is not None:
            ins.append(dim_of(mask, d, size))
        sigs.append((*ins, Split(d)))
    mask_b = (B,) if mask is not None else ()
    if not attrs["is_causal"]:  # queries are independent unless the mask ties them to keys
        ins = [Split(nd - 2), B, B]
        if mask is not None:
            ins.append(dim_of(mask, nd - 2, q.shape[-2]))
        sigs.append((*ins, Split(nd - 2)))
    sigs.append((B, B, Split(v.ndim - 1), *mask_b, Split(nd - 1)))
    sigs.append((B, B, P, *mask_b, P))
    return sigs


def _sdpa_dims(i, d, shapes):
    nd, out_nd = len(shapes[i]), len(shapes[0])
    if i in (1, 3) and d >= nd - 2 or i == 2 and d == nd - 2:
        return None  # key length, key features, mask columns: contracted
    return d - nd + out_nd


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """torch's ``scaled_dot_product_attention``. On the logical graph's meta stand-ins
    (planning a step) the fused kernel torch would choose on the planned device is called
    on meta instead of the math path torch takes on meta: what autograd saves for backward
    is then what a real step saves (flash or memory-efficient attention: the output and
    its log-sum-exp, not the L x S attention probabilities). CPU: torch's own choice
    (:func:`_fused_choice`; 1 is flash attention, 0 math); CUDA:
    :func:`_cuda_sdpa_choice`."""
    if query.device.type == "meta" and not enable_gqa:
        planned = _planned_device()
        if planned == "cpu" and \
                _fused_choice(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              torch.device("cpu")) == 1:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask,
                scale=scale)[0]
        if planned == "cuda":
            choice = _cuda_sdpa_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                       scale)
            if choice == 1:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, scale=scale)[0]
            if choice in (2, 3):  # memory-efficient (cuDNN's saves the same)
                bias = None if attn_mask is None else torch.empty(  # the mask's own size
                    attn_mask.shape, dtype=query.dtype, device="meta").expand(
                    *query.shape[:-1], key.shape[-2])
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                          dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _cuda_sdpa_choice(q, k, v, mask, dropout_p, is_causal, scale) -> int:
    """The kernel torch's ``scaled_dot_product_attention`` takes for CUDA tensors like
    these (0 math, 1 flash, 2 memory-efficient, 3 cuDNN: torch's ``SDPBackend``
    numbering). With a GPU here: ``torch._fused_sdp_choice`` asked of small CUDA probes
    (:func:`_fused_choice`). Without one (planning a CUDA machine from this one):
    torch's rules for the GPUs of the named profiles (sm 8.0 and later), 4-D inputs
    only: flash for float16/bfloat16 with no mask and a head size of at most 256 that
    is a multiple of 8; else memory-efficient for a head size that is a multiple of 8
    (float32 too, masks too); else math."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return 0
    if torch.cuda.is_available():
        try:
            return _fused_choice(q, k, v, mask, dropout_p, is_causal, scale,
                                 torch.device("cuda", torch.cuda.current_device()))
        except RuntimeError:
            return 0
    head = q.shape[-1]
    if head % 8 or v.shape[-1] % 8:
        return 0
    if q.dtype in (torch.float16, torch.bfloat16) and mask is None and head <= 256 and \
            v.shape[-1] <= 256:
        return 1
    return 2


def _fused_choice(q, k, v, mask, dropout_p, is_causal, scale, device) -> int:
    """``torch._fused_sdp_choice`` for tensors like these on ``device``, asked of small
    probes there: every dim but the head size cut to 2 (sizes 0 and 1 kept, so ranks,
    dtypes, head sizes and broadcasting are as given: what the choice depends on)."""
    def small(n):
        return n if n <= 1 else 2

    def probe(t, whole_last: bool):
        shape = [small(n) for n in t.shape[:-1]] + \
            [t.shape[-1] if whole_last else small(t.shape[-1])]
        return torch.zeros(shape, dtype=t.dtype, device=device,
                           requires_grad=t.requires_grad)

    with probing():
        return int(torch._fused_sdp_choice(
            probe(q, True), probe(k, True), probe(v, True),
            None if mask is None else probe(mask, False), dropout_p, is_causal, scale=scale))


def _planned_device() -> str | None:
    """The device type a logical graph being built plans for (None: not planning)."""
    from ..distributed._state import _state

    tracer = _state.tracer
    if not getattr(tracer, "planning", False):
        return None
    return getattr(getattr(tracer, "context", None), "device", None)


register("nn.scaled_dot_product_attention", _sdpa_rule)(
    _empty_safe(_optional(_sdpa), _sdpa_dims))


# --------------------------------------------------------------- grouped GEMM (issue 21)
def _grouped_mm_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """3-D x 3-D (groups enumerated on dim 0, no offs, no bias): the group split passes,
    and so does a split of A's rows (dim 1); the jagged forms (``offs``) run whole."""
    if len(metas) != 2 or metas[0].ndim != 3 or metas[1].ndim != 3:
        return []
    return [(S(0), S(0), S(0)), (S(1), B, S(1))]


def _grouped_mm_meta(metas, attrs) -> Meta:
    """torch's output shapes (its meta kernel also checks CUDA's 16-byte strides)."""
    a, b = metas[0], metas[1]
    if a.ndim == 3 and b.ndim == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    elif a.ndim == 2 and b.ndim == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.ndim == 2:  # both 2-D: K jagged by offs, one (M, N) per group
        shape = (metas[2].shape[0], a.shape[0], b.shape[1])
    else:  # A 3-D, B 2-D: N jagged by offs
        shape = (a.shape[1], b.shape[1])
    return Meta(shape, attrs["out_dtype"] or a.dtype)


register("nn.grouped_mm", _grouped_mm_rule, meta=_grouped_mm_meta)(_optional(
    lambda a, b, **kw: F.grouped_mm(a, b, **kw)))


# ------------------------------------------------------------------ activations


# --------------------------------------------------------------- nn activations
# The kernels of sbpflow.nn.functional's activations (name -> torch function taking the
# attrs as keywords); elementwise, none linear.
ACTIVATIONS = {
    "nn.celu": F.celu, "nn.elu": F.elu, "nn.hardshrink": F.hardshrink,
    "nn.hardsigmoid": F.hardsigmoid, "nn.hardswish": F.hardswish, "nn.hardtanh": F.hardtanh,
    "nn.leaky_relu": F.leaky_relu, "nn.logsigmoid": F.logsigmoid, "nn.mish": F.mish,
    "nn.relu6": F.relu6, "nn.selu": F.selu, "nn.softshrink": F.softshrink,
    "nn.softsign": F.softsign, "nn.tanhshrink": F.tanhshrink, "nn.threshold": F.threshold,
}


for _name, _fn in sorted(ACTIVATIONS.items()):
    register(_name, elementwise())(lambda a, _fn=_fn, **attrs: _fn(a, **attrs))


def _glu_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """``glu`` halves ``dim``: splits of the other dims pass; a split ``dim`` is boxed
    (its halves live on different ranks) to the cheapest of them: an all-to-all to another
    dim's split, or an all-gather to B."""
    (m,) = metas
    return [(Split(d), Split(d)) for d in range(m.ndim) if d != attrs["dim"]]


register("nn.glu", _glu_rule)(lambda a, *, dim: F.glu(a, dim))
# prelu(x, w) with w viewed as (C, 1, ..., 1) against x (N, C, ...): then the broadcasting
# rule splits the channel dim of x and w together.
register("nn.prelu", elementwise())(lambda a, w: F.prelu(a, w.reshape(-1)))


def prelu(input, weight):  # noqa: A002
    """``x`` where ``x >= 0`` else ``weight * x`` (``torch.nn.functional.prelu``,
    ``Tensor.prelu``); ``weight`` (C,) holds one slope per channel (dim 1 of ``input``) or
    a single one (1,).

    SBP: ``weight`` is lined up as (C, 1, ..., 1) with ``input`` (N, C, ...), so a split
    channel dim splits the weight with it (weight S(0) or boxed to it); other splits pass
    with the weight B; a P input is summed first.

    Raises:
        ValueError: ``weight`` is not 1-D with 1 or C elements.
    """
    n = weight.numel()
    if weight.ndim > 1 or (n != 1 and (input.ndim < 2 or input.shape[1] != n)):
        channels = input.shape[1] if input.ndim >= 2 else 1
        raise ValueError(f"prelu: weight of shape {tuple(weight.shape)} must have 1 or C "
                         f"elements, C = {channels} (dim 1 of the input of shape "
                         f"{tuple(input.shape)})")
    view = (n,) + (1,) * (input.ndim - 2) if input.ndim >= 2 else ()
    return dispatch("nn.prelu", input, weight.reshape(view))


# ------------------------------------------------------------------ pointwise losses


# --------------------------------------------------------------- nn pointwise losses
def _with_weight(kernel):
    """Kernel wrapper: a third tensor, when given, is the ``weight`` argument."""

    def run(a, b, weight=None, **attrs):
        return kernel(a, b, weight=weight, **attrs)

    return run


register("nn.kl_div", elementwise())(
    lambda a, b, *, log_target: F.kl_div(a, b, reduction="none", log_target=log_target))
register("nn.smooth_l1_loss", elementwise())(
    lambda a, b, *, beta: F.smooth_l1_loss(a, b, reduction="none", beta=beta))
register("nn.huber_loss", elementwise())(
    lambda a, b, *, delta: F.huber_loss(a, b, reduction="none", delta=delta))
register("nn.binary_cross_entropy", elementwise())(_with_weight(
    lambda a, b, *, weight: F.binary_cross_entropy(a, b, weight, reduction="none")))
register("nn.margin_ranking_loss", elementwise())(
    lambda a, b, y, *, margin: F.margin_ranking_loss(a, b, y, margin, reduction="none"))
# ------------------------------------------------------------------ elementwise losses
register("nn.mse_loss", elementwise())(lambda a, b: F.mse_loss(a, b, reduction="none"))
register("nn.l1_loss", elementwise())(lambda a, b: F.l1_loss(a, b, reduction="none"))
register("nn.bce_with_logits", elementwise())(_optional(
    lambda x, t, **kw: F.binary_cross_entropy_with_logits(x, t, reduction="none", **kw)))


# --------------------------------------------------------------- more losses (issue 21)
# Pointwise ones are elementwise ops with reduction='none' (sbpflow reduces, so a split
# batch gives P); the per-sample ones take batch splits (their class dim whole).
register("nn.poisson_nll_loss", elementwise())(
    lambda a, b, *, log_input, full, eps: F.poisson_nll_loss(a, b, log_input, full, eps=eps,
                                                             reduction="none"))
register("nn.hinge_embedding_loss", elementwise())(
    lambda a, y, *, margin: F.hinge_embedding_loss(a, y, margin, reduction="none"))
register("nn.soft_margin_loss", elementwise())(
    lambda a, y: F.soft_margin_loss(a, y, reduction="none"))


def _gaussian_nll(x, t, var, *, full, eps):
    """torch's ``gaussian_nll_loss`` with ``reduction='none'`` (its ops and their order;
    the clamp at ``eps`` does not reach the gradient), without its host-side checks."""
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (x - t) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss


register("nn.gaussian_nll_loss", elementwise())(_gaussian_nll)


def _per_sample_rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    """Per-sample losses of (N, C) inputs and (N, ...) targets: a batch split (dim 0) of
    both passes to the (N,) output; a third input (a class weight) is used whole (B)."""
    if metas[0].ndim != 2:
        return []
    return [(S(0), S(0), *(B,) * (len(metas) - 2), S(0))]


register("nn.multi_margin_loss", _per_sample_rule)(
    lambda x, t, w=None, *, p, margin: F.multi_margin_loss(x, t, p, margin, w,
                                                           reduction="none"))
register("nn.multilabel_margin_loss", _per_sample_rule)(
    lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"))


def _ctc_rule(metas, attrs) -> list[tuple[SBP, ...]]:
    """(T, N, C) log-probabilities split on N with padded (N, S) targets and (N,) lengths
    split on N -> the (N,) losses split; concatenated 1-D targets (whose split has no
    per-sample meaning) and unbatched inputs run whole."""
    lp, tg = metas[0], metas[1]
    if lp.ndim != 3 or tg.ndim != 2:
        return []
    return [(S(1), S(0), S(0), S(0), S(0))]


def _ctc_kernel(lp, tg, il, tl, *, blank, zero_infinity):
    if lp.ndim == 3 and lp.shape[1] == 0:  # an empty shard: torch rejects empty log_probs
        return lp.sum((0, 2))
    return F.ctc_loss(lp, tg, il, tl, blank, "none", zero_infinity)


register("nn.ctc_loss", _ctc_rule,
         meta=lambda metas, attrs: Meta(metas[0].shape[1:2] if metas[0].ndim == 3 else (),
                                        metas[0].dtype))(_ctc_kernel)


# ------------------------------------------------------------------ vocabulary-parallel lookups
def _lookup_rule(metas, attrs):
    """``embedding(ids, weight)`` on one mesh axis: a weight split by rows (S(0),
    vocabulary-parallel) or P gives a P output from B ids (each rank looks up the ids in
    its row range, zeros elsewhere); a weight split by columns gives an output split on
    its last dim; a B weight lets the output follow the ids' split."""
    ids, _ = metas
    return ([(B, S(0), P), (B, P, P), (B, S(1), S(ids.ndim))]
            + [(S(d), B, S(d)) for d in range(ids.ndim)])


@register_algorithm("nn.embedding", rule=_lookup_rule,
                    kernel=lambda i, w, *, padding_idx: F.embedding(i, w, padding_idx))
def _lookup(call, i, w, *, padding_idx):
    _check_range("embedding", "id", i, call.metas[1].shape[0])
    lo, hi = call.slices(1)[0].start, call.slices(1)[0].stop
    if (lo, hi) == (0, call.metas[1].shape[0]):
        return F.embedding(i, w, padding_idx)
    if hi == lo:  # this rank holds no rows
        return w.sum() * 0 + w.new_zeros((*i.shape, w.shape[1]))
    mine = (i >= lo) & (i < hi)
    pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
    return F.embedding(torch.where(mine, i - lo, 0), w, pad) * mine.unsqueeze(-1).to(w.dtype)


def _bags_kernel(i, w, psw=None, *, mode, padding_idx):
    return F.embedding_bag(i, w, None, mode=mode, per_sample_weights=psw,
                           padding_idx=padding_idx)


def _bags_rule(metas, attrs):
    """``embedding_bag(ids (N, L), weight (V, D)[, per_sample_weights (N, L)])`` on one
    mesh axis: a B weight lets the (N, D) output follow the bags' split (S(0)); a weight
    split by columns (S(1)) gives an S(1) output from B bags; a weight split by rows
    (S(0), vocabulary-parallel) or P gives a P output from B bags in ``sum`` and ``mean``
    (each rank pools the ids in its row range; a bag's mean divides by its whole count),
    not in ``max`` (a partial max is not a partial sum)."""
    n = len(metas)
    sigs = [(S(0), B, *(S(0),) * (n - 2), S(0)), (B, S(1), *(B,) * (n - 2), S(1))]
    if attrs["mode"] != "max":
        sigs += [(B, S(0), *(B,) * (n - 2), P), (B, P, *(B,) * (n - 2), P)]
    return sigs


@register_algorithm("nn.embedding_bag", rule=_bags_rule, kernel=_bags_kernel)
def _bags(call, i, w, psw=None, *, mode, padding_idx):
    V = call.metas[1].shape[0]
    _check_range("embedding_bag", "id", i, V)
    lo, hi = call.slices(1)[0].start, call.slices(1)[0].stop
    if (lo, hi) == (0, V):
        return _bags_kernel(i, w, psw, mode=mode, padding_idx=padding_idx)
    if hi == lo:  # this rank holds no rows
        return w.sum() * 0 + w.new_zeros((i.shape[0], w.shape[1]))
    # rows [lo, hi) of a sum or mean: pool this rank's ids with weight 1 (or theirs),
    # the others with weight 0; a mean is the sum over the bag's whole count
    real = i != padding_idx if padding_idx is not None else torch.ones_like(i, dtype=torch.bool)
    mine = (i >= lo) & (i < hi) & real
    weights = mine.to(w.dtype) if psw is None else psw * mine.to(psw.dtype)
    if mode == "mean":
        weights = weights / real.sum(1, keepdim=True).clamp(min=1).to(weights.dtype)
    return F.embedding_bag(torch.where(mine, i - lo, 0), w, None, mode="sum",
                           per_sample_weights=weights)


def _check_range(name: str, what: str, ids: torch.Tensor, n: int, ignore=None) -> None:
    """Raise as torch does for an index outside ``[0, n)`` (``ignore``: a value allowed
    anyway). A rank whose shard of a split weight does not hold an id would otherwise
    silently give 0 for it; each rank checks the ids it holds (no collective)."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= n)
    if ignore is not None:
        bad &= ids != ignore
    rows = "embeddings" if name.startswith("embedding") else "classes"
    if tracing():  # in an nn.Graph: checked by the program at every call
        torch._assert_async(~bad.any(), f"{name}: an {what} is out of range for {n} {rows} "
                            f"(expected 0 <= {what} < {n})")
        return
    if bool(bad.any()):
        v = int(ids[bad].reshape(-1)[0])
        raise IndexError(f"{name}: {what} {v} is out of range for {n} {rows} (expected "
                         f"0 <= {what} < {n})")


def _pick_kernel(x, t, *, dim, ignore_index):
    mine = t != ignore_index
    return x.gather(dim, torch.where(mine, t, 0).unsqueeze(dim)).squeeze(dim) * mine.to(x.dtype)


def _pick_rule(metas, attrs):
    """``pick(logp, target)``: logp split on the class dim (vocabulary-parallel) or P with
    B targets gives P (the rank whose class range holds the target picks it, the others
    0); another dim split in both (the target's dims are logp's without the class dim)."""
    logp, target = metas
    dim = attrs["dim"]
    return [(S(dim), B, P), (P, B, P)] + [(S(td if td < dim else td + 1), S(td), S(td))
                                          for td in range(target.ndim)]


@register_algorithm("nn.pick", kernel=_pick_kernel, rule=_pick_rule)
def _pick(call, x, t, *, dim, ignore_index):
    _check_range("cross_entropy", "target", t, call.metas[0].shape[dim], ignore_index)
    s = call.slices(0)[dim]
    lo, hi = s.start, s.stop
    if (lo, hi) == (0, call.metas[0].shape[dim]):
        return _pick_kernel(x, t, dim=dim, ignore_index=ignore_index)
    if hi == lo:
        return x.sum() * 0 + x.new_zeros(t.shape)
    mine = (t >= lo) & (t < hi) & (t != ignore_index)
    idx = torch.where(mine, t - lo, 0).unsqueeze(dim)
    return x.gather(dim, idx).squeeze(dim) * mine.to(x.dtype)


def pick_target_layout(logp_sbp, target_sbp, dim: int) -> tuple:
    """The nd-SBP the target of :func:`pick` takes for a ``logp`` laid out ``logp_sbp``
    (B where logp is split on the class dim or P; else the split both share): box the
    target there first, so that the per-element weights computed from it line up with
    the picked values."""
    out = []
    for sl, st in zip(logp_sbp, target_sbp):
        if sl.is_partial() or sl == Split(dim):
            out.append(B)
        elif sl.is_split():
            out.append(Split(sl.dim if sl.dim < dim else sl.dim - 1))
        else:
            out.append(st if st.is_split() else B)
    return tuple(out)


def _softmax_method(log: bool):
    name = "log_softmax" if log else "softmax"

    def method(self, dim, dtype=None):
        return softmax(self, dim, dtype, log=log, name=name)

    method.__name__ = name
    method.__doc__ = f"``Tensor.{name}(dim, dtype=None)``: see :func:`softmax`."
    return method


# ---------------------------------------------------------------- Tensor methods
method("softmax")(_softmax_method(False))
method("log_softmax")(_softmax_method(True))
