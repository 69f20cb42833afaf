"""Indexing: ``x[...]`` and ``x[...] = v``, ``gather``, ``scatter``/``scatter_add`` (and
in place), ``index_select``, ``index_add``/``index_copy``/``index_fill`` (and in place),
``take_along_dim``, ``one_hot``.

SBP rules (one mesh axis, one small rule per op below): a dim that is indexed, gathered
or scattered into must be whole on the axis (``B``); every other dim keeps its split,
renumbered where dims disappear (int indexing) or appear (``None``); index tensors may be
split along the dims they contribute to the output (an index split over the gathered dim
gives an output split there, with no communication); ``P`` passes through the linear ops
(slicing and indexing, gather, index_select, scatter/scatter_add/index_add/index_copy
with a ``P`` source); ``scatter_add``/``index_add`` of an index and source split along
``dim`` give ``P`` with no communication (the embedding-backward pattern).

``x[...] = v`` writes in place into each rank's shard: basic slices and ints along a split
dim are intersected with each shard; tensor indices need the dims they index whole; a
``P`` tensor raises (no rank holds the value to overwrite).
"""

from __future__ import annotations

import numbers

import torch

from ..sbp import Split, broadcast, format_nd_sbp, partial_sum
from ..tensor import Tensor
from .algorithms import whole
from .api import function, method
from .args import meta_of, norm_dim, number
from .dispatch import check_writable, dispatch, dispatch_inplace, inplace_by_copy
from .registry import register
from .rules import maps

S, B, P = Split, broadcast, partial_sum


def _one_hot_rule(metas, attrs):
    return maps(((d, d) for d in range(metas[0].ndim)), linear=False)


def _gather_rule(metas, attrs):
    """gather(x, dim, index): x whole on ``dim``; an index split on ``dim`` gives an output
    split there; another dim may be split in both when x and index have its size there."""
    x, idx = metas
    dim = attrs["dim"]
    sigs = [(P, B, P), (B, S(dim), S(dim))]
    sigs += [(S(d), S(d), S(d)) for d in range(idx.ndim)
             if d != dim and idx.shape[d] == x.shape[d]]
    return sigs


def _take_along_dim_rule(metas, attrs):
    """take_along_dim(x, index, dim): as gather, with broadcasting off ``dim`` (a size-1
    side stays B while the other is split)."""
    x, idx = metas
    dim = attrs["dim"]
    sigs = [(P, B, P), (B, S(dim), S(dim))]
    for d in range(x.ndim):
        if d == dim:
            continue
        size = max(x.shape[d], idx.shape[d])
        sig = (S(d) if x.shape[d] == size else B, S(d) if idx.shape[d] == size else B)
        sigs.append((*sig, S(d)))
    return sigs


def _scatter_rule(metas, attrs):
    """scatter(x, dim, index, src) and scatter_add: x whole on ``dim``; another dim may be
    split in all three where they share its size. Linear in (x, src) jointly: (P, B, P) ->
    P. scatter_add only: an index and source split along ``dim`` add their contributions
    into a P output (each rank scatters its part into its summand of x)."""
    x, idx = metas[:2]
    dim = attrs["dim"]
    with_src = len(metas) == 3
    sigs = []
    for d in range(idx.ndim):
        if d != dim and idx.shape[d] == x.shape[d] and (
                not with_src or metas[2].shape[d] == x.shape[d]):
            sigs.append((S(d),) * (len(metas) + 1))
    if with_src:
        sigs.append((P, B, P, P))
        if attrs.get("add") and idx.shape[dim] == metas[2].shape[dim]:
            sigs.append((P, S(dim), S(dim), P))
    return sigs


def _index_select_rule(metas, attrs):
    x, _ = metas
    dim = attrs["dim"]
    return [(P, B, P), (B, S(0), S(dim))] + [(S(d), B, S(d)) for d in range(x.ndim) if d != dim]


