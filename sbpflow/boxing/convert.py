"""Local -> global conversion and the boxing of a global shard: torch tensors in, torch
tensors out (:class:`sbpflow.Tensor` wraps the results; this layer is below it).

* :func:`local_to_global`: the ranks' local tensors as the shards (S), summands (P) or
  broadcast copies (B) of one global tensor; their shapes and dtypes are exchanged over
  the world and checked (``check_meta``), and the local input receives the gradient of
  its part (``grad_sbp`` overrides its layout).
* :func:`global_to_global`: a planned boxing (:func:`sbpflow.boxing.plan_boxing`), its
  backward optionally routed through a ``grad_sbp`` layout.
* :func:`gather_whole`: the whole value of a global tensor on every rank of the world.
"""

from __future__ import annotations

import torch

from .. import distributed as _dist
from ..distributed import _comm
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, dual, format_nd_sbp, normalize_nd_sbp
from .plan import plan_boxing
from .steps import backend_of, broadcast_from_first, run_plan

__all__ = ["gather_whole", "global_to_global", "local_to_global"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]



def global_to_global(local: torch.Tensor, shape, src_pl: Placement, src_sbp, pl: Placement, sbp,
                     grad_sbp=None) -> tuple[torch.Tensor, tuple[SBP, ...]]:
    """Box the shard ``local`` of a global tensor of global ``shape`` laid out ``src_sbp``
    on ``src_pl`` to ``sbp`` on ``pl`` (differentiable; see :meth:`sbpflow.Tensor.to_global`
    for ``grad_sbp``). Returns ``(new shard, normalised nd-SBP)``."""
    shape = tuple(shape)
    nd = normalize_nd_sbp(sbp, pl.ndim, len(shape))
    plan = plan_boxing(shape, local.dtype, src_pl, src_sbp, pl, nd, backend_of(pl))
    if grad_sbp is None:
        return run_plan(local, plan), nd
    g_nd = normalize_nd_sbp(grad_sbp, src_pl.ndim, len(shape))
    return _RoutedBoxing.apply(local, plan, (src_pl, src_sbp), (pl, nd), g_nd), nd


class _RoutedBoxing(torch.autograd.Function):
    """Boxing ``src -> dst`` whose backward goes ``dual(dst)`` (destination placement) ->
    ``grad_sbp`` (source placement) -> ``dual(src)``; values are as without grad_sbp."""

    @staticmethod
    def forward(ctx, local, plan, src, dst, grad_sbp):
        ctx.meta = (plan.shape, src, dst, grad_sbp)
        with torch.no_grad():
            return run_plan(local, plan)

    @staticmethod
    def backward(ctx, g):
        shape, (src_pl, src_sbp), (dst_pl, dst_sbp), g_nd = ctx.meta
        d_dst = tuple(dual(s) for s in dst_sbp)
        d_src = tuple(dual(s) for s in src_sbp)
        via = plan_boxing(shape, g.dtype, dst_pl, d_dst, src_pl, g_nd, backend_of(src_pl))
        back = plan_boxing(shape, g.dtype, src_pl, g_nd, src_pl, d_src, backend_of(src_pl))
        with torch.no_grad():
            return run_plan(run_plan(g, via), back), None, None, None, None



def _dtype_code(dt: torch.dtype) -> int:
    return _DTYPES.index(dt) if dt in _DTYPES else len(_DTYPES)


def local_to_global(local: torch.Tensor, pl: Placement, sbp, grad_sbp=None,
                    check_meta: bool = True,
                    size=None) -> tuple[torch.Tensor, tuple[SBP, ...], tuple[int, ...]]:
    """This rank's shard of the global tensor that the ranks' ``local`` tensors form on
    ``pl`` laid out ``sbp`` (every rank of the world calls it; the rules, ``grad_sbp``,
    ``check_meta`` and ``size`` are those of :meth:`sbpflow.Tensor.to_global`).

    Returns ``(shard, normalised nd-SBP, global shape)``; differentiable.
    """
    ndim = local.dim() if size is None else len(size)
    nd = normalize_nd_sbp(sbp, pl.ndim, ndim)
    coord = pl.coord()
    if check_meta:
        shape, dtype = _exchange_and_check(local, pl, nd, size)
    else:
        dtype = local.dtype
        if size is not None:
            shape = tuple(int(s) for s in size)
        else:
            grown = list(local.shape)
            for a, s in enumerate(nd):
                if s.is_split():
                    grown[s.dim] *= pl.shape[a]
            shape = tuple(grown)
        want = pl.shard_shape(shape, nd)
        if coord is not None and tuple(local.shape) != want:
            raise ValueError(
                f"to_global({format_nd_sbp(nd)}, check_meta=False): rank {pl.rank_at(coord)}'s "
                f"local shape {tuple(local.shape)} is not its shard {want} of the global shape "
                f"{shape}; " + ("check size=" if size is not None else
                                "pass size= (the global shape)") + " or leave check_meta=True")
    b_axes = tuple(a for a, s in enumerate(nd) if s.is_broadcast())
    for a in b_axes:  # every rank makes the same groups in the same order, members or not
        _dist.ensure_groups(pl.axis_groups(a))
    if coord is None:
        # An empty shard of the global dtype, still connected to the input's graph.
        out = local.reshape(-1)[:0].to(dtype).reshape((0,) * max(len(shape), 1))
        return out, nd, shape
    if b_axes:
        out = broadcast_from_first(local, pl, b_axes, pl.shard_shape(shape, nd), dtype)
    else:
        # S and P: the local tensor is the shard (no copy); a new autograd node keeps a
        # grad-requiring input's graph, a detached alias keeps the input untouched.
        out = local.view_as(local) if local.requires_grad else local.detach()
    if grad_sbp is not None:
        g_nd = normalize_nd_sbp(grad_sbp, pl.ndim, len(shape))
        for a, (s, g) in enumerate(zip(nd, g_nd)):
            if (s.is_split() or g.is_split()) and s != g:
                raise ValueError(
                    f"grad_sbp {format_nd_sbp(g_nd)} does not fit sbp {format_nd_sbp(nd)} on mesh "
                    f"axis {a}: a local input's gradient must have its shard's shape, so a split "
                    f"axis keeps its split and a B/P axis takes B or P")
        out = _LocalGradAs.apply(local, out, pl, nd, g_nd, shape)
    return out, nd, shape


