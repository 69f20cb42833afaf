"""Explicit collectives on local tensors, for users who want them (issue 3, item 6).

Each takes a local ``sbpflow.Tensor`` (or ``torch.Tensor``) and returns a new local
``sbpflow.Tensor``; the input is never modified. ``ranks`` is the group, in the order
results are laid out (default: the whole world). Like everything in sbpflow, these are
SPMD calls: **every rank of the world calls them** with the same ``ranks`` (process
groups are made collectively); a rank outside ``ranks`` gets its input back unchanged.
They run through the same wrappers as boxing: recorded by
:class:`sbpflow.distributed.CommRecorder`, checked in debug mode, and bounded by the
collective timeout. Not differentiable (use global tensors and ``to_global`` for that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import distributed as _dist
from .distributed import _comm
from .ops.args import norm_dim
from .tensor import Tensor

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"]


def _local(x) -> torch.Tensor:
    if isinstance(x, Tensor):
        if x.is_global:
            raise TypeError("sbpflow.comm works on local tensors; for a global tensor use "
                            "x.to_global(sbp=...) (boxing) or x.to_local() first")
        return x.to_torch().detach()
    if isinstance(x, torch.Tensor):
        return x.detach()
    raise TypeError(f"expected an sbpflow.Tensor or torch.Tensor, got {type(x).__name__}")


def _group(ranks: Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    world = _dist.get_world_size()
    group = tuple(range(world)) if ranks is None else tuple(int(r) for r in ranks)
    bad = [r for r in group if not 0 <= r < world]
    if bad or len(set(group)) != len(group) or not group:
        raise ValueError(f"ranks {list(group)} must be distinct ranks of the world of {world}")
    _dist.ensure_groups([group])
    return group, _dist.get_rank() in group


def all_reduce(x, ranks: Sequence[int] | None = None) -> Tensor:
    """Sum of ``x`` over ``ranks`` (same shape on every member)."""
    t = _local(x)
    group, member = _group(ranks)
    return Tensor(_comm.all_reduce(t, group) if member else t.clone())


def all_gather(x, ranks: Sequence[int] | None = None, dim: int = 0) -> Tensor:
    """Concatenation along ``dim`` of every member's ``x`` (sizes along ``dim`` may differ;
    they are exchanged first)."""
    t = _local(x)
    group, member = _group(ranks)
    if not member:
        return Tensor(t.clone())
    dim = norm_dim(dim, t.dim())
    sizes = [m[0] for m in _comm.all_gather_meta([t.shape[dim]], group)]
    return Tensor(_comm.all_gather(t, group, dim, sizes))


def reduce_scatter(x, ranks: Sequence[int] | None = None, dim: int = 0) -> Tensor:
    """Sum ``x`` over ``ranks``, then member ``i`` keeps part ``i`` along ``dim`` (parts as
    boxing splits them: the first ``size % n`` one longer)."""
    from .placement import split_sizes

    t = _local(x)
    group, member = _group(ranks)
    if not member:
        return Tensor(t.clone())
    dim = norm_dim(dim, t.dim())
    return Tensor(_comm.reduce_scatter(t, group, dim, split_sizes(t.shape[dim], len(group))))


def broadcast(x, src: int = 0, ranks: Sequence[int] | None = None) -> Tensor:
    """Rank ``src``'s ``x`` on every member (members pass a tensor of the same shape and
    dtype; its values are not read)."""
    t = _local(x)
    group, member = _group(ranks)
    if src not in group:
        raise ValueError(f"broadcast source rank {src} is not in ranks {list(group)}")
    if not member:
        return Tensor(t.clone())
    return Tensor(_comm.broadcast(t.clone(), group, group.index(src)))


def all_to_all(x, ranks: Sequence[int] | None = None, split_dim: int = 0,
               cat_dim: int = 0) -> Tensor:
    """Split ``x`` along ``split_dim`` into one part per member (even split required),
    send part ``i`` to member ``i``, and concatenate what arrives along ``cat_dim``."""
    t = _local(x)
    group, member = _group(ranks)
    if not member:
        return Tensor(t.clone())
    n = len(group)
    if t.shape[split_dim] % n:
        raise ValueError(f"all_to_all: dim {split_dim} of size {t.shape[split_dim]} does not "
                         f"split evenly over {n} ranks")
    part = t.shape[split_dim] // n
    return Tensor(_comm.all_to_all(t, group, split_dim, [part] * n, cat_dim,
                                   [t.shape[cat_dim] if cat_dim != split_dim else part] * n))


def send_recv(sends: Sequence[tuple[object, int]], recvs: Sequence[tuple[object, int]]) -> list:
    """Point-to-point: send each ``(tensor, peer)``, receive into each ``(buffer, peer)``.

    Every rank of the world calls this (with empty lists where it has nothing to do);
    returns the received tensors as local sbpflow tensors, in ``recvs`` order.
    """
    out = [(_local(b).clone(), p) for b, p in recvs]
    _comm.send_recv([(_local(t), p) for t, p in sends], out, "user send_recv")
    return [Tensor(b) for b, _ in out]