def _index_layout(spec, index_ndims):
    """Where the dims of ``x[spec]`` come from, torch's rules: ints drop their dim, ``None``
    adds one, tensor indices (broadcast together, ``index_ndims`` their dims) form one
    block, placed where the first stands if they are adjacent after ints are dropped,
    else in front.

    Returns ``(slice dims: data dim -> output dim, block start, block ndim)``."""
    view, d = [], 0
    for item in spec:
        if item[0] == "none":
            view.append(("new", None))
            continue
        if item[0] == "slice":
            view.append(("dim", d))
        elif item[0] == "tensor":
            view.append(("adv", d))
        d += 1
    adv = [i for i, v in enumerate(view) if v[0] == "adv"]
    nb = max(index_ndims, default=0) if adv else 0
    adjacent = adv == list(range(adv[0], adv[-1] + 1)) if adv else True
    out, pos, start, placed = {}, 0 if adjacent else nb, 0, False
    for kind, dd in view:
        if kind == "adv":
            if adjacent and not placed:
                start, placed = pos, True
                pos += nb
            continue
        if kind == "dim":
            out[dd] = pos
        pos += 1
    return out, start, nb


def _full(item) -> bool:
    return item == ("slice", None, None, None)


def _getitem_rule(metas, attrs):
    """``x[index]``: a dim taken whole (``:``) keeps its split (renumbered); dims that are
    int-indexed, sliced or tensor-indexed must be whole; index tensors may be split along
    their (broadcast) dims, which split the output's index block; P passes (linear)."""
    idx = metas[1:]
    spec = attrs["spec"]
    n = len(idx)
    dmap, start, nb = _index_layout(spec, [m.ndim for m in idx])
    data_items = [it for it in spec if it[0] != "none"]
    sigs = [(P,) + (B,) * n + (P,)]
    sigs += [(S(d),) + (B,) * n + (S(e),) for d, e in dmap.items() if _full(data_items[d])]
    for j in range(nb):
        sizes = [m.shape[j - nb + m.ndim] if j - nb + m.ndim >= 0 else 1 for m in idx]
        size = max(sizes)
        ins = tuple(S(j - nb + m.ndim) if j - nb + m.ndim >= 0 and s == size else B
                    for m, s in zip(idx, sizes))
        sigs.append((B, *ins, S(start + j)))
    return sigs


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


# ---------------------------------------------------------------- registered kernels
register("one_hot", _one_hot_rule)(
    lambda a, *, num_classes: torch.nn.functional.one_hot(a, num_classes))
register("gather", _gather_rule)(lambda a, i, *, dim: torch.gather(a, dim, i))
register("take_along_dim", _take_along_dim_rule)(
    lambda a, i, *, dim: torch.take_along_dim(a, i, dim))
register("index_select", _index_select_rule)(lambda a, i, *, dim: torch.index_select(a, dim, i))


@register("scatter", _scatter_rule)
def _scatter_kernel(a, i, *src, dim, add=False, value=None):
    if add:
        return torch.scatter_add(a, dim, i, src[0])
    return torch.scatter(a, dim, i, src[0] if src else value)


@register("getitem", _getitem_rule)
def _getitem_kernel(a, *tensors, spec):
    return a[_key(spec, tensors)]


def _key(spec, tensors) -> tuple:
    it = iter(tensors)
    out = []
    for item in spec:
        kind = item[0]
        out.append(item[1] if kind == "int" else slice(*item[1:]) if kind == "slice"
                   else None if kind == "none" else next(it))
    return tuple(out)


@register("index_add", _index_src_rule)
def _index_add_kernel(a, i, s, *, dim, alpha, add=True):
    return torch.index_add(a, dim, i, s, alpha=alpha)


register("index_copy", _index_src_rule)(lambda a, i, s, *, dim: torch.index_copy(a, dim, i, s))
register("index_fill", _index_fill_rule)(
    lambda a, i, *, dim, value: torch.index_fill(a, dim, i, value))


# ---------------------------------------------------------------- indexing


def _as_index_tensor(t):
    """A list / tuple / numpy index as a torch tensor (bool stays bool)."""
    if isinstance(t, (Tensor, torch.Tensor)):
        return t
    return torch.as_tensor(t)


