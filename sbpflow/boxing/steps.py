"""Running boxing plans: each step is a ``torch.autograd.Function`` on local shards.

The backward of a 1-D step ``src -> dst`` is the 1-D step ``dual(dst) -> dual(src)``
on the same mesh axis, with the other axes in their dual layouts too (see the table in
:mod:`sbpflow.boxing.plan`). A transfer between placements sends the gradient back
along the same pairs, summing where one source fed several destinations.

Every rank of the world runs every step (SPMD); a rank outside the placement holds an
empty shard and skips the collectives, but still creates process groups and takes part
in the world-wide debug check of point-to-point transfers.
"""

from __future__ import annotations

import torch

from ..distributed import _comm, _state
from ..placement import placement as Placement
from ..placement import shard_slices, split_sizes
from ..sbp import SBP, broadcast, dual, format_nd_sbp
from .plan import Plan, Step

__all__ = ["run_plan", "apply_axis", "broadcast_from_first", "backend_of", "summed_in_fp32",
           "upcast", "HALF"]


#: Floating dtypes whose sums across ranks are accumulated in float32 and cast back once,
#: as torch accumulates a half-precision sum or matmul on one device (ARCHITECTURE.md,
#: "Numerics"): partials of fp16 values overflow where the total does not, and partials of
#: bf16 values rounded to bf16 lose what cancels. The one definition of that rule: boxing
#: here, and above it :func:`sbpflow.ops.dispatch` (kernels that make new partial sums),
#: the global algorithms that combine per-shard sums (softmax, cumsum) and the compositions
#: (norm, var/std, batch_norm: :func:`sbpflow.ops.cast.in_float32`) all call :func:`upcast`.
HALF = (torch.float16, torch.bfloat16)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is fp16/bf16 (the type torch's CPU and CUDA kernels
    accumulate them in), else ``t`` itself."""
    return t.float() if t.dtype in HALF else t


def summed_in_fp32(x: torch.Tensor, reduce) -> torch.Tensor:
    """``reduce(x)`` (a sum across ranks), in float32 when ``x`` is fp16/bf16 (twice the
    bytes on the wire), cast back to ``x``'s dtype once at the end."""
    if x.dtype in HALF:
        return reduce(upcast(x)).to(x.dtype)
    return reduce(x)


def backend_of(pl: Placement) -> str:
    return "nccl" if pl.type == "cuda" else "gloo"


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,) * max(len(shape), 1), dtype=like.dtype, device=like.device)


def _axis_region(shape, pl: Placement, state, axis: int, coord) -> tuple[slice, ...]:
    """The region the ranks along ``axis`` share: the layout with ``axis`` not split."""
    full = list(state)
    full[axis] = broadcast
    return shard_slices(shape, pl.shape, full, coord)


def apply_axis(x: torch.Tensor, pl: Placement, shape, state: tuple[SBP, ...], axis: int,
               dst: SBP) -> torch.Tensor:
    """Run the 1-D transition ``state[axis] -> dst`` on mesh axis ``axis`` (no autograd).

    ``x`` is this rank's shard under nd-SBP ``state`` of a global tensor of ``shape``;
    returns its shard under ``state`` with ``axis`` set to ``dst``.
    """
    coord = pl.coord()
    if coord is None:
        return x if x.numel() == 0 else _empty(shape, x)
    src = state[axis]
    ranks = pl.axis_ranks(axis, coord)
    i, n = coord[axis], len(ranks)
    region = _axis_region(shape, pl, state, axis, coord)

    def sizes(d: int) -> list[int]:
        return split_sizes(region[d].stop - region[d].start, n)

    if src.is_partial() and dst.is_broadcast():
        return summed_in_fp32(x, lambda v: _comm.all_reduce(v, ranks, axis=axis))
    if src.is_partial() and dst.is_split():
        return summed_in_fp32(x, lambda v: _comm.reduce_scatter(v, ranks, dst.dim,
                                                                sizes(dst.dim), axis=axis))
    if src.is_split() and dst.is_broadcast():
        return _comm.all_gather(x, ranks, src.dim, sizes(src.dim), axis=axis)
    if src.is_split() and dst.is_split():
        return _comm.all_to_all(x, ranks, dst.dim, sizes(dst.dim), src.dim, sizes(src.dim),
                                axis=axis)
    if src.is_broadcast() and dst.is_split():
        s = sizes(dst.dim)
        return x.narrow(dst.dim, sum(s[:i]), s[i]).clone()
    if src.is_broadcast() and dst.is_partial():
        return x.clone() if i == 0 else torch.zeros_like(x)
    if src.is_split() and dst.is_partial():
        s = sizes(src.dim)
        out_shape = list(x.shape)
        out_shape[src.dim] = sum(s)
        out = x.new_zeros(out_shape)
        out.narrow(src.dim, sum(s[:i]), s[i]).copy_(x)
        return out
    raise AssertionError(f"no 1-D transition {src!r} -> {dst!r}")


class _AxisStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step: Step, shape):
        ctx.step, ctx.shape = step, shape
        return apply_axis(x, step.placement, shape, step.in_sbp, step.axis, step.out_sbp[step.axis])

    @staticmethod
    def backward(ctx, g):
        step = ctx.step
        a = step.axis
        g_state = tuple(dual(s) for s in step.out_sbp)
        gx = apply_axis(g, step.placement, ctx.shape, g_state, a, dual(step.in_sbp[a]))
        return gx, None, None


