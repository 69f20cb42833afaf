"""``DistributedDataParallel`` for programs written with *local* tensors (as torch's DDP).

Each rank holds the whole model and feeds it its own batch. At construction the
parameters and buffers are broadcast from rank 0; in backward each parameter's gradient
goes into flat buckets (``bucket_cap_mb``, default 25) whose all-reduces are launched
asynchronously as they fill, overlapping the rest of backward (the same bucket machinery
as global tensors, :mod:`sbpflow.autograd.grad_sync`); at the end of backward the averaged
gradient (sum / world size, as torch's DDP) is in ``.grad``. :meth:`no_sync` skips the
all-reduce for gradient accumulation. Global tensors do not need this wrapper: a
B parameter with a batch-split input is data parallel by itself.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ...autograd import grad_sync as _grad_sync
from ...distributed import broadcast_coalesced, ensure_groups, get_world_size
from ...placement import placement as Placement
from ..module import Module

__all__ = ["DistributedDataParallel"]


class _LocalLeaf:
    """A local parameter's bucket entry: reduced over the world, averaged."""

    __slots__ = ("placement", "sync_axes", "pending", "tensor", "scale", "acc")

    def __init__(self, t: torch.Tensor, pl: Placement):
        self.placement, self.sync_axes, self.pending = pl, (0,), None
        self.tensor = weakref.ref(t)
        self.scale = 1.0 / pl.size
        with torch.enable_grad():
            self.acc = t.view_as(t).grad_fn.next_functions[0][0]
        self.acc.register_prehook(self.on_accumulate)

    def on_accumulate(self, grads):
        if grads[0] is None:
            return None
        return _grad_sync.on_accumulate(self, grads)

    def deliver(self, reduced: torch.Tensor, replace: bool = False) -> None:
        _grad_sync.deliver(self.tensor(), reduced.mul_(self.scale), replace)


class DistributedDataParallel(Module):
    """Wrap ``module`` (local parameters on every rank) for data-parallel training.

    Args:
        module: an :class:`sbpflow.nn.Module` whose parameters are local tensors.
        bucket_cap_mb: bucket size in MiB (torch's default 25).
        broadcast_buffers: broadcast buffers from rank 0 before each forward (torch's
            default True), so BatchNorm running statistics stay identical; coalesced: one
            broadcast per buffer dtype (two for BatchNorm: float statistics, int64 counts).

    Every rank of the world constructs it and runs the same forward/backward sequence.

    Raises:
        ValueError: a global parameter (use global tensors directly instead).
    """

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, **kwargs):
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        if bucket_cap_mb is not None:
            _grad_sync.set_bucket_size(int(bucket_cap_mb * 2 ** 20))
        world = tuple(range(get_world_size()))
        dev = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._placement = Placement(dev.type, list(world))
        if len(world) > 1:
            ensure_groups([world])
        self._leaves = []
        for name, p in module.named_parameters():
            if p.is_global:
                raise ValueError(f"DistributedDataParallel wraps local parameters; "
                                 f"{name} is global (laid out {p.sbp}): global tensors are "
                                 f"data parallel by themselves")
        with torch.no_grad():
            # rank 0's parameters, coalesced (torch DDP's _sync_module_states)
            broadcast_coalesced([p._local.data for p in module.parameters()], world, 0)
        for p in module.parameters():
            if p.requires_grad:
                self._leaves.append(_LocalLeaf(p._local, self._placement))
        self._sync_buffers()

    def _sync_buffers(self) -> None:
        """Rank 0's buffers to every rank: one broadcast per dtype (and 250 MiB bucket), as
        torch DDP's ``_sync_buffers``."""
        world = tuple(range(get_world_size()))
        with torch.no_grad():
            broadcast_coalesced([b._local for b in self.module.buffers() if b.is_local],
                                world, 0)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.training:
            self._sync_buffers()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no all-reduce) inside the block; the first backward
        after it reduces everything accumulated."""
        with _grad_sync.no_sync():
            yield