def _parse_index(x: Tensor, index):
    """``(spec, index tensors)`` for ``x[index]``: ``spec`` is a tuple of ``("int", i)``,
    ``("slice", start, stop, step)`` (normalised; ``:`` and whole-dim slices are
    ``("slice", None, None, None)``), ``("none",)`` and ``("tensor",)``, one item per data
    dim (plus the ``None``s); bool masks become their ``nonzero`` index tensors (a global
    mask is gathered: every rank calls this).

    Raises:
        IndexError: too many indices, an int or mask out of range (as torch).
        ValueError: a slice step <= 0 (torch does not support negative steps).
        TypeError: an index of another type.
    """
    items = list(index) if isinstance(index, tuple) else [index]
    items = [_as_index_tensor(i) if isinstance(i, (list, Tensor, torch.Tensor)) or (
        hasattr(i, "__array__") and not isinstance(i, numbers.Number)) else i for i in items]
    for i in items:
        if isinstance(i, bool) or not (i is None or i is Ellipsis or isinstance(
                i, (numbers.Integral, slice, Tensor, torch.Tensor))):
            raise TypeError(f"index {i!r} ({type(i).__name__}) is not supported; use ints, "
                            f"slices, None, ..., integer/bool tensors or lists")

    def used(i) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, (Tensor, torch.Tensor)) and i.dtype == torch.bool:
            return max(i.ndim, 1)
        return 1

    n_used = sum(used(i) for i in items)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_used > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}: {index!r}")
    if Ellipsis in [i for i in items if not isinstance(i, (Tensor, torch.Tensor))]:
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        items[at:at + 1] = [slice(None)] * (x.ndim - n_used)
    else:
        items += [slice(None)] * (x.ndim - n_used)
    spec, tensors, d = [], [], 0
    for i in items:
        if i is None:
            spec.append(("none",))
            continue
        if isinstance(i, (Tensor, torch.Tensor)) and i.dtype == torch.bool:
            shape = tuple(x.shape[d:d + max(i.ndim, 1)])
            if i.ndim and tuple(i.shape) != shape:
                raise IndexError(f"the shape of the mask {tuple(i.shape)} at index {d} does not "
                                 f"match the shape of the indexed tensor {shape}")
            full = i.numpy() if isinstance(i, Tensor) else i.detach().cpu()
            for t in torch.as_tensor(full).reshape(i.shape or (1,)).nonzero(as_tuple=True):
                spec.append(("tensor",))
                tensors.append(t)
            d += max(i.ndim, 1)
            continue
        n = x.shape[d]
        if isinstance(i, (Tensor, torch.Tensor)):
            spec.append(("tensor",))
            tensors.append(i)
        elif isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step <= 0:
                raise ValueError(f"slice step must be greater than zero, got {i.step} "
                                 f"(torch tensors do not support negative steps; use flip)")
            whole = (start, stop, step) == (0, n, 1) or (step == 1 and start == 0 and stop >= n)
            spec.append(("slice", None, None, None) if whole else ("slice", start, stop, step))
        else:
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {d} with size {n}")
            spec.append(("int", int(i) % n))
        d += 1
    return tuple(spec), tensors


def _global_index(t, pl) -> Tensor:
    """An index tensor for a global ``x``: global sbpflow tensors as they are; torch
    tensors (and lists) are the same constant on every rank, so they become B directly."""
    if isinstance(t, Tensor):
        return t
    t = t.to(pl.device)
    if pl.coord() is None:
        local = t.reshape(-1)[:0].reshape((0,) * max(t.ndim, 1))
    else:
        local = t
    return Tensor(local, pl, (B,) * pl.ndim, tuple(t.shape))


def _torch_index(index):
    """A torch index from one that holds local sbpflow tensors."""
    def conv(i):
        if isinstance(i, Tensor):
            if i.is_global:
                raise TypeError("indexing a local tensor with a global index tensor; convert "
                                "one of them (x.to_global(...) or index.to_local())")
            return i._local
        return i
    return tuple(conv(i) for i in index) if isinstance(index, tuple) else conv(index)


def getitem(self: Tensor, index) -> Tensor:
    """``x[index]`` with torch's semantics: ints (negative too), slices with a positive
    step, ``None``, ``...``, integer tensors and lists (advanced indexing, broadcast
    together), bool masks.

    SBP: a dim taken whole (``:``) keeps its split, renumbered; an int-indexed, sliced or
    tensor-indexed dim is gathered first (B on it); index tensors may stay split along
    their dims (the output is then split along the index block); P passes. A bool mask on
    a global tensor is gathered to every rank (its result's size depends on its values).

    Raises: IndexError / ValueError / TypeError as torch for bad indices.
    """
    if self.is_local:
        return Tensor(self._local[_torch_index(index)])
    spec, tensors = _parse_index(self, index)
    tensors = [_global_index(t, self.placement) for t in tensors]
    return dispatch("getitem", self, *tensors, spec=spec)


