"""More indexing, reduction and shape ops that PyTorch models use: ``repeat_interleave``,
``index_add``/``index_fill``/``index_copy`` (and in place), ``cumprod``/``cummax``/
``cummin``/``logcumsumexp``, ``diag``/``diagonal``/``trace``/``diag_embed``,
``tril_indices``/``triu_indices``, the data-dependent ops (``masked_select``, ``nonzero``,
``argwhere``, ``unique``, ``bincount``, ``count_nonzero``, ``histc``), the order
statistics (``median``, ``nanmedian``, ``kthvalue``, ``mode``, ``quantile``,
``nanquantile``), ``nansum``/``nanmean``, ``std_mean``/``var_mean``, ``aminmax``,
``diff``, ``cross``, ``addmm``/``addmv``/``baddbmm``/``addbmm``, ``cdist``, ``dist``,
``searchsorted``, ``bucketize``.

Every op mirrors the torch function of the same name on local tensors (the kernel is the
torch call). On global tensors, per mesh axis (one small rule per family below):

========================================  ==================================================
op                                        SBP
========================================  ==================================================
repeat_interleave(r, dim)                 other dims keep their split; with an int ``r``
                                          ``S(dim)`` stays ``S(dim)`` (each shard repeats
                                          its own rows: GQA's head repeat of a head-split
                                          tensor runs no collective) where the shards line
                                          up (checked per mesh: ``n`` rows over ``k`` ranks
                                          must split ``n * r`` the same way); ``P`` passes
index_add / index_copy (x, index, src)    a dim other than ``dim`` split in x and src;
                                          ``(P, B, P) -> P``; index_add also
                                          ``(P, S(0), S(dim)) -> P`` (each rank adds its
                                          part, no communication: scatter_add's rule)
index_fill(x, index, value)               a dim other than ``dim`` keeps its split; ``P``
                                          only for ``value == 0``
cumprod, cummax, cummin, logcumsumexp     a dim other than ``dim`` keeps its split; a split
                                          ``dim`` is boxed (the chooser's cheapest: an
                                          all-to-all to another dim, or a gather)
median/kthvalue/mode/quantile(dim)        a dim other than ``dim`` keeps its split
                                          (renumbered); a split ``dim`` and ``P`` are boxed;
                                          without ``dim``: computed on ``B``
diagonal, diag_embed                      the batch dims keep their split; ``P`` passes
diag, trace                               ``P`` passes; trace sums the diagonal (a split
                                          dim gives a ``P`` diagonal sum)
cross(a, b, dim)                          broadcast dims other than ``dim`` split; ``P`` in
                                          one operand (linear in each)
cdist(x1, x2)                             batch dims split in both; the rows of x1 or of x2
searchsorted / bucketize                  the values keep their split (the sorted sequence
                                          ``B``, or split with them on leading dims)
addmm, addmv, baddbmm, addbmm, diff,      composed of matmul/einsum, slicing, sums and
nansum, nanmean, std_mean, var_mean,      elementwise ops: their rules apply (a contracted
aminmax, dist, count_nonzero              split gives ``P``, ...)
========================================  ==================================================

**Data-dependent shapes** (``masked_select``, ``nonzero``, ``argwhere``, ``unique``,
``repeat_interleave`` with a tensor of repeats): on a global tensor the input is boxed to
``B`` (gathered; the repeats become Python ints, a collective) and every rank computes the
whole result, a ``B`` global tensor equal to torch's. ``bincount`` and ``histc`` gather
*counts* instead: the global max (bincount) or min/max (histc with ``min == max``) first
(an all-reduce), then each rank counts its shard into a fixed number of bins (``P`` over
the axes that split the input) and the counts are all-reduced to ``B``. Ranks outside the
placement hold an empty shard (and, for the data-dependent shapes, an empty global shape).
"""

from __future__ import annotations

import itertools
import numbers

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from ._dispatch import apply
from ._extremum import extremum
from ._misc import _inplace, where
from ._registry import register
from ._shape import _dim, _index_arg, _scatter_source
from .creation import _deterministic

__all__ = ["tril_indices", "triu_indices", "std_mean", "var_mean", "cdist", "searchsorted",
           "bucketize"]

S, B, P = Split, broadcast, partial_sum


# ====================================================================== helpers


def _keep(ndim: int, whole, out_of=None, linear: bool = True):
    """One-input signatures: ``S(d) -> S(out_of(d))`` for every dim not in ``whole``
    (``out_of``: the output dim of input dim ``d``; identity by default), plus ``P -> P``
    when ``linear``."""
    out_of = out_of or (lambda d: d)
    sigs = [(P, P)] if linear else []
    return sigs + [(S(d), S(out_of(d))) for d in range(ndim) if d not in whole]


def _reduced_dim(dim: int, keepdim: bool, lead: int = 0):
    """Output dim of input dim ``d`` after reducing ``dim`` (``lead`` new leading dims)."""
    return lambda d: d + lead - (0 if keepdim or d < dim else 1)


def _all_b(x: Tensor) -> Tensor:
    """``x`` boxed to B on every mesh axis (local tensors as they are)."""
    if x.is_local or all(s.is_broadcast() for s in x.sbp):
        return x
    return x.to_global(sbp=(B,) * x.placement.ndim)


def _b_result(local: torch.Tensor, pl) -> Tensor:
    return Tensor(local, pl, (B,) * pl.ndim, tuple(local.shape))


