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

OneFlow's scalers (OneFlow-only names, so OneFlow's signatures): :class:`StaticGradScaler`
``(scale_factor)`` and :class:`DynamicGradScaler` ``(init_scale, growth_factor,
backoff_factor, growth_interval)``. In OneFlow they only configure an ``nn.Graph``
(``graph.set_grad_scaler``); here they are :class:`GradScaler` s, so they also work eagerly
with ``scale(loss).backward()``, ``step(opt)``, ``update()``. ``GradScaler`` itself keeps
PyTorch's signature (``GradScaler(device, init_scale, ...)``), where OneFlow's
``oneflow.amp.GradScaler(init_scale, ...)`` has no device: OneFlow code that calls it
positionally should use :class:`DynamicGradScaler`.
"""

from __future__ import annotations

import numbers

import torch

from .distributed import _comm, ensure_groups, get_world_size
from .tensor import Tensor

__all__ = ["autocast", "DynamicGradScaler", "GradScaler", "StaticGradScaler"]

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
        load = getattr(optimizer, "load_grads", None)
        if load is not None:
            load()  # ZeRO master shards see their gradients
        super().unscale_(optimizer)
        if get_world_size() > 1:
            world = tuple(range(get_world_size()))
            ensure_groups([world])
            state = self._per_optimizer_states[id(optimizer)]
            for found in state["found_inf_per_device"].values():
                found.copy_(_comm.all_reduce(found, world, op="max"))


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _positive(name: str, value, *, above_one: bool = False, below_one: bool = False):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0 and (
        not above_one or value > 1) and (not below_one or value < 1)
    if not ok:
        want = "> 1" if above_one else "in (0, 1)" if below_one else "> 0"
        raise ValueError(f"{name} must be a number {want}, got {value!r}")
    return float(value)


class DynamicGradScaler(GradScaler):
    """OneFlow's dynamic loss scaler: ``DynamicGradScaler(init_scale=2**16,
    growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)``.

    The scale starts at ``init_scale``; a step whose gradients hold inf/nan (on any rank)
    is skipped and multiplies the scale by ``backoff_factor``; ``growth_interval`` clean
    steps in a row multiply it by ``growth_factor`` (torch's ``GradScaler`` rule, which
    this is). ``device`` (keyword): where the scale lives, default ``"cuda"`` when CUDA is
    available, else ``"cpu"``.

    Differences from OneFlow: OneFlow's graph-only scaler requires ``backoff_factor ==
    1 / growth_factor``; any ``backoff_factor`` in (0, 1) works here. It also works eagerly
    (``scale``/``step``/``update``, as :class:`GradScaler`).

    Raises:
        ValueError: ``init_scale <= 0``, ``growth_factor <= 1``, ``backoff_factor`` not in
            (0, 1), ``growth_interval`` not a positive int (names the value).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, *,
                 device: str | None = None, enabled: bool = True):
        init_scale = _positive("DynamicGradScaler: init_scale", init_scale)
        growth_factor = _positive("DynamicGradScaler: growth_factor", growth_factor,
                                  above_one=True)
        backoff_factor = _positive("DynamicGradScaler: backoff_factor", backoff_factor,
                                   below_one=True)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral) \
                or growth_interval < 1:
            raise ValueError(f"DynamicGradScaler: growth_interval must be a positive int (steps), "
                             f"got {growth_interval!r}")
        super().__init__(device or _default_device(), init_scale=init_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=int(growth_interval), enabled=enabled)


class StaticGradScaler(GradScaler):
    """OneFlow's static loss scaler: ``StaticGradScaler(scale_factor)``; the loss is
    multiplied by ``scale_factor`` and the gradients divided by it, and the scale never
    changes. As with every :class:`GradScaler`, a step whose gradients hold inf/nan (on
    any rank) is skipped. ``device`` (keyword) as :class:`DynamicGradScaler`.

    Differences from OneFlow: OneFlow uses it only to configure an ``nn.Graph``; here it
    also works eagerly (``scale``/``step``/``update``). ``update(new_scale)`` raises: the
    scale of a static scaler is fixed.

    Raises:
        ValueError: ``scale_factor <= 0`` (names the value).
    """

    def __init__(self, scale_factor: float, *, device: str | None = None,
                 enabled: bool = True):
        self._scale_factor = _positive("StaticGradScaler: scale_factor", scale_factor)
        super().__init__(device or _default_device(), init_scale=self._scale_factor,
                         enabled=enabled)

    @property
    def scale_factor(self) -> float:
        """The fixed loss scale."""
        return self._scale_factor

    def update(self, new_scale=None) -> None:
        """End the iteration (ready for the next ``unscale_``/``step``); the scale stays
        ``scale_factor``.

        Raises:
            TypeError: ``new_scale`` given (a static scaler's scale is fixed).
        """
        if new_scale is not None:
            raise TypeError(f"StaticGradScaler.update(new_scale={new_scale!r}): the scale is "
                            f"fixed at {self._scale_factor}; use DynamicGradScaler or "
                            f"GradScaler for a scale that changes")
        if self._enabled:
            super().update(new_scale=self._scale_factor)