def _p_error(x: Tensor, what: str) -> ValueError:
    axes = [a for a, s in enumerate(x.sbp) if s.is_partial()]
    fix = tuple(B if s.is_partial() else s for s in x.sbp)
    return ValueError(
        f"{what} on a tensor laid out {format_nd_sbp(x.sbp)}: it is partial-sum (P) on mesh "
        f"axis {axes}, so no rank holds the values to overwrite; box it first, e.g. "
        f"x = x.to_global(sbp={format_nd_sbp(fix)}), then assign")


def setitem(self: Tensor, index, value) -> None:
    """``x[index] = value`` in place (torch's semantics), ``value`` a number or a tensor
    that broadcasts to ``x[index]``.

    Global ``x``: each rank writes into its shard. A dim taken whole (``:``) may be split
    (a global ``value`` is boxed to the matching split, a torch tensor is sliced per
    rank); an int or basic slice along a split dim is intersected with each shard; dims
    indexed by tensors must be whole on every rank; a bool mask of ``x``'s leading shape
    with a scalar value is applied shard by shard (no gather). Autograd: as torch's
    in-place copy (a leaf that requires grad raises).

    Raises:
        ValueError: ``x`` is P on some mesh axis, or a tensor-indexed dim is split (the
            message names the layout and the ``to_global`` that fixes it).
        TypeError: a global ``value`` for a local ``x``, or another placement.
    """
    if self.is_local:
        if isinstance(value, Tensor):
            if value.is_global:
                raise TypeError("x[...] = v: x is local and v is global; use v.to_local() or "
                                "convert x with x.to_global(...)")
            value = value._local
        self._local[_torch_index(index)] = value
        return
    check_writable(self, "x[...] = v")
    if any(s.is_partial() for s in self.sbp):
        raise _p_error(self, "x[...] = v")
    pl = self.placement
    if isinstance(value, Tensor):
        if value.is_local:
            raise TypeError("x[...] = v: x is global and v is a local sbpflow tensor; convert v "
                            "with v.to_global(placement, sbp) (or pass a torch tensor, read as "
                            "the same constant on every rank)")
        if value.placement != pl:
            raise TypeError(f"x[...] = v: v lives on {value.placement!r}, x on {pl!r}; move v "
                            f"with v.to_global(placement=x.placement)")
    if _mask_setitem(self, index, value):
        return
    spec, tensors = _parse_index(self, index)
    sl = pl.shard_slices(tuple(self.shape), self.sbp)
    data_items = [it for it in spec if it[0] != "none"]
    split_dims = {s.dim for s in self.sbp if s.is_split()}
    for a, s in enumerate(self.sbp):
        if s.is_split() and data_items[s.dim][0] == "tensor":
            fix = tuple(B if t == s else t for t in self.sbp)
            raise ValueError(
                f"x[...] = v indexes dim {s.dim} with a tensor, but x is laid out "
                f"{format_nd_sbp(self.sbp)} (split on that dim, mesh axis {a}); dims indexed "
                f"by tensors must be whole on each rank: x = x.to_global(sbp="
                f"{format_nd_sbp(fix)}) first")
        if s.is_split() and tensors and not _full(data_items[s.dim]):
            raise ValueError(
                f"x[...] = v mixes tensor indices with an int/slice on dim {s.dim}, which x "
                f"splits ({format_nd_sbp(self.sbp)}, mesh axis {a}); make that dim whole "
                f"first: x = x.to_global(sbp=...) with B on mesh axis {a}")
    idx = [_global_index(t, pl) for t in tensors]
    idx = [t if t.sbp == (B,) * pl.ndim else t.to_global(sbp=(B,) * pl.ndim) for t in idx]
    region = tuple(_getitem_kernel(meta_of(self), *(meta_of(t) for t in idx), spec=spec).shape)
    dmap, _, _ = _index_layout(spec, [t.ndim for t in idx])
    nr = len(region)

    def vdim(r):  # value dim aligned with region dim r (None: broadcast along it)
        if not isinstance(value, (Tensor, torch.Tensor)):
            return None
        vd = r - (nr - value.ndim)
        return vd if vd >= 0 and value.shape[vd] == region[r] and region[r] != 1 else None

    v_split = set()  # region dims along which a global value stays split like x
    if isinstance(value, Tensor):
        want = []
        for s in self.sbp:
            vd = vdim(dmap[s.dim]) if s.is_split() and _full(data_items[s.dim]) else None
            want.append(S(vd) if vd is not None else B)
            if vd is not None:
                v_split.add(dmap[s.dim])
        value = value if value.sbp == tuple(want) else value.to_global(sbp=tuple(want))
        v_local = value._local
    elif isinstance(value, torch.Tensor):
        v_local = value.to(pl.device)
    else:
        v_local = value
    if pl.coord() is None:
        return
    key, narrow, empty = [], {}, False
    it = iter(t._local for t in idx)
    d = 0
    for item in spec:
        kind = item[0]
        if kind == "none":
            key.append(None)
            continue
        lo, hi = sl[d].start, sl[d].stop
        if kind == "tensor":
            key.append(next(it))
        elif d not in split_dims:
            key.append(item[1] if kind == "int" else slice(*item[1:]))
        elif kind == "int":
            if lo <= item[1] < hi:
                key.append(item[1] - lo)
            else:
                key.append(slice(0, 0))
                empty = True
        elif _full(item):
            key.append(slice(None))
            narrow[dmap[d]] = (lo, hi)
        else:
            start, stop, step = item[1:]
            count = len(range(start, stop, step))
            k0 = min(max(-(-(lo - start) // step), 0), count)
            k1 = min(max(-(-(hi - start) // step), 0), count)
            if k1 <= k0:
                key.append(slice(0, 0))
                empty = True
            else:
                key.append(slice(start + k0 * step - lo, start + (k1 - 1) * step - lo + 1, step))
                narrow[dmap[d]] = (k0, k1)
        d += 1
    if empty:  # nothing of the region here; still write (an empty region), keeping the graph
        if isinstance(v_local, torch.Tensor):
            v_local = v_local.reshape(-1)[:0].sum().to(v_local.dtype)
    else:
        for r, (k0, k1) in narrow.items():
            vd = vdim(r)
            if vd is not None and r not in v_split:
                v_local = v_local.narrow(vd, k0, k1 - k0)
    self._local[tuple(key)] = v_local


def _mask_setitem(x: Tensor, index, value) -> bool:
    """``x[mask] = scalar`` with a bool mask of ``x``'s leading shape: box the mask to
    ``x``'s splits and write shard by shard (no gather). False when it does not apply."""
    mask = index[0] if isinstance(index, tuple) and index and all(
        i is Ellipsis or i == slice(None) for i in index[1:]) else index
    if not isinstance(mask, (Tensor, torch.Tensor)) or mask.dtype != torch.bool or (
            mask.ndim == 0 or tuple(mask.shape) != tuple(x.shape[:mask.ndim])):
        return False
    if isinstance(value, (Tensor, torch.Tensor)) and value.ndim != 0:
        return False
    pl = x.placement
    want = tuple(s if s.is_split() and s.dim < mask.ndim else B for s in x.sbp)
    if isinstance(mask, Tensor):
        if mask.is_local or mask.placement != pl:
            return False
        m = (mask if mask.sbp == want else mask.to_global(sbp=want))._local
    else:
        m = mask.to(pl.device)[pl.shard_slices(tuple(mask.shape), want)]
    if isinstance(value, Tensor):
        value = (value if value.sbp == (B,) * pl.ndim else value.to_global(sbp=B))._local
    if pl.coord() is not None:
        x._local[m] = value
    return True


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """``torch.nn.functional.one_hot``: int64 ``(*shape)`` -> int64 ``(*shape, classes)``.
    ``num_classes=-1`` takes ``max + 1`` (collective on a global tensor). SBP: splits kept.

    Raises ``TypeError`` for a non-int64 input (as torch)."""
    if tensor.dtype != torch.int64:
        raise TypeError(f"one_hot is only applicable to index tensors (int64), got {tensor.dtype}")
    if num_classes == -1:
        num_classes = int(tensor.amax().item()) + 1 if tensor.numel() else 0
    if tensor.is_global and any(s.is_partial() for s in tensor.sbp):
        tensor = whole(tensor, (), partial_too=True)
    return dispatch("one_hot", tensor, num_classes=int(num_classes))


def _index_arg(x: Tensor, index, what: str) -> Tensor:
    if isinstance(index, Tensor):
        return index
    if isinstance(index, torch.Tensor):
        return _global_index(index, x.placement) if x.is_global else Tensor(index)
    raise TypeError(f"{what}: index must be a tensor, got {type(index).__name__}")


def gather(self: Tensor, dim: int, index) -> Tensor:
    """``torch.gather``: ``out[i][j] = x[index[i][j]][j]`` (dim 0). Shapes: ``index`` has
    ``x``'s ndim; the output has ``index``'s shape. SBP: ``x`` whole on ``dim``; an index
    split on ``dim`` gives an output split there; another dim may be split in both where
    they share its size; ``(P, B) -> P``."""
    dim = norm_dim(dim, self.ndim)
    return dispatch("gather", self, _index_arg(self, index, "gather"), dim=dim)


def take_along_dim(self: Tensor, indices, dim=None) -> Tensor:
    """``torch.take_along_dim``: as :func:`gather` with broadcasting off ``dim``; ``dim``
    None flattens both. SBP as gather (a broadcast size-1 side stays B)."""
    indices = _index_arg(self, indices, "take_along_dim")
    if dim is None:
        return dispatch("take_along_dim", self.reshape(-1), indices.reshape(-1), dim=0)
    return dispatch("take_along_dim", self, indices, dim=norm_dim(dim, self.ndim))


def index_select(self: Tensor, dim: int, index) -> Tensor:
    """``torch.index_select``: rows ``index`` (1-D int64) of dim ``dim``. SBP: ``x`` whole
    on ``dim`` (other splits kept), or the index split (the output splits on ``dim``);
    ``(P, B) -> P``."""
    return dispatch("index_select", self, _index_arg(self, index, "index_select"),
                 dim=norm_dim(dim, self.ndim))


def scatter(self: Tensor, dim: int, index, src=None, *, value=None) -> Tensor:
    """``torch.scatter`` (out of place): ``out[index[i][j]][j] = src[i][j]`` (dim 0), or
    the number ``value``. SBP: ``x`` whole on ``dim``; another dim may be split in all
    inputs that share its size; ``(P, B, P) -> P`` with a tensor source."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter")
    src, value = _scatter_source(self, src, value, "scatter")
    if src is None:
        x = whole(self, (), partial_too=True)  # x + c is not linear in a summand
        return dispatch("scatter", x, index, dim=dim, value=value)
    return dispatch("scatter", self, index, src, dim=dim)


def _scatter_source(self: Tensor, src, value, name: str):
    """``(src tensor, None)`` or ``(None, value)`` from scatter's ``src``/``value``
    arguments (a number given as ``src`` is the value)."""
    if isinstance(src, numbers.Number) and value is None:
        src, value = None, src
    if src is None:
        if value is None:
            raise TypeError(f"{name} needs src (a tensor) or value (a number)")
        return None, value
    if not isinstance(src, (Tensor, torch.Tensor)):
        raise TypeError(f"{name}: src must be a tensor or a number, got {type(src).__name__}")
    return _index_arg(self, src, name), None


def scatter_add(self: Tensor, dim: int, index, src) -> Tensor:
    """``torch.scatter_add`` (out of place): ``out[index[i][j]][j] += src[i][j]`` (dim 0).
    SBP as :func:`scatter`, plus: an index and source split along ``dim`` give ``P`` (each
    rank adds its part; no communication)."""
    dim = norm_dim(dim, self.ndim)
    if isinstance(src, torch.Tensor):
        src = _index_arg(self, src, "scatter_add")
    return dispatch("scatter", self, _index_arg(self, index, "scatter_add"), src, dim=dim, add=True)


def _index_add(self, dim, index, source, *, alpha=1):
    """``torch.index_add``: ``out = x`` with ``alpha * source[k]`` added to slice
    ``index[k]`` of ``dim`` (``index`` 1-D int64, ``source`` of x's shape with
    ``len(index)`` along ``dim``). SBP: other dims split in x and source; ``(P, B, P) ->
    P``; an index and source split along ``dim`` add into a ``P`` output (no comm)."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "index_add")
    source = _index_arg(self, source, "index_add")
    return dispatch("index_add", self, index, source, dim=dim, alpha=alpha, add=True)


def _index_copy(self, dim, index, source):
    """``torch.index_copy``: slice ``index[k]`` of ``dim`` replaced by ``source[k]``
    (distinct indices, as torch needs for a deterministic result). SBP: other dims split
    in x and source; ``(P, B, P) -> P``."""
    dim = norm_dim(dim, self.ndim)
    return dispatch("index_copy", self, _index_arg(self, index, "index_copy"),
                 _index_arg(self, source, "index_copy"), dim=dim)


def _index_fill(self, dim, index, value):
    """``torch.index_fill``: slices ``index`` of ``dim`` set to ``value`` (a number or a
    1-element tensor, read as a number). SBP: other dims keep their split; ``P`` passes
    only for ``value == 0``."""
    dim = norm_dim(dim, self.ndim)
    value = number("index_fill", "value", value)
    return dispatch("index_fill", self, _index_arg(self, index, "index_fill"), dim=dim, value=value)


def _index_add_(self, dim, index, source, *, alpha=1):
    """In place :meth:`index_add` (``torch.Tensor.index_add_``). A global x keeps its
    layout: ``dim`` must not be split (a ValueError says how to box it); a P x takes the
    source's summands."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "index_add_")
    source = _index_arg(self, source, "index_add_")
    return dispatch_inplace(self, "index_add_", "index_add", (index, source),
                            {"dim": dim, "alpha": alpha, "add": True},
                            lambda s, i, src: s.index_add_(dim, i, src, alpha=alpha))


def _index_copy_(self, dim, index, source):
    """In place :meth:`index_copy` (layout kept, as :meth:`index_add_`)."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "index_copy_")
    source = _index_arg(self, source, "index_copy_")
    return dispatch_inplace(self, "index_copy_", "index_copy", (index, source), {"dim": dim},
                            lambda s, i, src: s.index_copy_(dim, i, src))


def _index_fill_(self, dim, index, value):
    """In place :meth:`index_fill` (layout kept; a P tensor only with ``value == 0``)."""
    dim = norm_dim(dim, self.ndim)
    value = number("index_fill_", "value", value)
    index = _index_arg(self, index, "index_fill_")
    return dispatch_inplace(self, "index_fill_", "index_fill", (index,),
                            {"dim": dim, "value": value},
                            lambda s, i: s.index_fill_(dim, i, value))


def _scatter_(self, dim, index, src=None, *, value=None):
    """In place :meth:`scatter` (``torch.Tensor.scatter_``): ``src`` a tensor or a
    number (or ``value=``). A global x keeps its layout: ``dim`` must not be split (a
    ValueError says how to box it); a P x takes a P source's summands, and a number is
    written only into a non-P x."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter_")
    src, value = _scatter_source(self, src, value, "scatter_")
    if src is None:
        value = number("scatter_", "value", value)
        return dispatch_inplace(self, "scatter_", "scatter", (index,), {"dim": dim, "value": value},
                                lambda s, i: s.scatter_(dim, i, value))
    return dispatch_inplace(self, "scatter_", "scatter", (index, src), {"dim": dim},
                            lambda s, i, v: s.scatter_(dim, i, v))


def _scatter_add_(self, dim, index, src):
    """In place :meth:`scatter_add` (``torch.Tensor.scatter_add_``; layout kept, as
    :meth:`scatter_`; a P x with an index and source split along ``dim`` adds each
    rank's part into its summand)."""
    dim = norm_dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter_add_")
    src = _index_arg(self, src, "scatter_add_")
    return dispatch_inplace(self, "scatter_add_", "scatter", (index, src),
                            {"dim": dim, "add": True},
                            lambda s, i, v: s.scatter_add_(dim, i, v))


# ---------------------------------------------------------------- Tensor methods and functions
method("__getitem__", view=True)(getitem)
method("__setitem__")(setitem)
method("gather")(gather)
method("take_along_dim")(take_along_dim)
method("index_select")(index_select)
method("scatter")(scatter)
method("scatter_add")(scatter_add)
method("scatter_")(_scatter_)
method("scatter_add_")(_scatter_add_)
method("index_add")(_index_add)
method("index_add_")(_index_add_)
method("index_copy")(_index_copy)
method("index_copy_")(_index_copy_)
method("index_fill")(_index_fill)
method("index_fill_")(_index_fill_)
function("one_hot")(one_hot)
for _name in ("addcdiv", "addcmul", "lerp", "tril", "triu"):
    method(f"{_name}_")(inplace_by_copy(_name))

