"""Helpers shared by the op families' global algorithms and front ends (one copy each):
boxing a P or split axis away before an op that needs the whole value, and the
per-mesh-axis combine steps (an all-gather of output-sized
per-shard results, and its differentiable combine).

Collectives go through :mod:`sbpflow.distributed`'s public functions (recorded, checked
in debug mode, bounded by the timeout).
"""

from __future__ import annotations

import torch

from ..distributed import all_gather, all_reduce
from ..sbp import broadcast
from ..tensor import Tensor

__all__ = ["AxisSum", "all_b", "b_result", "combine", "gather_axis",
           "squeeze_dims", "unpartial", "whole"]


def whole(x: Tensor, dims=(), partial_too: bool = False) -> Tensor:
    """``x`` boxed so that no mesh axis splits a dim in ``dims`` (those axes become B; with
    ``partial_too`` the P axes too). Local tensors and layouts that already fit are
    returned as they are."""
    if x.is_local:
        return x
    want = tuple(broadcast if (s.is_split() and s.dim in dims) or (partial_too and s.is_partial())
                 else s for s in x.sbp)
    return x if want == x.sbp else x.to_global(sbp=want)


def unpartial(x: Tensor) -> Tensor:
    """``x`` with every P mesh axis boxed to B (an all-reduce); other axes unchanged: what
    an op that is not linear needs before it reads values (the max of a sum is not the sum
    of maxima)."""
    return whole(x, (), partial_too=True)


def all_b(x: Tensor) -> Tensor:
    """``x`` boxed to B on every mesh axis (local tensors as they are)."""
    if x.is_local or all(s.is_broadcast() for s in x.sbp):
        return x
    return x.to_global(sbp=(broadcast,) * x.placement.ndim)


def b_result(local: torch.Tensor, pl) -> Tensor:
    """A B global tensor whose value (the same on every rank) is ``local``."""
    return Tensor(local, pl, (broadcast,) * pl.ndim, tuple(local.shape))


def squeeze_dims(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.squeeze(dims) if dims else t


def gather_axis(t: torch.Tensor, pl, axis: int) -> torch.Tensor:
    """Every member's ``t`` along mesh ``axis``, stacked on a new dim 0 (mesh coordinate
    order): one all-gather of ``t``-sized pieces."""
    ranks = pl.axis_ranks(axis, pl.coord())
    src = t.to(torch.uint8) if t.dtype == torch.bool else t
    out = all_gather(src.unsqueeze(0).contiguous(), ranks, 0, [1] * len(ranks), axis=axis)
    return out.to(torch.bool) if t.dtype == torch.bool else out


class _AxisCombine(torch.autograd.Function):
    """``combined`` (the same on every member of the mesh-axis group: B on that axis) as a
    function of this rank's partial result ``part``, with elementwise derivative ``weight``.

    The output's gradient arrives as summands (P, the dual of B) and is all-reduced over the
    axis first; then ``d part = g * weight``.
    """

    @staticmethod
    def forward(ctx, part, combined, weight, ranks, axis):
        ctx.save_for_backward(weight)
        ctx.group = (ranks, axis)
        return combined.clone()

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        ranks, axis = ctx.group
        g = all_reduce(g, ranks, axis=axis)
        return g * weight, None, None, None, None


def combine(part: torch.Tensor, combined: torch.Tensor, weight: torch.Tensor, pl, axis: int):
    """``combined`` with :class:`_AxisCombine`'s gradient when ``part`` needs one."""
    if not part.requires_grad:
        return combined
    return _AxisCombine.apply(part, combined, weight, pl.axis_ranks(axis, pl.coord()), axis)


class AxisSum(torch.autograd.Function):
    """The sum of ``t`` over the ranks of a mesh-axis group (an all-reduce): P -> B on that
    axis. Its backward is the same all-reduce (the output is B, its gradient arrives as
    summands: ARCHITECTURE "Autograd: the dual rule")."""

    @staticmethod
    def forward(ctx, t, ranks, axis):
        ctx.group = (ranks, axis)
        return all_reduce(t, ranks, axis=axis)

    @staticmethod
    def backward(ctx, g):
        ranks, axis = ctx.group
        return all_reduce(g.contiguous(), ranks, axis=axis), None, None
