"""Live tensor bytes on a device without allocator statistics (CPU), for ``sbpflow bench
--compare-plans``'s measured peak memory (:func:`sbpflow.apps.bench.plans.peak_step_bytes`).

Torch's profiler's memory events were used before: they miss frees of buffers the
collectives allocate (gloo's threads), so a step's allocations outweighed its frees by up
to 100 MiB and ZeRO-3 looked as if it held more than data parallel."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveStorages"]


def _storages(tree) -> list:
    return [t.untyped_storage() for t in _pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


class LiveStorages(TorchDispatchMode):
    """While active (this thread's ops), track every storage an op creates (an output
    that aliases none of its inputs) by weak reference. ``peak``: the most bytes of those
    storages alive at once, checked after each op. What existed before the block (a
    model's parameters and optimizer state) is not counted; kernels' scratch memory and
    buffers allocated outside torch's dispatcher are not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}  # storage address -> (weak reference, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {st.data_ptr() for st in _storages((args, kwargs))}
        now = 0
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            else:
                now += n
        for st in _storages(out):
            key = st.data_ptr()
            if key and key not in self.live and key not in read:
                self.live[key] = (StorageWeakRef(st), st.nbytes())
                now += st.nbytes()
        self.peak = max(self.peak, now)
        return out