def _check_global_pair(name: str, x: Tensor, other: Tensor) -> None:
    if not isinstance(other, Tensor):
        raise TypeError(f"{name}: expected an sbpflow.Tensor, got {type(other).__name__}")
    if x.is_global != other.is_global:
        raise TypeError(f"{name}: one input is local and the other global; convert the local "
                        f"one with .to_global(placement, sbp) or the global one with .to_local()")


def _number(name: str, what: str, v) -> float:
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name}: {what} must be a number or a 1-element tensor, got "
                             f"shape {tuple(v.shape)}")
        return v.item()
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Number):
        raise TypeError(f"{name}: {what} must be a number, got {v!r}")
    return v


# ====================================================================== repeat_interleave


def _repeat_rule(metas, attrs):
    (m,) = metas
    dim, reps = attrs["dim"], attrs["repeats"]
    whole = () if isinstance(reps, int) else (dim,)
    return _keep(m.ndim, whole)


def _repeat_check(metas, attrs, ins, out, pl) -> bool:
    """An int repeat of a split ``dim``: every shard's rows ``[a, b)`` must become exactly
    the output shard ``[a * r, b * r)`` (true for even splits; 7 rows over 4 ranks are
    2,2,2,1 but 14 are 4,4,3,3: then the chooser boxes)."""
    from ..placement import shard_slices

    (m,) = metas
    dim, r = attrs["dim"], attrs["repeats"]
    if not any(s.is_split() and s.dim == dim for s in ins[0]):
        return True
    out_shape = tuple(n * r if d == dim else n for d, n in enumerate(m.shape))
    for coord in itertools.product(*(range(n) for n in pl.shape)):
        si = shard_slices(m.shape, pl.shape, ins[0], coord)[dim]
        so = shard_slices(out_shape, pl.shape, out, coord)[dim]
        if (si.start * r, si.stop * r) != (so.start, so.stop):
            return False
    return True


@register("repeat_interleave", _repeat_rule, check=_repeat_check)
def _repeat_interleave_kernel(a, *, repeats, dim):
    if isinstance(repeats, int):
        return torch.repeat_interleave(a, repeats, dim)
    reps = torch.tensor(repeats, dtype=torch.int64, device=a.device)
    return torch.repeat_interleave(a, reps, dim, output_size=sum(repeats))


def _repeat_interleave(self, repeats=None, dim=None, *, output_size=None):
    """``torch.repeat_interleave``: each element (``dim=None``: of the flattened tensor) or
    slice along ``dim`` repeated ``repeats`` times; ``repeats`` an int or a 1-D int tensor
    (one count per slice, or one element for all). ``output_size`` (torch's hint) is
    checked against the result's size. ``repeat_interleave(counts)`` alone gives
    ``arange(len(counts))`` repeated by ``counts``.

    SBP: dims other than ``dim`` keep their split. An int ``repeats`` keeps a split ``dim``
    split (each shard repeats its own slices; no communication; e.g. GQA's
    ``k.repeat_interleave(n_rep, dim=1)`` of a head-split ``(B, nkv, T, hs)`` tensor) when
    the shards line up, else ``dim`` is gathered; a tensor ``repeats`` is read on every
    rank (``.tolist()``, a collective for a global tensor) and needs ``dim`` whole. ``P``
    passes.

    Raises:
        ValueError: a negative repeat; ``repeats`` of the wrong length; ``output_size``
            that does not match.
        TypeError: ``repeats`` neither an int nor an int tensor.
    """
    if repeats is None:  # torch.repeat_interleave(counts)
        counts = _all_b(self)
        local = torch.repeat_interleave(counts._local)
        return Tensor(local) if self.is_local else _b_result(local, self.placement)
    x = self
    if dim is None:
        x, dim = self.reshape(-1), 0
    dim = _dim(dim, x.ndim)
    if isinstance(repeats, (Tensor, torch.Tensor)):
        if repeats.dtype.is_floating_point or repeats.dtype == torch.bool or repeats.ndim > 1:
            raise TypeError(f"repeat_interleave: repeats must be an int or a 0-/1-D int tensor, "
                            f"got {repeats.dtype} of shape {tuple(repeats.shape)}")
        reps = repeats.tolist()
        reps = reps[0] if isinstance(reps, list) and len(reps) == 1 else reps
    elif isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
        raise TypeError(f"repeat_interleave: repeats must be an int or an int tensor, got "
                        f"{repeats!r}")
    else:
        reps = int(repeats)
    n = x.shape[dim] if x.ndim else 1
    if isinstance(reps, list):
        if len(reps) != n:
            raise ValueError(f"repeat_interleave: repeats has {len(reps)} counts but dim {dim} "
                             f"has size {n}; give one count per slice")
        if any(r < 0 for r in reps):
            raise ValueError(f"repeat_interleave: repeats must be non-negative, got {reps}")
        reps, total = tuple(int(r) for r in reps), sum(reps)
    else:
        if reps < 0:
            raise ValueError(f"repeat_interleave: repeats must be non-negative, got {reps}")
        total = n * reps
    if output_size is not None and output_size != total:
        raise ValueError(f"repeat_interleave: output_size={output_size} but the repeats give "
                         f"{total} slices along dim {dim}")
    return apply("repeat_interleave", x, repeats=reps, dim=dim)


# ====================================================================== index_add / fill / copy


def _index_src_rule(metas, attrs):
    """index_add / index_copy (x, index, source)."""
    x, idx, src = metas
    dim = attrs["dim"]
    sigs = [(P, B, P, P)]
    sigs += [(S(d), B, S(d), S(d)) for d in range(x.ndim)
             if d != dim and src.ndim == x.ndim and src.shape[d] == x.shape[d]]
    if attrs.get("add") and src.ndim == x.ndim and idx.ndim == 1:
        sigs.append((P, S(0), S(dim), P))
    return sigs


