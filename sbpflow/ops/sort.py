"""Order: ``sort``, ``argsort``, ``topk``, the order statistics (``median``,
``nanmedian``, ``kthvalue``, ``mode``, ``quantile``, ``nanquantile``), ``searchsorted``
and ``bucketize``.

SBP (one mesh axis): the sorted or selected dim must be whole (a split one is gathered,
a P input summed first), other dims keep their split (renumbered where ``dim`` goes),
except ``topk`` over a split dim: each rank takes its shard's top k and only the k
candidates per shard (values and global indices) are all-gathered, then reduced; its
outputs are B on those axes. ``searchsorted``: a 1-D sorted sequence is B and the values
keep their split; an N-D sequence and the values split together on leading dims.
"""

from __future__ import annotations

import math

import torch

from ..distributed import all_gather, all_reduce
from ..placement import shard_shape as _shard_shape
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .api import function, method
from .args import check_global_pair, norm_dim, number
from .chooser import axis_collectives_cost, split_axes
from .creation import tensor
from .dispatch import dispatch
from .registry import register, register_algorithm
from .rules import keep, reduced_dim

S, B, P = Split, broadcast, partial_sum


@register("sort", lambda metas, attrs: keep(metas[0].ndim, (attrs["dim"],), linear=False))
def _sort_kernel(a, *, dim, descending, stable):
    return tuple(torch.sort(a, dim=dim, descending=descending, stable=stable))


