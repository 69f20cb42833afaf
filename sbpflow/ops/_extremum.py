"""amax / amin on global tensors: a local reduction, then an all-reduce MAX/MIN over the
mesh axes that split a reduced dim (instead of gathering the input).

Layout: P inputs are boxed to B first (the max of a sum is not the sum of maxima); an
axis splitting a kept dim stays split (renumbered); an axis splitting a reduced dim
becomes B. Gradient (torch's rule for amax/amin): the output gradient is shared evenly
among the elements equal to the extremum, ties counted over the whole tensor.
"""

from __future__ import annotations

import math

import torch

from ..distributed import _comm, ensure_groups
from ..sbp import Split, broadcast
from ..tensor import Tensor

__all__ = ["extremum"]


class _GlobalExtremum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, dims, keepdim, pl, axes):
        fn = torch.amax if kind == "max" else torch.amin
        if any(x.shape[d] == 0 for d in dims):  # an empty shard (uneven split): the identity
            ident = -math.inf if kind == "max" else math.inf
            if not x.is_floating_point():
                ident = torch.iinfo(x.dtype).min if kind == "max" else torch.iinfo(x.dtype).max
            local = torch.full([1 if d in dims else n for d, n in enumerate(x.shape)], ident,
                               dtype=x.dtype, device=x.device)
        else:
            local = fn(x, dim=dims, keepdim=True)
        coord = pl.coord()
        for a in axes:
            local = _comm.all_reduce(local, pl.axis_ranks(a, coord), axis=a, op=kind)
        mask = (x == local).to(x.dtype)
        count = mask.sum(dim=dims, keepdim=True)
        for a in axes:
            count = _comm.all_reduce(count, pl.axis_ranks(a, coord), axis=a)
        ctx.save_for_backward(mask, count)
        ctx.meta = (dims, keepdim, pl, axes)
        return local if keepdim else local.squeeze(dims)

    @staticmethod
    def backward(ctx, g):
        mask, count = ctx.saved_tensors
        dims, keepdim, pl, axes = ctx.meta
        if not keepdim:
            for d in sorted(dims):
                g = g.unsqueeze(d)
        coord = pl.coord()
        for a in axes:  # the output is B on these axes: its gradient arrives as P
            g = _comm.all_reduce(g, pl.axis_ranks(a, coord), axis=a)
        return g * mask / count, None, None, None, None, None


def _reduced_layout(x: Tensor, dims: tuple[int, ...], keepdim: bool):
    """For a global ``x`` without P, reduced over ``dims``: (mesh axes that split a reduced
    dim, output nd-SBP, output global shape)."""
    axes = tuple(a for a, s in enumerate(x.sbp) if s.is_split() and s.dim in dims)
    out_sbp = []
    for s in x.sbp:
        if s.is_split() and s.dim not in dims:
            out_sbp.append(Split(s.dim if keepdim else s.dim - sum(1 for r in dims if r < s.dim)))
        else:
            out_sbp.append(broadcast)
    if keepdim:
        shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape))
    else:
        shape = tuple(n for d, n in enumerate(x.shape) if d not in dims)
    for a in axes:
        ensure_groups(x.placement.axis_groups(a))
    return axes, tuple(out_sbp), shape


def check_nonempty(x: Tensor, name: str, dims: tuple[int, ...]) -> None:
    """torch's error for a max/min over nothing (a zero-size reduced dim, or an empty
    tensor reduced whole): there is no value to return.

    Raises:
        RuntimeError: as torch's, naming the shape and the dim."""
    shape = tuple(x.shape)
    if x.numel() == 0 and (not dims or len(dims) == len(shape)):
        raise RuntimeError(f"{name}(): expected reduction dim to be specified for an input "
                           f"with numel() == 0 (shape {shape}); reduce over a non-empty dim")
    for d in dims:
        if shape[d] == 0:
            raise RuntimeError(f"{name}(): expected reduction dim {d} to have non-zero size "
                               f"(shape {shape})")


def extremum(x: Tensor, kind: str, dim=None, keepdim: bool = False) -> Tensor:
    """``amax`` (``kind="max"``) or ``amin`` of ``x`` over ``dim`` (None: all dims)."""
    fn = torch.amax if kind == "max" else torch.amin
    nd = x.ndim
    dims = tuple(range(nd)) if dim is None else tuple(
        d % max(nd, 1) for d in ((dim,) if isinstance(dim, int) else dim) if nd)
    if x.is_local:
        return Tensor(fn(x.to_torch(), dim=dims, keepdim=keepdim))
    check_nonempty(x, "a" + kind, dims)
    pl = x.placement
    if any(s.is_partial() for s in x.sbp):
        x = x.to_global(sbp=tuple(broadcast if s.is_partial() else s for s in x.sbp))
    axes, out_sbp, shape = _reduced_layout(x, dims, keepdim)
    local = x.to_local().to_torch()
    if pl.coord() is None:
        out = local.reshape(-1)[:0].reshape((0,) * max(len(shape), 1))
    else:
        out = _GlobalExtremum.apply(local, kind, dims, keepdim, pl, axes)
    return Tensor(out, pl, out_sbp, shape)