def _index_fill_rule(metas, attrs):
    x, _ = metas
    dim = attrs["dim"]
    sigs = [(P, B, P)] if attrs["value"] == 0 else []
    return sigs + [(S(d), B, S(d)) for d in range(x.ndim) if d != dim]


@register("index_add", _index_src_rule)
def _index_add_kernel(a, i, s, *, dim, alpha, add=True):
    return torch.index_add(a, dim, i, s, alpha=alpha)


register("index_copy", _index_src_rule)(lambda a, i, s, *, dim: torch.index_copy(a, dim, i, s))
register("index_fill", _index_fill_rule)(
    lambda a, i, *, dim, value: torch.index_fill(a, dim, i, value))


def _index_add(self, dim, index, source, *, alpha=1):
    """``torch.index_add``: ``out = x`` with ``alpha * source[k]`` added to slice
    ``index[k]`` of ``dim`` (``index`` 1-D int64, ``source`` of x's shape with
    ``len(index)`` along ``dim``). SBP: other dims split in x and source; ``(P, B, P) ->
    P``; an index and source split along ``dim`` add into a ``P`` output (no comm)."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "index_add")
    source = _index_arg(self, source, "index_add")
    return apply("index_add", self, index, source, dim=dim, alpha=alpha, add=True)


def _index_copy(self, dim, index, source):
    """``torch.index_copy``: slice ``index[k]`` of ``dim`` replaced by ``source[k]``
    (distinct indices, as torch needs for a deterministic result). SBP: other dims split
    in x and source; ``(P, B, P) -> P``."""
    dim = _dim(dim, self.ndim)
    return apply("index_copy", self, _index_arg(self, index, "index_copy"),
                 _index_arg(self, source, "index_copy"), dim=dim)


def _index_fill(self, dim, index, value):
    """``torch.index_fill``: slices ``index`` of ``dim`` set to ``value`` (a number or a
    1-element tensor, read as a number). SBP: other dims keep their split; ``P`` passes
    only for ``value == 0``."""
    dim = _dim(dim, self.ndim)
    value = _number("index_fill", "value", value)
    return apply("index_fill", self, _index_arg(self, index, "index_fill"), dim=dim, value=value)


def _index_add_(self, dim, index, source, *, alpha=1):
    """In place :meth:`index_add` (``torch.Tensor.index_add_``). A global x keeps its
    layout: ``dim`` must not be split (a ValueError says how to box it); a P x takes the
    source's summands."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "index_add_")
    source = _index_arg(self, source, "index_add_")
    return _inplace(self, "index_add_", "index_add", (index, source),
                    {"dim": dim, "alpha": alpha, "add": True},
                    lambda s, i, src: s.index_add_(dim, i, src, alpha=alpha))


def _index_copy_(self, dim, index, source):
    """In place :meth:`index_copy` (layout kept, as :meth:`index_add_`)."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "index_copy_")
    source = _index_arg(self, source, "index_copy_")
    return _inplace(self, "index_copy_", "index_copy", (index, source), {"dim": dim},
                    lambda s, i, src: s.index_copy_(dim, i, src))


def _index_fill_(self, dim, index, value):
    """In place :meth:`index_fill` (layout kept; a P tensor only with ``value == 0``)."""
    dim = _dim(dim, self.ndim)
    value = _number("index_fill_", "value", value)
    index = _index_arg(self, index, "index_fill_")
    return _inplace(self, "index_fill_", "index_fill", (index,), {"dim": dim, "value": value},
                    lambda s, i: s.index_fill_(dim, i, value))


def _scatter_(self, dim, index, src=None, *, value=None):
    """In place :meth:`scatter` (``torch.Tensor.scatter_``): ``src`` a tensor or a
    number (or ``value=``). A global x keeps its layout: ``dim`` must not be split (a
    ValueError says how to box it); a P x takes a P source's summands, and a number is
    written only into a non-P x."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter_")
    src, value = _scatter_source(self, src, value, "scatter_")
    if src is None:
        value = _number("scatter_", "value", value)
        return _inplace(self, "scatter_", "scatter", (index,), {"dim": dim, "value": value},
                        lambda s, i: s.scatter_(dim, i, value))
    return _inplace(self, "scatter_", "scatter", (index, src), {"dim": dim},
                    lambda s, i, v: s.scatter_(dim, i, v))


