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
conv{1,2}d ``(x, w[, b])``          x S(0) -> S(0); groups == 1: w S(0) (b S(0)) -> S(C);
                                    x S(C), w S(1) (b P) -> P; P in x or w (b P) -> P
conv_transpose{1,2}d                as conv with the weight's dims swapped (C_in, C_out):
                                    w S(1) (b S(0)) -> S(C); x S(C), w S(0) -> P
pools, interpolate, pad             leading (batch, channel) splits pass; P -> P when
                                    the op is linear (avg pools, interpolate, replicate
                                    and reflect pads, constant pad with value 0)
pixel_shuffle, pixel_unshuffle      batch splits pass (C is mixed with H, W); P -> P
instance_norm (no running stats)    N and C splits pass (statistics per (n, c))
layer_norm, rms_norm, group_norm    leading splits pass (normalised dims whole; weight
                                    and bias B)
softmax, log_softmax (whole dim)    splits of the other dims pass
scaled_dot_product_attention        batch/head splits pass (k, v and mask split where
                                    they are full size); query-length split when not
                                    causal; v S(last) -> S(last); v P -> P
mse, l1, bce_with_logits (none)     :func:`._rules.elementwise`
=================================== ================================================
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..distributed import _comm, ensure_groups
from ..sbp import SBP, Split, broadcast, partial_sum
from ..tensor import Tensor
from ._registry import Meta, register
from ._rules import einsum, elementwise

__all__ = ["global_max", "lookup", "pick", "outside_shard"]

B, P = broadcast, partial_sum


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
        for o in cut:
            out = out.narrow(o % out.ndim, 0, 0)
        return out

    return run


def _same_dim(i, d, shapes):
    return d if i == 0 else None


def _always(attrs) -> bool:
    return True


# ------------------------------------------------------------------ linear, conv
def _linear_rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    x = metas[0]
    batch = string.ascii_lowercase[: x.ndim - 1]
    sigs = einsum(f"{batch}y,zy->{batch}z")(metas[:2], attrs)
    if len(metas) == 2:
        return sigs
    last = Split(x.ndim - 1)

    def bias(out: SBP) -> SBP:  # y = x @ w.T + b: b follows the output's last dim
        return Split(0) if out == last else P if out.is_partial() else B

    return [(*s[:2], bias(s[-1]), s[-1]) for s in sigs]


def _linear_dims(i, d, shapes):
    if i == 0:
        return d if d < len(shapes[0]) - 1 else None
    return -1 if d == 0 else None  # weight rows and bias: output features


register("nn.linear", _linear_rule)(_empty_safe(_optional(F.linear), _linear_dims))


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

# ------------------------------------------------------------------ softmax on a whole dim
_other_dims = _leading(lambda m, a: m.ndim)


def _softmax_rule(metas, attrs):
    return [s for s in _other_dims(metas, attrs) if s[0].dim != attrs["dim"]]


register("nn.softmax", _softmax_rule)(lambda x, *, dim: torch.softmax(x, dim))
register("nn.log_softmax", _softmax_rule)(lambda x, *, dim: torch.log_softmax(x, dim))


@register("nn.cast", lambda metas, attrs: elementwise("sum")(metas, attrs)
          if attrs["dtype"].is_floating_point else elementwise()(metas, attrs))
def _cast(x, *, dtype):
    return x.to(dtype)


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


register("nn.scaled_dot_product_attention", _sdpa_rule)(
    _empty_safe(_optional(F.scaled_dot_product_attention), _sdpa_dims))

# ------------------------------------------------------------------ elementwise losses
register("nn.mse_loss", elementwise())(lambda a, b: F.mse_loss(a, b, reduction="none"))
register("nn.l1_loss", elementwise())(lambda a, b: F.l1_loss(a, b, reduction="none"))
register("nn.bce_with_logits", elementwise())(_optional(
    lambda x, t, **kw: F.binary_cross_entropy_with_logits(x, t, reduction="none", **kw)))


# ------------------------------------------------------------------ global helpers
def outside_shard(shape, dtype, *locals_: torch.Tensor) -> torch.Tensor:
    """The empty shard of a rank outside the placement, connected to the inputs' graph so
    that its backward reaches the same boxing steps as the members' (as in dispatch)."""
    out = torch.empty((0,) * max(len(shape), 1), dtype=dtype, device=locals_[0].device)
    for x in locals_:
        if x.requires_grad and out.is_floating_point():
            out = out + x.reshape(-1)[:0].sum().to(out.dtype)
    return out


def _ensure_axes(pl, axes) -> None:
    for a in axes:  # every world rank creates the groups, in the same order
        ensure_groups(pl.axis_groups(a))


