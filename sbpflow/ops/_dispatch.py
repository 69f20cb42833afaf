"""Eager dispatch of a registered op on local or global sbpflow tensors.

Local inputs: the kernel runs on the wrapped torch tensors. Global inputs: they must
share one placement; the chooser picks an nd signature (cached), the inputs are boxed to
it (differentiable), the kernel runs on the local shards, and the output takes the
signature's nd-SBP and the global shape that the kernel gives on ``meta`` tensors.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..sbp import format_nd_sbp
from ..tensor import Tensor
from ._registry import Meta, choose_signature, get_op, infer_meta

__all__ = ["apply"]


@lru_cache(maxsize=8192)
def _local_shape(shape, pl, nd_sbp) -> torch.Size:
    return torch.Size(pl.shard_shape(shape, nd_sbp))


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def apply(name: str, *inputs: Tensor, **attrs) -> Tensor:
    """Run op ``name`` on sbpflow tensors ``inputs`` with non-tensor ``attrs``.

    Raises:
        TypeError: an input is not an sbpflow Tensor, or local and global inputs are mixed.
        ValueError: global inputs on different placements, or shapes/dtypes the op rejects
            (torch's message on the global shapes, plus the shapes and layouts).
    """
    op = get_op(name)
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: input {i} is a {type(t).__name__}, expected an "
                            f"sbpflow.Tensor (wrap torch tensors with sbpflow.from_torch)")
    if all(t.is_local for t in inputs):
        return Tensor(op.kernel(*(t._local for t in inputs), **attrs))
    if any(t.is_local for t in inputs):
        kinds = ", ".join("global" if t.is_global else "local" for t in inputs)
        raise TypeError(
            f"{name}: inputs mix local and global tensors ({kinds}); convert the local ones "
            f"with x.to_global(placement, sbp) (or the global ones with .to_local())")
    pl = inputs[0].placement
    for t in inputs[1:]:
        if t.placement != pl:
            raise ValueError(f"{name}: inputs live on different placements, {pl!r} and "
                             f"{t.placement!r}; move one with x.to_global(placement=...)")
    attrs = {k: _hashable(v) for k, v in attrs.items()}
    attrs_key = tuple(sorted(attrs.items()))
    metas = tuple(Meta(tuple(t.shape), t.dtype) for t in inputs)
    try:
        meta_out = infer_meta(op, attrs_key, metas)
    except RuntimeError as e:  # torch's message, with the global shapes and layouts
        raise ValueError(
            f"{name}: invalid inputs of global shapes "
            f"{', '.join(str(tuple(m.shape)) for m in metas)} laid out "
            f"{', '.join(format_nd_sbp(t.sbp) for t in inputs)} ({e})") from None
    ins, out_sbp = choose_signature(op, attrs_key, metas, tuple(t.sbp for t in inputs), pl)
    locals_ = [t._local if t.sbp == s else t.to_global(pl, s)._local for t, s in zip(inputs, ins)]
    if pl.coord() is not None:
        out = op.kernel(*locals_, **attrs)
        want = _local_shape(meta_out.shape, pl, out_sbp)
        if out.shape != want:  # a wrong rule must fail loudly, never give wrong shards
            raise RuntimeError(
                f"internal: {name} signature {[format_nd_sbp(s) for s in ins]} -> "
                f"{format_nd_sbp(out_sbp)} gave a local shape {tuple(out.shape)}, expected "
                f"{tuple(want)} for the global shape {meta_out.shape}")
    else:
        # Outside the placement: an empty shard, still connected to the inputs' graph so
        # that this rank's backward reaches the same boxing steps as the members'.
        out = torch.empty((0,) * max(len(meta_out.shape), 1), dtype=meta_out.dtype,
                          device=locals_[0].device)
        for x in locals_:
            if x.requires_grad and out.is_floating_point():
                out = out + x.reshape(-1)[:0].sum().to(out.dtype)
    return Tensor(out, pl, out_sbp, meta_out.shape)