def _scatter_add_(self, dim, index, src):
    """In place :meth:`scatter_add` (``torch.Tensor.scatter_add_``; layout kept, as
    :meth:`scatter_`; a P x with an index and source split along ``dim`` adds each
    rank's part into its summand)."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter_add_")
    src = _index_arg(self, src, "scatter_add_")
    return _inplace(self, "scatter_add_", "scatter", (index, src), {"dim": dim, "add": True},
                    lambda s, i, v: s.scatter_add_(dim, i, v))


def _via_copy(name: str):
    """``x.<name>_(...)``: the out-of-place op, written back with ``copy_`` (which boxes
    the result into x's layout, or raises naming the layouts where it cannot, e.g. a P
    result into a B tensor is fine, any result into a P tensor is its summands)."""

    def method(self, *args, **kwargs):
        return self.copy_(getattr(self, name)(*args, **kwargs))

    method.__name__ = f"{name}_"
    method.__doc__ = (f"In place ``torch.Tensor.{name}_``: ``x.copy_(x.{name}(...))`` (same "
                      f"values, gradients and layout rules as :meth:`{name}`; x keeps its "
                      f"layout).")
    return method


# ====================================================================== cumulative ops


def _along_rule(metas, attrs):
    """An op along ``dim`` that keeps the shape: other dims keep their split; no P."""
    return _keep(metas[0].ndim, (attrs["dim"],), linear=False)


register("cumprod", _along_rule)(lambda a, *, dim, dtype: torch.cumprod(a, dim, dtype=dtype))
register("logcumsumexp", _along_rule)(lambda a, *, dim: torch.logcumsumexp(a, dim))
register("cummax", _along_rule)(lambda a, *, dim, part: torch.cummax(a, dim)[part])
register("cummin", _along_rule)(lambda a, *, dim, part: torch.cummin(a, dim)[part])


def _cumprod(self, dim, *, dtype=None):
    """``torch.cumprod`` along ``dim`` (``dtype`` casts first; ints give int64). Gradient
    torch's (exact with zeros). SBP: other dims keep their split; a split ``dim`` and ``P``
    are boxed away (the cheapest: all-to-all to another dim, or a gather)."""
    return apply("cumprod", self, dim=_dim(dim, self.ndim), dtype=dtype)


def _logcumsumexp(self, dim):
    """``torch.logcumsumexp`` along ``dim``; SBP as :meth:`cumprod`."""
    return apply("logcumsumexp", self, dim=_dim(dim, self.ndim))


def _cum_extremum(kind: str):
    ret = torch.return_types.cummax if kind == "cummax" else torch.return_types.cummin

    def method(self, dim):
        dim = _dim(dim, self.ndim)
        return ret((apply(kind, self, dim=dim, part=0), apply(kind, self, dim=dim, part=1)))

    method.__name__ = kind
    method.__doc__ = (f"``torch.{kind}`` along ``dim``: ``(values, indices)`` (int64, the "
                      f"last position of the running extremum, as torch). SBP as "
                      f":meth:`cumprod`.")
    return method


# ====================================================================== diagonals


def _diagonal_rule(metas, attrs):
    (m,) = metas
    d1, d2 = attrs["dim1"], attrs["dim2"]
    rest = [d for d in range(m.ndim) if d not in (d1, d2)]
    return _keep(m.ndim, (d1, d2), lambda d: rest.index(d))


def _diag_embed_rule(metas, attrs):
    (m,) = metas
    d1, d2 = attrs["dim1"], attrs["dim2"]
    rest = [d for d in range(m.ndim + 1) if d not in (d1, d2)]
    return _keep(m.ndim, (m.ndim - 1,), lambda d: rest[d])


register("diagonal", _diagonal_rule)(
    lambda a, *, offset, dim1, dim2: torch.diagonal(a, offset, dim1, dim2))
register("diag_embed", _diag_embed_rule)(
    lambda a, *, offset, dim1, dim2: torch.diag_embed(a, offset, dim1, dim2))
register("diag", lambda metas, attrs: [(P, P)])(lambda a, *, diagonal: torch.diag(a, diagonal))


def _diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """``torch.diagonal``: the diagonal of dims ``dim1``/``dim2`` as the last dim (length
    of the ``offset`` diagonal). SBP: the other dims keep their split (renumbered), the two
    dims are whole; ``P`` passes.

    Raises:
        ValueError: ``dim1 == dim2``."""
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    if d1 == d2:
        raise ValueError(f"diagonal: dim1 and dim2 must differ, got {dim1} and {dim2}")
    return apply("diagonal", self, offset=int(offset), dim1=d1, dim2=d2)


def _diag_embed(self, offset: int = 0, dim1: int = -2, dim2: int = -1):
    """``torch.diag_embed``: the last dim of x (``(*, n)``) on the ``offset`` diagonal of
    new dims ``dim1``/``dim2`` (size ``n + |offset|``). SBP: batch dims keep their split;
    ``P`` passes.

    Raises:
        ValueError: ``dim1 == dim2``."""
    d1, d2 = _dim(dim1, self.ndim + 1), _dim(dim2, self.ndim + 1)
    if d1 == d2:
        raise ValueError(f"diag_embed: dim1 and dim2 must differ, got {dim1} and {dim2}")
    return apply("diag_embed", self, offset=int(offset), dim1=d1, dim2=d2)


def _diag(self, diagonal: int = 0):
    """``torch.diag``: a 1-D x gives the ``(n + |d|, n + |d|)`` matrix with x on diagonal
    ``d``; a 2-D x gives its diagonal ``d`` (1-D). SBP: ``P`` passes, splits are gathered.

    Raises:
        ValueError: x is not 1-D or 2-D."""
    if self.ndim not in (1, 2):
        raise ValueError(f"diag: expected a 1-D or 2-D tensor, got shape {tuple(self.shape)}")
    return apply("diag", self, diagonal=int(diagonal))


def _trace(self):
    """``torch.trace``: the sum of the main diagonal of a 2-D x (ints sum to int64). SBP:
    the diagonal's sum (a split diagonal gives ``P``)."""
    if self.ndim != 2:
        raise ValueError(f"trace: expected a 2-D tensor, got shape {tuple(self.shape)}")
    return _diagonal(self).sum()


def _tri_indices(name: str):
    fn = getattr(torch, name)

    def creator(row: int, col: int, offset: int = 0, *, dtype=torch.int64, device=None,
                layout=torch.strided, placement=None, sbp=None) -> Tensor:
        whole = fn(row, col, offset, dtype=dtype)
        return _deterministic(name, tuple(whole.shape), dtype, device, False, placement, sbp,
                              lambda region, local_shape, dev: whole[region].to(dev))

    creator.__name__ = name
    creator.__doc__ = (f"``torch.{name}(row, col, offset)``: the ``(2, N)`` int64 coordinates "
                       f"of the {'lower' if name.startswith('tril') else 'upper'} triangle of "
                       f"a ``row x col`` matrix. With ``placement``/``sbp`` each rank keeps its "
                       f"shard (computed locally, no communication; ``P``: coordinate 0 holds "
                       f"the values).")
    return creator


