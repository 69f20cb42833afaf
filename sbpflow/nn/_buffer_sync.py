"""Replicated (B) buffers that a module updated from this rank's data alone, made equal
again once per outermost module call, in coalesced broadcasts.

BatchNorm with ``sync_stats=False`` normalises each data-parallel rank's part of the
batch with that part's statistics (torch DDP without SyncBatchNorm), so its running
statistics come out different on each rank; as DDP's ``broadcast_buffers``, the first
data-parallel rank's values then become every rank's. Broadcasting per layer costs one
small blocking collective per layer (20 a step for ResNet-18); instead a layer hands its
updated buffers to :func:`defer`, and the outermost :class:`~sbpflow.nn.Module` call
flushes everything deferred on its way out (:func:`flush`), before its forward hooks and
before any of the caller's code can read a buffer: per (placement, mesh axes) one
:func:`sbpflow.distributed.broadcast_coalesced` per mesh axis (from coordinate 0 of that
axis), i.e. one broadcast per dtype and 250 MiB bucket. The values are those of a
broadcast after each layer: a layer reads its statistics only before updating them, and a
layer called again before the flush flushes first (:func:`is_pending`).

Every rank runs the same module calls (SPMD), so every rank defers the same buffers in the
same order and the flushes pair up. An exception inside a forward leaves its deferred
buffers pending (no collective on an error path); the next flush takes them. A layer
called outside any module call (``bn.forward(x)`` directly) broadcasts at once. The state
is per thread.
"""

from __future__ import annotations

import threading

import torch

from ..distributed import broadcast_coalesced, ensure_groups

__all__ = ["defer", "flush", "is_pending", "pending_count"]


class _State(threading.local):
    def __init__(self):
        self.depth = 0  # nesting of Module.__call__ on this thread
        # (placement, mesh axes) -> buffers (local torch tensors) to take from coordinate 0
        self.pending: dict[tuple, list[torch.Tensor]] = {}
        self.ids: set[int] = set()


STATE = _State()


def defer(pl, axes: tuple[int, ...], tensors) -> None:
    """Make ``tensors`` (the local shards of B buffers of placement ``pl``, updated in
    place from this rank's data) equal to those at coordinate 0 of each mesh axis in
    ``axes``: at the end of the outermost module call, or now when no module call is in
    progress. Every rank of the world calls this with the same placement, axes, shapes and
    dtypes."""
    tensors = [t for t in tensors if id(t) not in STATE.ids]
    if not tensors or not axes:
        return
    key = (pl, tuple(axes))
    STATE.pending.setdefault(key, []).extend(tensors)
    STATE.ids.update(id(t) for t in tensors)
    if STATE.depth == 0:
        flush()


def is_pending(t: torch.Tensor) -> bool:
    """Whether local tensor ``t`` waits for a :func:`flush`."""
    return id(t) in STATE.ids


def pending_count() -> int:
    """How many buffers wait for a :func:`flush` on this thread."""
    return len(STATE.ids)


def flush() -> None:
    """Broadcast every deferred buffer from coordinate 0 of its mesh axes, coalesced (one
    collective per placement, mesh axis, dtype and 250 MiB bucket). Collective: every rank
    of the world calls it at the same point (the outermost module call's end does)."""
    pending = STATE.pending
    STATE.pending, STATE.ids = {}, set()
    for (pl, axes), tensors in pending.items():
        for a in axes:
            ensure_groups(pl.axis_groups(a))  # every rank of the world, in one order
        coord = pl.coord()
        if coord is None:
            continue
        with torch.no_grad():
            for a in axes:
                broadcast_coalesced(tensors, pl.axis_ranks(a, coord), 0, axis=a)
