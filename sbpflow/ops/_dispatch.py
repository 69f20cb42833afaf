"""Eager dispatch of a registered op on local or global sbpflow tensors.

Local inputs: the kernel runs on the wrapped torch tensors. Global inputs: they must
share one placement; the chooser picks an nd signature (cached), the inputs are boxed to
it (differentiable), the kernel runs on the local shards, and the output takes the
signature's nd-SBP and the global shape that the kernel gives on ``meta`` tensors.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..sbp import format_nd_sbp
from ..tensor import Tensor
from ._registry import Meta, choose_signature, get_op, infer_meta

__all__ = ["apply", "check_writable", "coerce_operand", "mark_view_copies"]

# Methods that return a view in torch (an in-place write through the result changes the
# input). On a global tensor whose layout needs a gather first, sbpflow's result is a copy.
VIEW_METHODS = frozenset({
    "__getitem__", "view", "view_as", "transpose", "swapaxes", "permute", "t", "narrow",
    "select", "squeeze", "unsqueeze", "expand", "expand_as", "unflatten", "split", "chunk",
    "unbind", "movedim", "diagonal"})


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr() if t.numel() else None


def mark_view_copies(name: str, x, out):
    """Mark the results of view method ``name`` of global ``x`` that are copies (their local
    shard does not share ``x``'s storage), so in-place writes into them raise instead of
    silently not reaching ``x``. Returns ``out``."""
    if not isinstance(x, Tensor) or not x.is_global:
        return out
    base = _storage(x._local)
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, Tensor) and o.is_global and base is not None and \
                _storage(o._local) not in (None, base):
            o._local._sbpflow_copy_of = name
    return out


def coerce_operand(self: Tensor, other):
    """A ``torch.Tensor`` or numpy array operand of an operator: a local sbpflow tensor
    when ``self`` is local (torch converts them the same way).

    Raises:
        TypeError: with a global ``self`` (the array's layout is unknown), naming the fix.
    """
    if isinstance(other, (torch.Tensor, np.ndarray)):
        if self.is_global:
            raise TypeError(f"an operator between a global sbpflow tensor and a "
                            f"{type(other).__module__}.{type(other).__name__}: the array's "
                            f"layout is unknown; make it global first, e.g. sbpflow.tensor("
                            f"a, placement=x.placement, sbp=...) (the same value on every rank)")
        return Tensor(torch.as_tensor(other))
    return other


def check_writable(x: Tensor, name: str) -> None:
    """Raise if ``x`` is a copy made by a view method (see :func:`mark_view_copies`).

    Raises:
        ValueError: names the view method and the fixes.
    """
    src = getattr(x._local, "_sbpflow_copy_of", None)
    if src is not None:
        raise ValueError(
            f"{name}: this tensor came from {src}() of a global tensor whose layout ("
            f"the indexed or viewed dim was split) needed a gather, so it is a copy, not a "
            f"view: writing into it would not change the original as in torch. Write into the "
            f"original with x[...] = value, or call .clone() first if a copy is what you want")


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