tril_indices = _tri_indices("tril_indices")
triu_indices = _tri_indices("triu_indices")


# ====================================================================== data-dependent shapes


def _masked_select(self, mask):
    """``torch.masked_select``: the 1-D elements of x where the bool ``mask`` (broadcast
    with x) is True. Global: x and mask are boxed to ``B`` (the result's length depends on
    the data); the result is ``B``. Differentiable in x."""
    _check_global_pair("masked_select", self, mask)
    if self.is_local:
        return Tensor(torch.masked_select(self._local, mask._local))
    x, m = _all_b(self), _all_b(mask)
    return _b_result(torch.masked_select(x._local, m._local), x.placement)


def _nonzero(self, *, as_tuple: bool = False):
    """``torch.nonzero``: int64 ``(N, ndim)`` coordinates of the non-zero elements
    (``as_tuple``: one 1-D tensor per dim). Global: x is boxed to ``B``; results ``B``."""
    x = _all_b(self)
    out = torch.nonzero(x._local, as_tuple=as_tuple)
    wrap = Tensor if self.is_local else (lambda t: _b_result(t, x.placement))
    return tuple(wrap(t) for t in out) if as_tuple else wrap(out)


def _argwhere(self):
    """``torch.argwhere``: :meth:`nonzero` (``(N, ndim)`` int64)."""
    return _nonzero(self)


def _unique(self, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
            return_counts: bool = False, dim=None):
    """``torch.unique``: the distinct elements (``dim``: distinct slices), sorted, with the
    inverse indices (x's shape, or ``(x.shape[dim],)``) and counts when asked. Global: x
    is boxed to ``B``; every result is ``B``. Not differentiable (as torch)."""
    x = _all_b(self)
    if dim is not None:
        dim = _dim(dim, self.ndim)
    out = torch.unique(x._local.detach(), sorted=sorted, return_inverse=return_inverse,
                       return_counts=return_counts, dim=dim)
    wrap = Tensor if self.is_local else (lambda t: _b_result(t, x.placement))
    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _count_into_bins(x: Tensor, n: int, extra, count) -> Tensor:
    """Counts of global ``x`` (no P) into ``n`` bins: ``count(x_local, *extra_locals)`` on
    each shard, P over the axes that split x, then all-reduced to B."""
    pl = x.placement
    nd = tuple(P if s.is_split() else B for s in x.sbp)
    if pl.coord() is None:
        local = torch.empty((0,), dtype=count(x._local[:0].detach(), *(
            e._local[:0].detach() for e in extra)).dtype, device=x._local.device)
    else:
        local = count(x._local.detach(), *(e._local.detach() for e in extra))
    return Tensor(local, pl, nd, (n,)).to_global(sbp=(B,) * pl.ndim)


def _bincount(self, weights=None, minlength: int = 0):
    """``torch.bincount``: counts (or summed ``weights``) of each value of a 1-D
    non-negative int x, length ``max(x.max() + 1, minlength)``. Global: the max is
    all-reduced first, each rank counts its shard into that many bins (``P`` over split
    axes; x is never gathered) and the counts are all-reduced: the result is ``B``.
    Not differentiable (as torch).

    Raises:
        ValueError: x not 1-D, negative values, weights of another shape."""
    if self.ndim != 1:
        raise ValueError(f"bincount: expected a 1-D int tensor, got shape {tuple(self.shape)}")
    if weights is not None:
        _check_global_pair("bincount", self, weights)
        if tuple(weights.shape) != tuple(self.shape):
            raise ValueError(f"bincount: weights of shape {tuple(weights.shape)} must match x "
                             f"of shape {tuple(self.shape)}")
    if self.is_local:
        return Tensor(torch.bincount(self._local, None if weights is None else
                                     weights._local, minlength))
    x = _unpartial(self)
    if x.numel():
        if x.amin().item() < 0:
            raise ValueError("bincount: x must hold non-negative ints")
        top = int(x.amax().item()) + 1
    else:
        top = 0
    n = max(top, int(minlength))
    extra = () if weights is None else (weights.to_global(sbp=x.sbp),)
    return _count_into_bins(x, n, extra,
                            lambda a, *w: torch.bincount(a, w[0] if w else None, n))


def _histc(self, bins: int = 100, min=0, max=0):  # noqa: A002 - torch's names
    """``torch.histc``: a float histogram of ``bins`` equal bins over ``[min, max]``
    (``min == max``: the data's min and max; elements outside are ignored). Global: the
    min/max are all-reduced first when needed, each rank counts its shard (``P`` over split
    axes), the counts are all-reduced: the result is ``B``. Not differentiable."""
    if self.is_local:
        return Tensor(torch.histc(self._local.detach(), bins, min, max))
    x = _unpartial(self)
    lo, hi = min, max
    if lo == hi and x.numel():
        lo, hi = x.amin().item(), x.amax().item()
        if lo == hi:
            lo, hi = lo - 1, hi + 1
    return _count_into_bins(x, int(bins), (), lambda a: torch.histc(a, bins, lo, hi))


