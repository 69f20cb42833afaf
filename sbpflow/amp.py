"""Mixed precision: ``autocast`` (torch's, applied to the local kernels) and a
``GradScaler`` whose inf/nan verdict agrees across ranks.

Local kernels are torch ops, so ``torch.autocast`` casts them as it does on one device;
``sbpflow.autocast`` *is* ``torch.autocast`` (``device_type`` ``"cpu"`` or ``"cuda"``,
``dtype`` ``torch.bfloat16`` or ``torch.float16``).

:class:`GradScaler` is ``torch.amp.GradScaler`` with two changes: :meth:`~GradScaler.scale`
takes sbpflow tensors (every shard is multiplied by the scale, exact under any SBP since
scaling is linear), and :meth:`~GradScaler.unscale_` all-reduces the found-inf flag over
the world (MAX), so that every rank skips the same steps and updates the scale the same
way: a rank whose shard overflowed would otherwise step while the others skip, and the
replicas would diverge.
"""

from __future__ import annotations

import torch

from .distributed import _comm, ensure_groups, get_world_size
from .tensor import Tensor

__all__ = ["autocast", "GradScaler"]

autocast = torch.autocast


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler(device="cpu"|"cuda", init_scale=2**16, growth_factor=2.0,
    backoff_factor=0.5, growth_interval=2000, enabled=True)`` over sbpflow optimizers.

    Every rank of the world calls :meth:`unscale_` / :meth:`step` (collective when the
    world has more than one rank).
    """

    def scale(self, outputs):
        """``outputs * scale`` for an sbpflow tensor (local or global, any SBP), or a list
        or tuple of them; torch tensors as torch does."""
        if isinstance(outputs, Tensor):
            if not self._enabled:
                return outputs
            scaled = super().scale(outputs._local)
            return Tensor(scaled, outputs.placement, outputs.sbp, outputs.shape)
        if isinstance(outputs, (list, tuple)) and outputs and isinstance(outputs[0], Tensor):
            return type(outputs)(self.scale(o) for o in outputs)
        return super().scale(outputs)

    def unscale_(self, optimizer) -> None:
        """Unscale this rank's gradient shards, then agree on inf/nan over the world."""
        if not self._enabled:
            return
        load = getattr(optimizer, "_load_grads", None)
        if load is not None:
            load()  # ZeRO master shards see their gradients
        super().unscale_(optimizer)
        if get_world_size() > 1:
            world = tuple(range(get_world_size()))
            ensure_groups([world])
            state = self._per_optimizer_states[id(optimizer)]
            for found in state["found_inf_per_device"].values():
                found.copy_(_comm.all_reduce(found, world, op="max"))