def global_max(x: Tensor, dim: int) -> Tensor:
    """``x.amax(dim, keepdim=True)`` of a global tensor with no P axis, detached: a local
    max, then an all-reduce MAX over the mesh axes that split ``dim`` (those become B;
    the others keep ``x``'s layout). For shift-invariant uses (softmax), no gradient."""
    pl = x.placement
    axes = [a for a, s in enumerate(x.sbp) if s.is_split() and s.dim == dim]
    _ensure_axes(pl, axes)
    shape = tuple(1 if d == dim else n for d, n in enumerate(x.shape))
    sbp = tuple(B if a in axes else s for a, s in enumerate(x.sbp))
    coord = pl.coord()
    with torch.no_grad():
        local = x._local
        if coord is None:
            out = outside_shard(shape, x.dtype, local)
        else:
            if local.shape[dim] == 0:  # an empty shard (dim smaller than the mesh axis)
                out = local.new_full([1 if d == dim else n for d, n in enumerate(local.shape)],
                                     float("-inf"))
            else:
                out = local.amax(dim, keepdim=True)
            for a in axes:
                out = _comm.all_reduce(out, pl.axis_ranks(a, coord), axis=a, op="max")
    return Tensor(out, pl, sbp, shape)


def _range(pl, shape, sbp, dim: int) -> tuple[int, int]:
    s = pl.shard_slices(tuple(shape), sbp)[dim]
    return s.start, s.stop


def lookup(ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
    """``F.embedding(ids, weight, padding_idx)`` on global tensors, per mesh axis:

    * weight S(0) (vocabulary-parallel) or P: ids boxed to B; each rank looks up the ids
      in its row range and writes zeros elsewhere; output P;
    * weight S(1): ids boxed to B; output split on its last dim;
    * weight B: the output follows the ids (S(d) -> S(d), B -> B).
    """
    pl = weight.placement
    ids_sbp, out_sbp = [], []
    for si, sw in zip(ids.sbp, weight.sbp):
        if sw.is_partial() or sw == Split(0):
            ids_sbp.append(B)
            out_sbp.append(P)
        elif sw.is_split():
            ids_sbp.append(B)
            out_sbp.append(Split(ids.ndim))
        else:
            ids_sbp.append(si if si.is_split() else B)
            out_sbp.append(si if si.is_split() else B)
    if tuple(ids_sbp) != ids.sbp:
        ids = ids.to_global(pl, ids_sbp)
    shape = (*ids.shape, weight.shape[1])
    w = weight._local
    if pl.coord() is None:
        return Tensor(outside_shard(shape, w.dtype, w), pl, tuple(out_sbp), shape)
    lo, hi = _range(pl, weight.shape, weight.sbp, 0)
    i = ids._local
    if (lo, hi) == (0, weight.shape[0]):
        out = F.embedding(i, w, padding_idx)
    elif hi == lo:  # this rank holds no rows
        out = w.sum() * 0 + w.new_zeros((*i.shape, w.shape[1]))
    else:
        mine = (i >= lo) & (i < hi)
        pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
        out = F.embedding(torch.where(mine, i - lo, 0), w, pad) * mine.unsqueeze(-1).to(w.dtype)
    return Tensor(out, pl, tuple(out_sbp), shape)


def pick(logp: Tensor, target: Tensor, dim: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``logp.gather(dim, target.unsqueeze(dim)).squeeze(dim)``, zero where ``target ==
    ignore_index``, on global tensors without gathering a split ``dim``.

    Per mesh axis: ``logp`` S(dim) (the class-split, vocabulary-parallel case) or P: the
    target is boxed to B, the rank whose class range holds the target picks it and the
    others give 0: output P. ``logp`` S(d) for another d: the target is split alike;
    ``logp`` B follows a split target (a local slice). Returns ``(picked, target)`` with
    the target in the layout the output's non-P axes use.
    """
    pl = logp.placement
    l_sbp, t_sbp, o_sbp = [], [], []
    for sl, st in zip(logp.sbp, target.sbp):
        if sl.is_partial() or sl == Split(dim):
            l_sbp.append(sl)
            t_sbp.append(B)
            o_sbp.append(P)
        elif sl.is_split() or st.is_split():
            td = (sl.dim if sl.dim < dim else sl.dim - 1) if sl.is_split() else st.dim
            l_sbp.append(Split(td if td < dim else td + 1))
            t_sbp.append(Split(td))
            o_sbp.append(Split(td))
        else:
            l_sbp.append(B)
            t_sbp.append(B)
            o_sbp.append(B)
    if tuple(l_sbp) != logp.sbp:
        logp = logp.to_global(pl, l_sbp)
    if tuple(t_sbp) != target.sbp:
        target = target.to_global(pl, t_sbp)
    shape = tuple(target.shape)
    x, t = logp._local, target._local
    if pl.coord() is None:
        return Tensor(outside_shard(shape, x.dtype, x), pl, tuple(o_sbp), shape), target
    lo, hi = _range(pl, logp.shape, logp.sbp, dim)
    if hi == lo:
        out = x.sum() * 0 + x.new_zeros(t.shape)
    else:
        mine = (t >= lo) & (t < hi) & (t != ignore_index)
        idx = torch.where(mine, t - lo, 0).unsqueeze(dim)
        out = x.gather(dim, idx).squeeze(dim) * mine.to(x.dtype)
    return Tensor(out, pl, tuple(o_sbp), shape), target