def _count_nonzero(self, dim=None):
    """``torch.count_nonzero``: int64 count of non-zero elements over ``dim`` (int, tuple,
    None: all). Global: a sum of ``x != 0`` (kept dims keep their split, a split counted
    dim gives ``P``), boxed to ``B`` where it would be ``P``."""
    if self.is_local:
        return Tensor(torch.count_nonzero(self._local, dim))
    return _unpartial((_unpartial(self) != 0).sum(dim))


def _unpartial(x: Tensor) -> Tensor:
    if x.is_global and any(s.is_partial() for s in x.sbp):
        return x.to_global(sbp=tuple(B if s.is_partial() else s for s in x.sbp))
    return x


# ====================================================================== order statistics


def _select_rule(metas, attrs):
    """median/kthvalue/mode/quantile over ``dim``: other dims keep their split."""
    (m,) = metas
    dim = attrs.get("dim")
    if dim is None:
        return []
    lead = 1 if isinstance(attrs.get("q"), tuple) else 0
    return _keep(m.ndim, (dim,), _reduced_dim(dim, attrs.get("keepdim", False), lead),
                 linear=False)


register("median_all", None)(lambda a, *, nan: (torch.nanmedian if nan else torch.median)(a))
register("median_dim", _select_rule)(
    lambda a, *, dim, keepdim, nan, part:
    (torch.nanmedian if nan else torch.median)(a, dim, keepdim)[part])
register("kthvalue", _select_rule)(
    lambda a, *, k, dim, keepdim, part: torch.kthvalue(a, k, dim, keepdim)[part])
register("mode", _select_rule)(lambda a, *, dim, keepdim, part: torch.mode(a, dim, keepdim)[part])


@register("quantile", _select_rule)
def _quantile_kernel(a, *, q, dim, keepdim, interpolation, nan):
    if isinstance(q, tuple):
        q = torch.tensor(q, dtype=a.dtype, device=a.device)
    fn = torch.nanquantile if nan else torch.quantile
    return fn(a, q, dim, keepdim, interpolation=interpolation)


def _pair(ret, op: str, x: Tensor, **attrs):
    return ret((apply(op, x, part=0, **attrs), apply(op, x, part=1, **attrs)))