def _transfer_device(step: Step, fallback: torch.device) -> torch.device:
    if step.placement.type == "cpu" or step.dst_placement.type == "cpu":
        return torch.device("cpu")
    return fallback


def _move(step: Step, x: torch.Tensor, shape, src_pl: Placement, dst_pl: Placement,
          src_sbp, dst_sbp, pairs, accumulate: bool) -> torch.Tensor:
    """Send shards from ``src_pl`` to ``dst_pl`` along ``pairs``; sum arrivals if ``accumulate``."""
    me = _state.get_rank()
    tdev = _transfer_device(step, x.device)
    sends = [(x.to(tdev), d) for s, d in pairs if s == me and d != me]
    recvs = [(torch.empty(src_pl.shard_shape(shape, src_sbp, s), dtype=x.dtype, device=tdev), s)
             for s, d in pairs if d == me and s != me]
    sig = (f"{format_nd_sbp(src_sbp)} on {src_pl!r} -> {format_nd_sbp(dst_sbp)} on {dst_pl!r}, "
           f"shape={tuple(shape)}, dtype={x.dtype}")
    _comm.send_recv(sends, recvs, sig)
    if me not in dst_pl:
        return _empty(shape, x)
    dev = dst_pl.device
    parts = [b.to(dev) for b, _ in recvs] + [x.to(dev) for s, d in pairs if s == me and d == me]
    if not accumulate:
        (out,) = parts
        return out
    acc = torch.float32 if x.dtype in HALF else x.dtype
    out = torch.zeros(dst_pl.shard_shape(shape, dst_sbp), dtype=acc, device=dev)
    for p in parts:
        out += p
    return out.to(x.dtype)


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step: Step, shape):
        ctx.step, ctx.shape = step, shape
        ctx.src_device = x.device
        return _move(step, x, shape, step.placement, step.dst_placement, step.in_sbp,
                     step.out_sbp, step.pairs, accumulate=False)

    @staticmethod
    def backward(ctx, g):
        step = ctx.step
        back = tuple((d, s) for s, d in step.pairs)
        gx = _move(step, g, ctx.shape, step.dst_placement, step.placement,
                   tuple(dual(s) for s in step.out_sbp), tuple(dual(s) for s in step.in_sbp),
                   back, accumulate=True)
        return gx.to(ctx.src_device) if gx.numel() else gx, None, None


def run_plan(x: torch.Tensor, plan: Plan, deferred: bool = False) -> torch.Tensor:
    """Run ``plan`` on this rank's shard ``x``; differentiable (each step's backward is dual).
    ``deferred``: its result is first used by the optimizer's update (a parameter's
    gradient), so a compiled program waits for it there, not at once (a logical graph
    records that)."""
    planner = _state._state.tracer if getattr(_state._state.tracer, "planning", False) \
        else None
    x_in = x
    if planner is not None:
        planner.in_boxing += 1  # its collectives are this boxing's steps
    try:
        for step in plan.steps:
            if step.kind == "axis":
                if step.collective not in ("slice", "zero_fill", "pad"):
                    _state.ensure_groups(step.placement.axis_groups(step.axis))
                x = _AxisStep.apply(x, step, plan.shape)
            else:
                x = _Transfer.apply(x, step, plan.shape)
    finally:
        if planner is not None:
            planner.in_boxing -= 1
    if planner is not None and plan.steps:  # a boxing node of the logical graph
        planner.on_boxing(x_in, x, plan, deferred)
    return x


class _BroadcastFromFirst(torch.autograd.Function):
    """Local -> global along the B axes: coordinate 0 of each axis broadcasts its value.

    Backward: the gradient (P along those axes) is summed onto coordinate 0 of each
    axis (a reduce); the other ranks' inputs get zeros, since their values were unused.
    """

    @staticmethod
    def forward(ctx, x, pl: Placement, axes: tuple[int, ...], shape, dtype):
        ctx.pl, ctx.axes = pl, axes
        ctx.in_shape, ctx.in_dtype = x.shape, x.dtype
        coord = pl.coord()
        out = x
        for a in axes:
            ranks = pl.axis_ranks(a, coord)
            buf = out.clone() if coord[a] == 0 else out.new_empty(shape, dtype=dtype)
            out = _comm.broadcast(buf, ranks, 0, axis=a)
        return out if out is not x else x.clone()

    @staticmethod
    def backward(ctx, g):
        pl, coord = ctx.pl, ctx.pl.coord()
        dtype = g.dtype
        g = g.float() if dtype in HALF else g  # summed in float32, cast back once
        for a in reversed(ctx.axes):
            g = _comm.reduce(g, pl.axis_ranks(a, coord), 0, axis=a)
        g = g.to(dtype)
        if any(coord[a] != 0 for a in ctx.axes):
            g = torch.zeros(ctx.in_shape, dtype=ctx.in_dtype, device=g.device)
        return g, None, None, None, None


def broadcast_from_first(x: torch.Tensor, pl: Placement, axes: tuple[int, ...], shape,
                         dtype) -> torch.Tensor:
    """Broadcast ``x`` from coordinate 0 along each mesh axis in ``axes`` (differentiable).

    Non-root ranks may pass any tensor (its values are not read); ``shape`` and ``dtype``
    describe the root's value. Every rank of the world calls this; ranks outside ``pl``
    get ``x`` back unchanged.
    """
    for a in axes:
        _state.ensure_groups(pl.axis_groups(a))
    if pl.coord() is None or not axes:
        return x
    return _BroadcastFromFirst.apply(x, pl, tuple(axes), tuple(shape), dtype)
