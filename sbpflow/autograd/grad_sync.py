"""Gradient synchronisation of global leaves, bucketed and overlapped with backward.

A global leaf's gradient arrives from autograd in the dual of its layout (ARCHITECTURE,
"the dual rule"): a B parameter's gradient as P. When the leaf's gradient layout differs
from that only by P -> B on some mesh axes (data parallel: all axes; a tensor-parallel
layer's split weight under DP x TP: the DP axis), the gradient is a sum over those axes:
one all-reduce. Such gradients are not reduced one by one; as DDP does, they are copied
into a flat bucket per (placement, axes, dtype, device), and a bucket's all-reduce is
launched asynchronously as soon as it holds :func:`get_bucket_size` bytes, while backward
goes on computing earlier layers. At the end of backward (an autograd-engine callback)
the remaining buckets are launched, all are waited for (bounded by the collective
timeout), and the reduced values are added to the leaves' ``.grad``.

Mechanics: an ``AccumulateGrad`` pre-hook of each such leaf hands its incoming gradient
to the buckets and lets autograd accumulate zeros instead (so ``.grad`` never mixes
reduced and unreduced values). Other layout changes (ZeRO's P -> S(0), ...) are boxed
per leaf as the gradient arrives (:class:`sbpflow.autograd.leaf._LeafGrad`).

:func:`no_sync` defers the reduction for gradient accumulation: inside it, incoming
gradients are summed locally per leaf (no communication); the next backward outside it
reduces the sum together with its own gradients, once. Every rank of the world must
enter and leave ``no_sync`` at the same steps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ..distributed import _comm, ensure_groups
from ..distributed._state import _state as _dstate

__all__ = ["no_sync", "set_bucket_size", "get_bucket_size", "sync_axes", "BUCKETS"]

_DEFAULT_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default bucket_cap_mb


def sync_axes(src, dst) -> tuple[int, ...] | None:
    """Mesh axes on which ``src`` -> ``dst`` is exactly P -> B (the rest unchanged), or
    None when the transition is anything else (then it is boxed per leaf)."""
    axes = []
    for a, (s, d) in enumerate(zip(src, dst)):
        if s == d:
            continue
        if s.is_partial() and d.is_broadcast():
            axes.append(a)
        else:
            return None
    return tuple(axes) if axes else None


class _Bucket:
    __slots__ = ("items", "nbytes")

    def __init__(self):
        self.items: list = []  # (leaf state, gradient)
        self.nbytes = 0


class _Buckets:
    """The buckets of the backward pass in progress (one per process)."""

    def __init__(self):
        self.cap = _DEFAULT_BUCKET_BYTES
        self.open: dict[tuple, _Bucket] = {}
        self.inflight: list[tuple[_Bucket, _comm.Pending]] = []
        self.callback_queued = False
        self.deferring = 0  # no_sync depth
        self._groups: dict[tuple, tuple[int, ...] | None] = {}
        self.lock = threading.Lock()

    def group(self, pl, axes) -> tuple[int, ...] | None:
        """This rank's group over ``axes`` of ``pl`` (None outside); creates every group of
        those axes on first use (all ranks reach this in the same order)."""
        key = (pl, axes)
        if key not in self._groups:
            ranks = pl.ranks
            moved = np.moveaxis(ranks, axes, tuple(range(ranks.ndim - len(axes), ranks.ndim)))
            rows = moved.reshape(-1, int(np.prod([pl.shape[a] for a in axes])))
            groups = [tuple(int(r) for r in row) for row in rows]
            ensure_groups(groups)
            coord = pl.coord()
            mine = None
            if coord is not None:
                me = pl.rank_at(coord)
                mine = next(g for g in groups if me in g)
            self._groups[key] = mine
        return self._groups[key]

    def add(self, leaf, g: torch.Tensor, replace: bool = False) -> None:
        group = self.group(leaf.placement, leaf.sync_axes)
        if group is None:
            return
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.callback_queued = True
        key = (leaf.placement, leaf.sync_axes, g.dtype, g.device)
        bucket = self.open.get(key)
        if bucket is None:
            bucket = self.open[key] = _Bucket()
        bucket.items.append((leaf, g, replace))
        bucket.nbytes += g.nbytes
        if bucket.nbytes >= self.cap:
            self._launch(key)

    def _launch(self, key) -> None:
        bucket = self.open.pop(key)
        pl, axes = key[0], key[1]
        _dstate.activity = "gradient sync (backward)"
        # fp16/bf16 gradients are summed in float32 (twice the bytes), as one device sums
        # the batch's contributions in a float32 accumulator; cast back in finish().
        acc = torch.float32 if key[2] in (torch.float16, torch.bfloat16) else key[2]
        flat = torch.cat([g.reshape(-1).to(acc) for _, g, _ in bucket.items]) \
            if len(bucket.items) > 1 else bucket.items[0][1].reshape(-1).to(acc, copy=True)
        self.inflight.append((bucket, _comm.all_reduce_async(flat, self.group(pl, axes),
                                                             axis=axes[0] if len(axes) == 1
                                                             else None)))

    def finish(self) -> None:
        """End of backward: launch what is left, wait, add into ``.grad``."""
        try:
            for key in list(self.open):
                self._launch(key)
            for bucket, pending in self.inflight:
                flat = pending.wait()
                offset = 0
                for leaf, g, replace in bucket.items:
                    n = g.numel()
                    leaf.deliver(flat[offset:offset + n].view(g.shape).to(g.dtype), replace)
                    offset += n
        finally:
            self.open.clear()
            self.inflight.clear()
            self.callback_queued = False


BUCKETS = _Buckets()


def on_accumulate(leaf, grads):
    """``AccumulateGrad`` pre-hook body shared by global leaves and DDP's local parameters.

    ``leaf`` has ``placement``, ``sync_axes``, ``pending``, ``tensor`` (a weakref to the
    leaf); the incoming gradient goes to the buckets (or, under :func:`no_sync`, into
    ``leaf.pending``). When the leaf has no ``.grad`` yet (the usual step after
    ``zero_grad``), autograd stores the unreduced gradient and the reduced one overwrites it
    at the end of backward; otherwise autograd accumulates zeros and the reduced gradient is
    added (so ``.grad`` never mixes reduced and unreduced values)."""
    if leaf.pending is None and \
            len(BUCKETS.group(leaf.placement, leaf.sync_axes) or ()) <= 1:
        # a group of one rank (the sum is the gradient) or none (this rank holds an empty
        # shard): nothing to reduce, now or after no_sync; autograd accumulates it
        return None
    g = grads[0].detach()
    if BUCKETS.deferring:
        if leaf.pending is None:
            leaf.pending = g.clone()
        else:  # in place (its own buffer): a graph's copies of a micro-batch chain it
            leaf.pending.add_(g)
    else:
        if leaf.pending is not None:
            g, leaf.pending = g + leaf.pending, None
        t = leaf.tensor() if leaf.tensor is not None else None
        replace = t is not None and t.grad is None
        BUCKETS.add(leaf, g, replace)
        if replace:
            return None  # no zeros to allocate, no add: finish() overwrites .grad
    return (torch.zeros_like(grads[0]),)


def deliver(t: torch.Tensor | None, reduced: torch.Tensor, replace: bool = False) -> None:
    """Put a reduced gradient into leaf ``t``'s ``.grad``: overwrite the unreduced one
    autograd stored (``replace``), or add it."""
    if t is None:
        return
    with torch.no_grad():
        if t.grad is None:
            t.grad = reduced.clone()
        elif replace:
            t.grad.copy_(reduced)
        else:
            t.grad.add_(reduced)


def set_bucket_size(nbytes: int) -> None:
    """Bytes per gradient bucket (default 25 MiB, torch DDP's ``bucket_cap_mb``); 0 turns
    bucketing off (each gradient is then reduced as it arrives, synchronously).

    Raises:
        ValueError: a negative size.
    """
    if nbytes < 0:
        raise ValueError(f"bucket size must be >= 0 bytes, got {nbytes}")
    BUCKETS.cap = int(nbytes)


def get_bucket_size() -> int:
    """Bytes per gradient bucket (0: bucketing off)."""
    return BUCKETS.cap


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Defer gradient synchronisation (all-reduces of P gradients) for gradient
    accumulation; the first backward after the block reduces everything accumulated.

    Example::

        for i, batch in enumerate(micro_batches):
            ctx = sbpflow.no_sync() if i < len(micro_batches) - 1 else nullcontext()
            with ctx:
                loss(model, batch).backward()
        optimizer.step()
    """
    BUCKETS.deferring += 1
    try:
        yield
    finally:
        BUCKETS.deferring -= 1