def _median_method(nan: bool):
    name = "nanmedian" if nan else "median"
    ret = torch.return_types.nanmedian if nan else torch.return_types.median

    def method(self, dim=None, keepdim: bool = False):
        if dim is None:
            return apply("median_all", self, nan=nan)
        return _pair(ret, "median_dim", self, dim=_dim(dim, self.ndim), keepdim=keepdim,
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
    dim = _dim(dim, self.ndim)
    n = self.shape[dim] if self.ndim else 1
    if not 1 <= k <= n:
        raise ValueError(f"kthvalue: k={k} is out of range for dim {dim} of size {n} "
                         f"(expected 1 <= k <= {n})")
    return _pair(torch.return_types.kthvalue, "kthvalue", self, k=int(k), dim=dim,
                 keepdim=keepdim)


def _mode(self, dim: int = -1, keepdim: bool = False):
    """``torch.mode``: ``(values, indices)`` of the most frequent value along ``dim``
    (ties: the smallest value). SBP as :meth:`kthvalue`."""
    return _pair(torch.return_types.mode, "mode", self, dim=_dim(dim, self.ndim),
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
            q = float(_number(name, "q", q))
        for v in q if isinstance(q, tuple) else (q,):
            if not 0 <= v <= 1:
                raise ValueError(f"{name}: q values must be in [0, 1], got {v}")
        if dim is not None:
            dim = _dim(dim, self.ndim)
        return apply("quantile", self, q=q, dim=dim, keepdim=keepdim,
                     interpolation=interpolation, nan=nan)

    method.__name__ = name
    method.__doc__ = f"""``torch.{name}``: the ``q``-quantiles (a number, or a 1-D tensor:
    a new leading dim) over ``dim`` (None: the flattened tensor), with ``interpolation``
    linear (default), lower, higher, midpoint or nearest{'; NaN ignored' if nan else ''}.
    SBP: other dims keep their split; a split ``dim`` (or ``dim=None``) is boxed.

    Raises:
        ValueError: ``q`` outside [0, 1]; an unknown interpolation."""
    return method


# ====================================================================== nan-reductions, moments


def _nansum(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.nansum``: the sum with NaN counted as zero (gradient 0 there). SBP as
    :meth:`sum` (a split reduced dim gives ``P``)."""
    x = self
    if x.dtype.is_floating_point or x.dtype.is_complex:
        x = where(x.isnan(), 0.0, x)
    return x.sum(dim, keepdim, dtype=dtype)


def _nanmean(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.nanmean``: the mean of the non-NaN elements over ``dim``. SBP: a sum and a
    count as :meth:`sum` (``P`` over a split reduced dim), the count all-reduced for the
    division.

    Raises:
        TypeError: a non-floating input (as torch)."""
    want = dtype or self.dtype
    if not (want.is_floating_point or want.is_complex):
        raise TypeError(f"nanmean: expected a floating point input, got {self.dtype}")
    x = self if dtype is None else self.to(dtype)
    count = x.isnan().logical_not().sum(dim, keepdim).to(x.dtype)
    return _nansum(x, dim, keepdim) / count


def _moments(kind: str):
    def fn(input, dim=None, unbiased=None, keepdim: bool = False, *,  # noqa: A002
           correction=None):
        d = dim
        if isinstance(dim, bool):
            d, unbiased = None, dim
        spread = getattr(input, kind)(d, unbiased, keepdim, correction=correction)
        dims = tuple(range(input.ndim)) if d is None else d
        return spread, input.mean(dims, keepdim)

    fn.__name__ = f"{kind}_mean"
    fn.__doc__ = (f"``torch.{kind}_mean``: ``({kind}, mean)`` over ``dim`` with Bessel's "
                  f"``correction`` (as :meth:`Tensor.{kind}`); each is computed as that op "
                  f"(a split reduced dim: output-sized all-reduces only).")
    return fn


std_mean = _moments("std")
var_mean = _moments("var")


def _aminmax(self, *, dim=None, keepdim: bool = False):
    """``torch.aminmax``: ``(min, max)`` over ``dim`` (None: all elements); as
    :meth:`amin`/:meth:`amax` (an all-reduce MIN/MAX over a split reduced dim, no gather)."""
    if self.is_local:
        out = torch.aminmax(self._local, dim=dim, keepdim=keepdim)
        return torch.return_types.aminmax((Tensor(out.min), Tensor(out.max)))
    dims = None if dim is None else _dim(dim, self.ndim)
    return torch.return_types.aminmax((extremum(self, "min", dims, keepdim),
                                       extremum(self, "max", dims, keepdim)))


# ====================================================================== diff, cross


def _diff(self, n: int = 1, dim: int = -1, prepend=None, append=None):
    """``torch.diff``: the ``n``-th forward difference along ``dim`` (``prepend``/
    ``append`` joined first; bool: ``!=``). SBP: composed of ``cat`` and slices, so
    ``dim`` is gathered and the other dims keep their split; ``P`` passes.

    Raises:
        ValueError: negative ``n``."""
    from ._methods import cat

    if n < 0:
        raise ValueError(f"diff: order n must be non-negative, got {n}")
    dim = _dim(dim, self.ndim)
    parts = [p for p in (prepend, self, append) if p is not None]
    x = cat(parts, dim) if len(parts) > 1 else self
    for _ in range(n):
        if x.shape[dim] == 0:
            break
        hi = x.narrow(dim, 1, x.shape[dim] - 1)
        lo = x.narrow(dim, 0, x.shape[dim] - 1)
        x = hi != lo if x.dtype == torch.bool else hi - lo
    return x


def _cross_rule(metas, attrs):
    a, b = metas
    dim = attrs["dim"]
    nd = max(a.ndim, b.ndim)
    sigs = [(P, B, P), (B, P, P)]
    for d in range(nd):
        if d == dim:
            continue
        da, db = d - nd + a.ndim, d - nd + b.ndim
        size = max(a.shape[da] if da >= 0 else 1, b.shape[db] if db >= 0 else 1)
        sa = S(da) if da >= 0 and a.shape[da] == size else B
        sb = S(db) if db >= 0 and b.shape[db] == size else B
        if sa != B or sb != B:
            sigs.append((sa, sb, S(d)))
    return sigs


register("cross", _cross_rule)(lambda a, b, *, dim: torch.linalg.cross(a, b, dim=dim))


def _cross(self, other, dim=None):
    """``torch.cross`` (``torch.linalg.cross``): the 3-vector cross product along ``dim``
    (None: the first dim of size 3, as torch.cross), broadcasting. SBP: other dims split,
    ``P`` in one operand (linear in each).

    Raises:
        ValueError: no dim of size 3 / ``dim`` not of size 3."""
    _check_global_pair("cross", self, other)
    nd = max(self.ndim, other.ndim)
    if dim is None:
        shape = torch.broadcast_shapes(tuple(self.shape), tuple(other.shape))
        dim = next((d for d, s in enumerate(shape) if s == 3), None)
        if dim is None:
            raise ValueError(f"cross: no dim of size 3 in shapes {tuple(self.shape)} and "
                             f"{tuple(other.shape)}; pass dim=")
    dim = _dim(dim, nd)
    for t in (self, other):
        if t.shape[dim - nd + t.ndim] != 3:
            raise ValueError(f"cross: dim {dim} must have size 3, got shapes "
                             f"{tuple(self.shape)} and {tuple(other.shape)}")
    return apply("cross", self, other, dim=dim)


# ====================================================================== matmul family


def _scaled(x: Tensor, c):
    return x if c == 1 else x * c


def _add_product(name: str, input, product, beta, alpha):  # noqa: A002
    """``beta * input + alpha * product`` (torch: ``beta == 0`` ignores input's values)."""
    out = _scaled(product, alpha)
    if beta == 0:
        return out
    return out + _scaled(input, beta)


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """``torch.addmm``: ``beta * x + alpha * (mat1 @ mat2)`` (mat1 ``(n, m)``, mat2
    ``(m, p)``, x broadcast to ``(n, p)``). Composed: matmul's einsum rules apply (a
    split contracted dim gives ``P``, added to ``x``). ``beta == 0`` ignores x (NaN too).

    Raises:
        ValueError: mat1 or mat2 not 2-D."""
    if mat1.ndim != 2 or mat2.ndim != 2:
        raise ValueError(f"addmm: mat1 and mat2 must be 2-D, got shapes {tuple(mat1.shape)} "
                         f"and {tuple(mat2.shape)}")
    return _add_product("addmm", self, mat1 @ mat2, beta, alpha)


def _addmv(self, mat, vec, *, beta=1, alpha=1):
    """``torch.addmv``: ``beta * x + alpha * (mat @ vec)`` (mat ``(n, m)``, vec ``(m,)``).
    Composed as :meth:`addmm`."""
    if mat.ndim != 2 or vec.ndim != 1:
        raise ValueError(f"addmv: expected a 2-D mat and a 1-D vec, got shapes "
                         f"{tuple(mat.shape)} and {tuple(vec.shape)}")
    return _add_product("addmv", self, mat @ vec, beta, alpha)


def _baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """``torch.baddbmm``: ``beta * x + alpha * (batch1 @ batch2)`` per batch (``(b, n,
    m) @ (b, m, p)``). Composed as :meth:`addmm` (the batch dim may stay split)."""
    if batch1.ndim != 3 or batch2.ndim != 3:
        raise ValueError(f"baddbmm: batch1 and batch2 must be 3-D, got shapes "
                         f"{tuple(batch1.shape)} and {tuple(batch2.shape)}")
    return _add_product("baddbmm", self, batch1 @ batch2, beta, alpha)


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """``torch.addbmm``: ``beta * x + alpha * sum_b(batch1[b] @ batch2[b])``: one einsum
    ``bnm,bmp->np`` (a split batch or contracted dim gives ``P``)."""
    from ._extra import einsum

    if batch1.ndim != 3 or batch2.ndim != 3:
        raise ValueError(f"addbmm: batch1 and batch2 must be 3-D, got shapes "
                         f"{tuple(batch1.shape)} and {tuple(batch2.shape)}")
    return _add_product("addbmm", self, einsum("bnm,bmp->np", batch1, batch2), beta, alpha)


def _inplace_product(fn, name: str):
    def method(self, *args, beta=1, alpha=1):
        out = fn(self, *args, beta=beta, alpha=alpha)
        return self.copy_(out)

    method.__name__ = name
    method.__doc__ = (f"In place ``{name[:-1]}`` (``torch.Tensor.{name}``): the out-of-place "
                      f"result copied into x (x keeps its layout; see ``copy_``).")
    return method


# ====================================================================== distances, search


def _cdist_rule(metas, attrs):
    a, b = metas
    nb = a.ndim - 2
    sigs = [(S(d), S(d), S(d)) for d in range(nb)
            if b.ndim == a.ndim and a.shape[d] == b.shape[d]]
    return sigs + [(S(a.ndim - 2), B, S(a.ndim - 2)), (B, S(b.ndim - 2), S(a.ndim - 1))]


register("cdist", _cdist_rule)(
    lambda a, b, *, p, compute_mode: torch.cdist(a, b, p, compute_mode))


def cdist(x1: Tensor, x2: Tensor, p: float = 2.0,
          compute_mode: str = "use_mm_for_euclid_dist_if_necessary") -> Tensor:
    """``torch.cdist``: the ``p``-norm distances between the rows of x1 ``(*, P, M)`` and
    x2 ``(*, R, M)``: ``(*, P, R)``. SBP: batch dims split in both; the rows of x1 (output
    dim -2) or of x2 (output dim -1) split; a split ``M`` is gathered.

    Raises:
        ValueError: fewer than 2 dims or different ``M``."""
    _check_global_pair("cdist", x1, x2)
    if x1.ndim < 2 or x2.ndim < 2 or x1.shape[-1] != x2.shape[-1]:
        raise ValueError(f"cdist: expected x1 (*, P, M) and x2 (*, R, M), got shapes "
                         f"{tuple(x1.shape)} and {tuple(x2.shape)}")
    return apply("cdist", x1, x2, p=float(p), compute_mode=compute_mode)


def _dist(self, other, p=2):
    """``torch.dist``: ``(x - other).norm(p)`` (0-dim), broadcasting; as :meth:`norm`."""
    return (self - other).norm(p)


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
            from .creation import tensor

            input = tensor(value, placement=sorted_sequence.placement,
                           sbp=(B,) * sorted_sequence.placement.ndim)
        else:
            input = Tensor(value)
    _check_global_pair("searchsorted", sorted_sequence, input)
    return apply("searchsorted", sorted_sequence, input, right=bool(right),
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


# ====================================================================== table

METHODS: dict = {
    "addbmm": _addbmm,
    "addbmm_": _inplace_product(_addbmm, "addbmm_"),
    "addmm": _addmm,
    "addmm_": _inplace_product(_addmm, "addmm_"),
    "addmv": _addmv,
    "addmv_": _inplace_product(_addmv, "addmv_"),
    "aminmax": _aminmax,
    "argwhere": _argwhere,
    "baddbmm": _baddbmm,
    "baddbmm_": _inplace_product(_baddbmm, "baddbmm_"),
    "bincount": _bincount,
    "count_nonzero": _count_nonzero,
    "cross": _cross,
    "cummax": _cum_extremum("cummax"),
    "cummin": _cum_extremum("cummin"),
    "cumprod": _cumprod,
    "diag": _diag,
    "diag_embed": _diag_embed,
    "diagonal": _diagonal,
    "diff": _diff,
    "dist": _dist,
    "histc": _histc,
    "index_add": _index_add,
    "index_add_": _index_add_,
    "index_copy": _index_copy,
    "index_copy_": _index_copy_,
    "index_fill": _index_fill,
    "index_fill_": _index_fill_,
    "scatter_": _scatter_,
    **{f"{n}_": _via_copy(n) for n in ("addcdiv", "addcmul", "cumprod", "cumsum", "lerp",
                                       "tril", "triu")},
    "scatter_add_": _scatter_add_,
    "kthvalue": _kthvalue,
    "logcumsumexp": _logcumsumexp,
    "masked_select": _masked_select,
    "median": _median_method(False),
    "mode": _mode,
    "nanmean": _nanmean,
    "nanmedian": _median_method(True),
    "nanquantile": _quantile_method(True),
    "nansum": _nansum,
    "nonzero": _nonzero,
    "quantile": _quantile_method(False),
    "repeat_interleave": _repeat_interleave,
    "trace": _trace,
    "unique": _unique,
}