class _LocalGradAs(torch.autograd.Function):
    """Identity on the global's shard; the local input's gradient is the shard of the
    incoming gradient (layout dual(sbp)) boxed to ``grad_sbp``."""

    @staticmethod
    def forward(ctx, local, out, pl, nd, g_nd, shape):
        ctx.meta = (pl, nd, g_nd, shape)
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        pl, nd, g_nd, shape = ctx.meta
        plan = plan_boxing(tuple(shape), g.dtype, pl, tuple(dual(s) for s in nd), pl, g_nd,
                           backend_of(pl))
        with torch.no_grad():
            return run_plan(g, plan), None, None, None, None, None


def _exchange_and_check(local, pl, nd, size):
    """All-gather (ndim, dtype, shape) over the world; infer and check the global shape.

    Returns ``(global shape, dtype)``. Over the world rather than the placement, so that
    ranks outside it learn them too (their own local tensors are ignored). Ranks that are
    not at coordinate 0 of a B axis are overwritten by the broadcast: their shapes and
    dtypes are not checked; the others must agree in ndim and dtype and their shapes must
    be the shards of one global shape.
    """
    world = tuple(range(_dist.get_world_size()))
    _dist.ensure_groups([world])
    all_metas = _comm.all_gather_meta([local.dim(), _dtype_code(local.dtype), *local.shape], world)
    b_axes = [a for a, s in enumerate(nd) if s.is_broadcast()]
    live = [(pl.coord(r), all_metas[r]) for r in pl.rank_list]
    live = [(c, m) for c, m in live if all(c[a] == 0 for a in b_axes)]
    ref_c, ref = live[0]

    def describe(c, m) -> str:
        name = str(_DTYPES[m[1]]) if m[1] < len(_DTYPES) else "an unsupported dtype"
        return f"rank {pl.rank_at(c)} has shape {tuple(m[2:])} and dtype {name}"

    odd = [describe(c, m) for c, m in live if m[0] != ref[0] or m[1] != ref[1]]
    if odd:
        raise ValueError(
            f"to_global({format_nd_sbp(nd)}) on {pl!r}: local tensors must agree in number of "
            f"dims and dtype; {describe(ref_c, ref)}, but " + "; ".join(odd))
    if ref[1] >= len(_DTYPES):
        raise TypeError(f"to_global: dtype {local.dtype} is not supported; use one of {_DTYPES}")
    if size is not None:
        shape = tuple(int(s) for s in size)
    else:
        shape = list(ref[2:])
        for d in {s.dim for s in nd if s.is_split()}:
            split_axes = {a for a, s in enumerate(nd) if s.is_split() and s.dim == d}
            shape[d] = sum(m[2 + d] for c, m in live
                           if all(c[a] == 0 for a in range(len(c)) if a not in split_axes))
        shape = tuple(shape)
    bad = []
    for c, m in live:
        want = pl.shard_shape(shape, nd, pl.rank_at(c))
        if tuple(m[2:]) != want:
            bad.append(f"rank {pl.rank_at(c)} has {tuple(m[2:])}, expected {want}")
    if bad:
        hint = (" Split dims follow sbpflow.placement.shard_shape (the first size % n ranks hold "
                "one more element)." if any(s.is_split() for s in nd) else
                " B and P locals hold the whole tensor.")
        raise ValueError(
            f"to_global({format_nd_sbp(nd)}) on {pl!r}: local shapes do not form a global tensor "
            f"of shape {shape}: " + "; ".join(bad) + "." + hint)
    return shape, _DTYPES[ref[1]]


def gather_whole(local: torch.Tensor, shape, pl: Placement, sbp) -> torch.Tensor:
    """The whole value (detached, on CPU) of the global tensor of global ``shape`` whose
    shard on this rank is ``local`` (laid out ``sbp`` on ``pl``). Collective: every rank
    of the world calls it and gets the value; ranks outside the placement receive it from
    the placement's first rank."""
    with torch.no_grad():
        b, _ = global_to_global(local, shape, pl, sbp, pl, (broadcast,) * pl.ndim)
        world = tuple(range(_dist.get_world_size()))
        if len(pl.rank_list) < len(world):
            # Ranks outside the placement get the value from its first rank.
            _dist.ensure_groups([world])
            if pl.coord() is None:
                b = torch.empty(tuple(shape), dtype=local.dtype, device=pl.device)
            else:
                b = b.clone()  # broadcast writes in place; b may alias a graph tensor
            _comm.broadcast(b, world, pl.rank_list[0])
        return b.detach().cpu()
