"""Scans along a dim: ``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``logcumsumexp``,
``diff``.

SBP (one mesh axis): a dim other than ``dim`` keeps its split. ``cumsum`` keeps a split
``dim`` split too: each shard adds to its local cumsum the exclusive prefix of the earlier
shards' totals (an all-gather of output-sized totals, never of the input), and P stays P
(it is linear). ``cumprod``/``cummax``/``cummin``/``logcumsumexp`` box a split ``dim``
away (the chooser's cheapest: an all-to-all to another dim, or a gather) and a P input
to B. ``diff`` is composed of ``cat`` and slices.
"""

from __future__ import annotations

import math

import torch

from ..boxing.steps import HALF
from ..sbp import Split, broadcast, partial_sum
from .algorithms import gather_axis
from .api import method
from .args import norm_dim
from .chooser import axis_collectives_cost, split_axes
from .dispatch import dispatch, inplace_by_copy
from .registry import register, register_algorithm
from .rules import keep
from .view import cat

S, B, P = Split, broadcast, partial_sum


# ----------------------------------------------------------------------------- cumsum
def _prefix_pass(t: torch.Tensor, pl, axes, suffix: bool) -> torch.Tensor:
    """For each rank, the sum of ``t`` over the shards *before* it (``suffix``: after it)
    in the global order of a dim split over mesh ``axes`` (mesh axis 0 outermost): one
    all-gather of ``t``-sized totals per axis, innermost axis first."""
    coord = pl.coord()
    acc = torch.zeros_like(t)
    for a in reversed(axes):
        g = gather_axis(t, pl, a)
        me = coord[a]
        acc = acc + (g[me + 1:] if suffix else g[:me]).sum(0)
        t = g.sum(0)
    return acc


class _ExclusivePrefix(torch.autograd.Function):
    """The offset of each shard's local cumsum: the sum of the earlier shards' totals. It
    is linear; its adjoint gives each shard the sum of the later shards' gradients."""

    @staticmethod
    def forward(ctx, total, pl, axes):
        ctx.meta = (pl, axes)
        return _prefix_pass(total, pl, axes, suffix=False)

    @staticmethod
    def backward(ctx, g):
        pl, axes = ctx.meta
        return _prefix_pass(g.contiguous(), pl, axes, suffix=True), None, None


def _cumsum_rule(metas, attrs):
    """Every split stays (a split ``dim`` through the exclusive prefix of the earlier
    shards' totals); P stays P (cumsum is linear)."""
    return keep(metas[0].ndim, ())


def _cumsum_kernel(a, *, dim, dtype):
    return torch.cumsum(a, dim, dtype=dtype)


def _cumsum_cost(metas, attrs, ins, out, pl):
    (m,) = metas
    axes = split_axes(ins[0], (attrs["dim"],), pl)
    itemsize = 4 if m.dtype in HALF else m.dtype.itemsize  # half types: in float32
    total = math.prod(n for d, n in enumerate(m.shape) if d != attrs["dim"]) * itemsize
    return axis_collectives_cost(pl, total, len(axes))


@register_algorithm("cumsum", kernel=_cumsum_kernel, rule=_cumsum_rule, cost=_cumsum_cost)
def _cumsum_algorithm(call, local, *, dim, dtype):
    """A local cumsum; along a split ``dim`` plus the sum of the earlier shards' totals
    (an all-gather of output-sized totals per mesh axis splitting ``dim``). A half result
    is accumulated in float32 and rounded once, as torch's kernel: a prefix in fp16 is inf
    once the earlier shards' total passes 65504, and inf + -inf is NaN."""
    axes = call.axes(0, (dim,))
    if not axes:
        return torch.cumsum(local, dim, dtype=dtype)
    want = call.meta_out.dtype
    src = local if dtype is None else local.to(dtype)  # torch casts first
    acc = torch.float32 if want in HALF else want
    out = torch.cumsum(src, dim, dtype=acc)
    total = src.sum(dim, keepdim=True, dtype=acc)
    return (out + _ExclusivePrefix.apply(total, call.placement, axes)).to(want)