def sort(self: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """``torch.sort``: ``(values, indices)`` along ``dim``. SBP: ``dim`` whole (a split
    ``dim`` is boxed away) and P summed first; other dims keep their splits."""
    return torch.return_types.sort(dispatch("sort", self, dim=norm_dim(dim, self.ndim),
                                            descending=bool(descending), stable=bool(stable)))


class _SplitTopK(torch.autograd.Function):
    """topk along a dim split over ``axes``: local top k of each shard with global indices,
    then per axis (innermost first) an all-gather of the candidates and a top k of them.
    Backward: the values' gradient (P on those axes, as the output is B there) is summed
    over them and scattered into the shard positions that won."""

    @staticmethod
    def forward(ctx, x, k, dim, largest, pl, nd, shape, axes):
        coord = pl.coord()
        lo = pl.shard_slices(shape, nd)[dim].start
        v, i = torch.topk(x, min(k, x.shape[dim]), dim, largest, sorted=True)
        i = i + lo
        done: set[int] = set()
        for a in reversed(axes):
            members = pl.axis_ranks(a, coord)
            held = tuple(B if b in done else s for b, s in enumerate(nd))
            sizes = [min(k, _shard_shape(shape, pl.shape, held, pl.coord(r))[dim])
                     for r in members]
            v = all_gather(v, members, dim, sizes, axis=a)
            i = all_gather(i, members, dim, sizes, axis=a)
            done.add(a)
            v, sel = torch.topk(v, min(k, v.shape[dim]), dim, largest, sorted=True)
            i = torch.gather(i, dim, sel)
        ctx.save_for_backward(i)
        ctx.meta = (dim, lo, tuple(x.shape), pl, axes)
        ctx.mark_non_differentiable(i)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        (i,) = ctx.saved_tensors
        dim, lo, local_shape, pl, axes = ctx.meta
        coord = pl.coord()
        for a in axes:
            gv = all_reduce(gv, pl.axis_ranks(a, coord), axis=a)
        gx = gv.new_zeros(local_shape)
        n = local_shape[dim]
        if n:
            pos = i - lo
            inside = (pos >= 0) & (pos < n)
            gx.scatter_add_(dim, pos.clamp(0, n - 1), gv * inside)
        return gx, None, None, None, None, None, None, None


def _topk_rule(metas, attrs):
    """Other dims keep their split; a split ``dim`` gives B (per-shard candidates, then an
    all-gather of k per shard); no P (the top of a sum is not the sum of tops)."""
    (m,) = metas
    return [(S(d), S(d) if d != attrs["dim"] else B) for d in range(m.ndim)]


def _topk_cost(metas, attrs, ins, out, pl):
    (m,) = metas
    axes = split_axes(ins[0], (attrs["dim"],), pl)
    rows = math.prod(n for d, n in enumerate(m.shape) if d != attrs["dim"])
    nbytes = sum(rows * attrs["k"] * pl.shape[a] * (m.dtype.itemsize + 8) for a in axes)
    return axis_collectives_cost(pl, nbytes // max(len(axes), 1), 2 * len(axes))


def _topk_kernel(a, *, k, dim, largest, sorted):  # noqa: A002 - torch's name
    return tuple(torch.topk(a, k, dim, largest, sorted))


@register_algorithm("topk", kernel=_topk_kernel, rule=_topk_rule, cost=_topk_cost)
def _topk_algorithm(call, x, *, k, dim, largest, sorted):  # noqa: A002
    axes = call.axes(0, (dim,))
    if not axes:
        return tuple(torch.topk(x, k, dim, largest, sorted=True))
    return _SplitTopK.apply(x, k, dim, largest, call.placement, call.ins[0],
                            call.metas[0].shape, axes)


def topk(self: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """``torch.topk``: the ``k`` largest (``largest=False``: smallest) along ``dim`` as
    ``(values, indices)``, int64 indices into the global dim.

    SBP: P is summed first (B); other dims keep their splits; over a split ``dim`` each
    rank takes its shard's top k and only the k candidates per shard are all-gathered (not
    the input); the outputs are then B on those axes. Global results are always sorted.

    Raises ``ValueError`` when ``k`` exceeds the dim's size.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"topk(): k must be an int, got {k!r}")
    dim = norm_dim(dim, self.ndim)
    n = self.shape[dim] if self.ndim else 1
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is out of range for dim {dim} of size {n}")
    return torch.return_types.topk(dispatch("topk", self, k=int(k), dim=dim,
                                            largest=bool(largest), sorted=bool(sorted)))


def _argsort(self, dim: int = -1, descending: bool = False, stable: bool = False):
    return self.sort(dim=dim, descending=descending, stable=stable).indices


def _select_rule(metas, attrs):
    """median/kthvalue/mode/quantile over ``dim``: other dims keep their split."""
    (m,) = metas
    dim = attrs.get("dim")
    if dim is None:
        return []
    lead = 1 if isinstance(attrs.get("q"), tuple) else 0
    return keep(m.ndim, (dim,), reduced_dim(dim, attrs.get("keepdim", False), lead),
                 linear=False)


register("median_all", None)(lambda a, *, nan: (torch.nanmedian if nan else torch.median)(a))
register("median_dim", _select_rule)(
    lambda a, *, dim, keepdim, nan:
    tuple((torch.nanmedian if nan else torch.median)(a, dim, keepdim)))
register("kthvalue", _select_rule)(
    lambda a, *, k, dim, keepdim: tuple(torch.kthvalue(a, k, dim, keepdim)))
register("mode", _select_rule)(lambda a, *, dim, keepdim: tuple(torch.mode(a, dim, keepdim)))


@register("quantile", _select_rule)
def _quantile_kernel(a, *, q, dim, keepdim, interpolation, nan):
    if isinstance(q, tuple):
        q = torch.tensor(q, dtype=a.dtype, device=a.device)
    fn = torch.nanquantile if nan else torch.quantile
    return fn(a, q, dim, keepdim, interpolation=interpolation)


def _pair(ret, op: str, x: Tensor, **attrs):
    return ret(dispatch(op, x, **attrs))


def _median_method(nan: bool):
    name = "nanmedian" if nan else "median"
    ret = torch.return_types.nanmedian if nan else torch.return_types.median

    def method(self, dim=None, keepdim: bool = False):
        if dim is None:
            return dispatch("median_all", self, nan=nan)
        return _pair(ret, "median_dim", self, dim=norm_dim(dim, self.ndim), keepdim=keepdim,
                     nan=nan)

    method.__name__ = name
    method.__doc__ = f"""``torch.{name}``: the lower median (of an even count, the smaller
    of the two middle values, as torch){' ignoring NaN' if nan else ' (NaN propagates)'}.
    Without ``dim``: of every element (0-dim; x is boxed to B). With ``dim``:
    ``(values, indices)``; other dims keep their split, a split ``dim`` is boxed. Gradient
    to the selected element (torch's rule)."""
    return method


def _kthvalue(self, k: int, dim: int = -1, keepdim: bool = False):
    """``torch.kthvalue``: ``(values, indices)`` of the ``k``-th smallest along ``dim``.
    SBP: other dims keep their split; a split ``dim`` is boxed.

    Raises:
        ValueError: ``k`` outside ``[1, size of dim]``."""
    dim = norm_dim(dim, self.ndim)
    n = self.shape[dim] if self.ndim else 1
    if not 1 <= k <= n:
        raise ValueError(f"kthvalue: k={k} is out of range for dim {dim} of size {n} "
                         f"(expected 1 <= k <= {n})")
    return _pair(torch.return_types.kthvalue, "kthvalue", self, k=int(k), dim=dim,
                 keepdim=keepdim)


def _mode(self, dim: int = -1, keepdim: bool = False):
    """``torch.mode``: ``(values, indices)`` of the most frequent value along ``dim``
    (ties: the smallest value). SBP as :meth:`kthvalue`."""
    return _pair(torch.return_types.mode, "mode", self, dim=norm_dim(dim, self.ndim),
                 keepdim=keepdim)


_INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


def _quantile_method(nan: bool):
    name = "nanquantile" if nan else "quantile"

    def method(self, q, dim=None, keepdim: bool = False, *, interpolation: str = "linear"):
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"{name}: interpolation must be one of {_INTERPOLATIONS}, got "
                             f"{interpolation!r}")
        if isinstance(q, (Tensor, torch.Tensor)):
            if q.ndim > 1:
                raise ValueError(f"{name}: q must be a number or a 0-/1-D tensor, got shape "
                                 f"{tuple(q.shape)}")
            qv = q.tolist()
            q = tuple(float(v) for v in qv) if isinstance(qv, list) else float(qv)
        elif isinstance(q, (list, tuple)):
            q = tuple(float(v) for v in q)
        else:
            q = float(number(name, "q", q))
        for v in q if isinstance(q, tuple) else (q,):
            if not 0 <= v <= 1:
                raise ValueError(f"{name}: q values must be in [0, 1], got {v}")
        if dim is not None:
            dim = norm_dim(dim, self.ndim)
        return dispatch("quantile", self, q=q, dim=dim, keepdim=keepdim,
                     interpolation=interpolation, nan=nan)

    method.__name__ = name
    method.__doc__ = f"""``torch.{name}``: the ``q``-quantiles (a number, or a 1-D tensor:
    a new leading dim) over ``dim`` (None: the flattened tensor), with ``interpolation``
    linear (default), lower, higher, midpoint or nearest{'; NaN ignored' if nan else ''}.
    SBP: other dims keep their split; a split ``dim`` (or ``dim=None``) is boxed.

    Raises:
        ValueError: ``q`` outside [0, 1]; an unknown interpolation."""
    return method


def _search_rule(metas, attrs):
    seq, v = metas
    if seq.ndim == 1:
        return [(B, S(d), S(d)) for d in range(v.ndim)]
    return [(S(d), S(d), S(d)) for d in range(seq.ndim - 1)]


register("searchsorted", _search_rule)(
    lambda s, v, *, right, out_int32: torch.searchsorted(s, v, right=right, out_int32=out_int32))


def searchsorted(sorted_sequence: Tensor, input, *, out_int32: bool = False,  # noqa: A002
                 right: bool = False, side=None, sorter=None) -> Tensor:
    """``torch.searchsorted``: for each value, the index in the last dim of
    ``sorted_sequence`` where it would be inserted (``right``/``side='right'``: after
    equal ones). A number ``input`` gives a 0-dim result. SBP: a 1-D sequence is ``B`` and
    the values keep their split; an N-D sequence and the values split together on leading
    dims. int64 (``out_int32``: int32); not differentiable.

    Raises:
        ValueError: ``side`` and ``right`` disagree; TypeError: ``sorter`` (unsupported:
        sort the sequence first)."""
    if sorter is not None:
        raise TypeError("searchsorted: sorter= is not supported; pass the sorted sequence "
                        "(sorted_sequence.sort().values)")
    if side is not None:
        if side not in ("left", "right") or (right and side == "left"):
            raise ValueError(f"searchsorted: side must be 'left' or 'right' (consistent with "
                             f"right={right}), got {side!r}")
        right = side == "right"
    if not isinstance(input, Tensor):
        value = torch.as_tensor(input, dtype=sorted_sequence.dtype)
        if sorted_sequence.is_global:
            input = tensor(value, placement=sorted_sequence.placement,
                           sbp=(B,) * sorted_sequence.placement.ndim)
        else:
            input = Tensor(value)
    check_global_pair("searchsorted", sorted_sequence, input)
    return dispatch("searchsorted", sorted_sequence, input, right=bool(right),
                 out_int32=bool(out_int32))


def bucketize(input: Tensor, boundaries: Tensor, *, out_int32: bool = False,  # noqa: A002
              right: bool = False) -> Tensor:
    """``torch.bucketize``: the bucket index of each value of ``input`` among the 1-D
    sorted ``boundaries`` (``searchsorted(boundaries, input)``). SBP: the input keeps its
    split, boundaries ``B``.

    Raises:
        ValueError: ``boundaries`` not 1-D."""
    if boundaries.ndim != 1:
        raise ValueError(f"bucketize: boundaries must be 1-D, got shape "
                         f"{tuple(boundaries.shape)}")
    return searchsorted(boundaries, input, out_int32=out_int32, right=right)


# ---------------------------------------------------------------- Tensor methods and functions
method("sort")(sort)
method("argsort")(_argsort)
method("topk")(topk)
method("median")(_median_method(False))
method("nanmedian")(_median_method(True))
method("kthvalue")(_kthvalue)
method("mode")(_mode)
method("quantile")(_quantile_method(False))
method("nanquantile")(_quantile_method(True))
function("searchsorted")(searchsorted)
function("bucketize")(bucketize)

