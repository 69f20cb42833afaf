"""``sbpflow.nn.utils``: gradient clipping over local, sharded and replicated gradients.

The norm is the norm of the *global* gradients, as on one device: a split gradient
contributes each shard once, a replicated (B) one once (from mesh coordinate 0 of each B
axis), so one all-reduce over the world gives every rank the same total. Every rank of
the world calls these functions when any gradient is global.
"""

from __future__ import annotations

import math

import torch

from ..distributed import _comm, ensure_groups, get_world_size
from ..sbp import broadcast
from ..tensor import Tensor

__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm"]


def _grads(parameters) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    out = []
    for p in parameters:
        if not isinstance(p, Tensor):
            raise TypeError(f"expected sbpflow Tensors (e.g. model.parameters()), got "
                            f"{type(p).__name__}")
        g = p.grad
        if g is not None:
            if g.is_global and any(s.is_partial() for s in g.sbp):
                g = g.to_global(sbp=tuple(broadcast if s.is_partial() else s for s in g.sbp))
            out.append(g)
    return out


def _owns(g: Tensor) -> bool:
    """Does this rank's shard count toward the global norm (once per replica)?"""
    if g.is_local:
        return True
    coord = g.placement.coord()
    return coord is not None and all(c == 0 for c, s in zip(coord, g.sbp) if s.is_broadcast())


def get_total_norm(grads, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """The ``norm_type``-norm of all ``grads`` taken together (``torch.nn.utils.
    get_total_norm``); a 0-d float32 torch tensor, equal on every rank.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
    """
    grads = [g for g in grads if g is not None]
    p = float(norm_type)
    dev = grads[0]._local.device if grads else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float32, device=dev)
    for g in grads:
        if not _owns(g) or g._local.numel() == 0:
            continue
        x = g._local.detach().float().abs()
        if math.isinf(p):
            acc = torch.maximum(acc, x.amax() if p > 0 else x.amin())
        elif p == 0:
            acc = acc + (x != 0).sum()
        else:
            acc = acc + x.pow(p).sum()
    if any(g.is_global for g in grads) and get_world_size() > 1:
        world = tuple(range(get_world_size()))
        ensure_groups([world])
        acc = _comm.all_reduce(acc, world, op="max" if math.isinf(p) else "sum")
    total = acc if math.isinf(p) or p == 0 else acc.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")
    return total


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``: coefficient ``max_norm / (norm + 1e-6)`` clamped to
    1). Returns the total norm before clipping (a 0-d torch tensor, the same on every rank).
    """
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    total = get_total_norm(_grads(parameters), norm_type, error_if_nonfinite)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                g = p.grad
                g._local.mul_(coef.to(g._local.device, g.dtype))
    return total


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` in place (elementwise:
    no communication)."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p.grad._local.clamp_(-clip_value, clip_value)