def _cumsum(self, dim, *, dtype=None):
    """``torch.cumsum`` along ``dim`` (``dtype`` casts the input first; integer and bool
    inputs give int64 as torch).

    SBP: the output keeps the input's layout. Along a split ``dim`` each shard adds to its
    local cumsum the sum of the earlier shards' totals (an all-gather of the output-sized
    totals per mesh axis splitting ``dim``, not of the input); backward does the same with
    the later shards' gradient totals. P stays P (cumsum is linear). fp16/bf16 along a
    split ``dim``: accumulated in float32 (the totals exchanged in float32) and rounded
    once, as torch's kernel.

    Raises:
        TypeError: ``dim`` not an int. ValueError: ``dim`` out of range.
    """
    return dispatch("cumsum", self, dim=norm_dim(dim, self.ndim, "cumsum: dim"), dtype=dtype)


def _along_rule(metas, attrs):
    """An op along ``dim`` that keeps the shape: other dims keep their split; no P."""
    return keep(metas[0].ndim, (attrs["dim"],), linear=False)


register("cumprod", _along_rule)(lambda a, *, dim, dtype: torch.cumprod(a, dim, dtype=dtype))
register("logcumsumexp", _along_rule)(lambda a, *, dim: torch.logcumsumexp(a, dim))
register("cummax", _along_rule)(lambda a, *, dim: tuple(torch.cummax(a, dim)))
register("cummin", _along_rule)(lambda a, *, dim: tuple(torch.cummin(a, dim)))


def _cumprod(self, dim, *, dtype=None):
    """``torch.cumprod`` along ``dim`` (``dtype`` casts first; ints give int64). Gradient
    torch's (exact with zeros). SBP: other dims keep their split; a split ``dim`` and ``P``
    are boxed away (the cheapest: all-to-all to another dim, or a gather)."""
    return dispatch("cumprod", self, dim=norm_dim(dim, self.ndim), dtype=dtype)


def _logcumsumexp(self, dim):
    """``torch.logcumsumexp`` along ``dim``; SBP as :meth:`cumprod`."""
    return dispatch("logcumsumexp", self, dim=norm_dim(dim, self.ndim))


def _cum_extremum(kind: str):
    ret = torch.return_types.cummax if kind == "cummax" else torch.return_types.cummin

    def method(self, dim):
        dim = norm_dim(dim, self.ndim)
        return ret(dispatch(kind, self, dim=dim))

    method.__name__ = kind
    method.__doc__ = (f"``torch.{kind}`` along ``dim``: ``(values, indices)`` (int64, the "
                      f"last position of the running extremum, as torch). SBP as "
                      f":meth:`cumprod`.")
    return method


def _diff(self, n: int = 1, dim: int = -1, prepend=None, append=None):
    """``torch.diff``: the ``n``-th forward difference along ``dim`` (``prepend``/
    ``append`` joined first; bool: ``!=``). SBP: composed of ``cat`` and slices, so
    ``dim`` is gathered and the other dims keep their split; ``P`` passes.

    Raises:
        ValueError: negative ``n``."""
    if n < 0:
        raise ValueError(f"diff: order n must be non-negative, got {n}")
    dim = norm_dim(dim, self.ndim)
    parts = [p for p in (prepend, self, append) if p is not None]
    x = cat(parts, dim) if len(parts) > 1 else self
    for _ in range(n):
        if x.shape[dim] == 0:
            break
        hi = x.narrow(dim, 1, x.shape[dim] - 1)
        lo = x.narrow(dim, 0, x.shape[dim] - 1)
        x = hi != lo if x.dtype == torch.bool else hi - lo
    return x


# ---------------------------------------------------------------- Tensor methods
method("cumsum")(_cumsum)
method("cumprod")(_cumprod)
method("logcumsumexp")(_logcumsumexp)
method("cummax")(_cum_extremum("cummax"))
method("cummin")(_cum_extremum("cummin"))
method("diff")(_diff)
for _name in ("cumsum", "cumprod"):
    method(f"{_name}_")(inplace_by_copy(_name))

