"""Shape and indexing ops (issue 3): squeeze, unsqueeze, expand(_as), repeat, unflatten,
split, chunk, narrow, ``x[...]`` and ``x[...] = v``, gather, scatter(_add), index_select,
take_along_dim, flip, roll, tril, triu, contiguous, clone, one_hot, topk, sort.

Every op mirrors the torch function of the same name, on local tensors (plain torch) and
on global tensors of every layout. SBP rules (one mesh axis, one small rule function per
family below, expanded over N-D meshes by the registry):

* a dim that is indexed, sliced, flipped, rolled, gathered or sorted must be whole on the
  axis (``B``); every other dim keeps its split, renumbered where dims disappear
  (squeeze, int indexing) or appear (unsqueeze, ``None``, expand, repeat);
* index tensors may be split along the dims they contribute to the output (an index
  split over the gathered dim gives an output split there, with no communication);
* ``P`` passes through the linear ops (slicing and indexing, expand, repeat, flip, roll,
  tril/triu, gather, index_select, scatter/scatter_add with a ``P`` source), not through
  sort/topk values (a ``P`` input is summed first);
* ``topk`` over a split dim: each rank takes its shard's top k, the k candidates per
  shard (values and global indices) are all-gathered and reduced, instead of gathering the
  input; ``scatter_add`` of an index and source split along ``dim`` gives ``P`` with no
  communication (the embedding-backward pattern).

``x[...] = v`` writes in place into each rank's shard: basic slices and ints along a split
dim are intersected with each shard; tensor indices need the dims they index whole; a
``P`` tensor raises (no rank holds the value to overwrite).
"""

from __future__ import annotations

import numbers

import torch

from ..distributed import _comm, ensure_groups
from ..placement import shard_shape as _shard_shape
from ..sbp import Split, broadcast, format_nd_sbp, partial_sum
from ..tensor import Tensor
from ._dispatch import apply, check_writable
from ._registry import register

__all__ = ["one_hot"]

S, B, P = Split, broadcast, partial_sum


# ====================================================================== helpers


def _dim(d, ndim: int, what: str = "dim") -> int:
    """``d`` normalised to ``[0, ndim)`` (``[0, 1)`` for a 0-dim tensor), as torch does.

    Raises ``IndexError`` (torch's type) when out of range, ``TypeError`` when not an int.
    """
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {d!r}")
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"{what} out of range: expected in [{-n}, {n - 1}] for a tensor of "
                         f"{ndim} dims, got {d}")
    return int(d) % n


def _dims(dims, ndim: int, what: str = "dims") -> tuple[int, ...]:
    dims = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
    out = tuple(_dim(d, ndim, what) for d in dims)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {dims} repeat a dim")
    return out


def _sizes(args) -> tuple:
    """``f(2, 3)`` and ``f((2, 3))`` both give ``(2, 3)``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _meta(x: Tensor) -> torch.Tensor:
    return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")


def _whole(x: Tensor, dims, partial_too: bool = False) -> Tensor:
    """``x`` boxed so that no mesh axis splits a dim in ``dims`` (those axes become B; with
    ``partial_too`` P axes too). Local tensors and layouts that already fit are returned."""
    if x.is_local:
        return x
    want = tuple(B if (s.is_split() and s.dim in dims) or (partial_too and s.is_partial())
                 else s for s in x.sbp)
    return x if want == x.sbp else x.to_global(sbp=want)


def _maps(pairs, linear: bool = True):
    """One-input signatures ``S(d) -> S(e)`` for ``d -> e`` in ``pairs``, plus ``P -> P``."""
    return ([(P, P)] if linear else []) + [(S(d), S(e)) for d, e in pairs]


# ====================================================================== rules (one mesh axis)


def _identity_rule(metas, attrs):
    """clone, contiguous: every layout maps to itself."""
    return _maps((d, d) for d in range(metas[0].ndim))


def _squeeze_rule(metas, attrs):
    """Squeezed (size-1) dims must be whole; the others keep their split, renumbered."""
    dims = attrs["dims"]
    return _maps((d, d - sum(1 for r in dims if r < d))
                 for d in range(metas[0].ndim) if d not in dims)


def _unsqueeze_rule(metas, attrs):
    dim = attrs["dim"]
    return _maps((d, d + (d >= dim)) for d in range(metas[0].ndim))


def _expand_rule(metas, attrs):
    """expand / repeat: a dim that is neither expanded nor repeated keeps its split."""
    (m,) = metas
    lead = len(attrs["sizes"]) - m.ndim
    if "in_shape" in attrs:  # expand: the dim keeps its size
        keep = [d for d in range(m.ndim) if attrs["sizes"][d + lead] == m.shape[d]]
    else:  # repeat: repeated once
        keep = [d for d in range(m.ndim) if attrs["sizes"][d + lead] == 1]
    return _maps((d, d + lead) for d in keep)


def _other_dims_rule(metas, attrs):
    """flip, roll, tril/triu: the dims in ``attrs['dims']`` (roll: all when None; tril:
    the last two) must be whole, the rest keep their split."""
    (m,) = metas
    dims = attrs.get("dims")
    if "diagonal" in attrs:
        dims = (m.ndim - 2, m.ndim - 1)
    if dims is None:
        dims = tuple(range(m.ndim))
    return _maps((d, d) for d in range(m.ndim) if d not in dims)


def _one_hot_rule(metas, attrs):
    return _maps(((d, d) for d in range(metas[0].ndim)), linear=False)


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


# ====================================================================== registered kernels

register("clone", _identity_rule)(lambda a: a.clone())
register("contiguous", _identity_rule)(lambda a: a.contiguous())
register("squeeze", _squeeze_rule)(lambda a, *, dims: a.squeeze(dims))
register("unsqueeze", _unsqueeze_rule)(lambda a, *, dim: a.unsqueeze(dim))
register("flip", _other_dims_rule)(lambda a, *, dims: a.flip(dims))
register("roll", _other_dims_rule)(lambda a, *, shifts, dims: torch.roll(a, shifts, dims))
register("tril", _other_dims_rule)(lambda a, *, diagonal: torch.tril(a, diagonal))
register("triu", _other_dims_rule)(lambda a, *, diagonal: torch.triu(a, diagonal))
register("one_hot", _one_hot_rule)(
    lambda a, *, num_classes: torch.nn.functional.one_hot(a, num_classes))
register("gather", _gather_rule)(lambda a, i, *, dim: torch.gather(a, dim, i))
register("take_along_dim", _take_along_dim_rule)(
    lambda a, i, *, dim: torch.take_along_dim(a, i, dim))
register("index_select", _index_select_rule)(lambda a, i, *, dim: torch.index_select(a, dim, i))


@register("expand", _expand_rule)
def _expand_kernel(a, *, sizes, in_shape):
    # Dims that keep their size keep their local (shard) size: -1.
    lead = len(sizes) - len(in_shape)
    return a.expand([s if e < lead or in_shape[e - lead] != s else -1
                     for e, s in enumerate(sizes)])


register("repeat", _expand_rule)(lambda a, *, sizes: a.repeat(sizes))


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


# ====================================================================== indexing


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
    return apply("getitem", self, *tensors, spec=spec)


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
    region = tuple(_getitem_kernel(_meta(self), *(_meta(t) for t in idx), spec=spec).shape)
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


# ====================================================================== shape ops


def squeeze(self: Tensor, dim=None) -> Tensor:
    """``torch.squeeze``: drop dims of size 1 (``dim``: int, tuple, or None for all).
    Global sizes decide (a shard of size 1 of a longer dim is never squeezed). SBP: the
    squeezed dims are whole, the others keep their split, renumbered; P passes."""
    dims = range(self.ndim) if dim is None else _dims(dim, self.ndim, "squeeze dim")
    dims = tuple(d for d in dims if self.ndim and self.shape[d] == 1)
    return apply("squeeze", self, dims=dims)


def unsqueeze(self: Tensor, dim: int) -> Tensor:
    """``torch.unsqueeze``: a new dim of size 1 at ``dim`` (in ``[-ndim-1, ndim]``). SBP:
    splits are kept, renumbered; P passes."""
    return apply("unsqueeze", self, dim=_dim(dim, self.ndim + 1, "unsqueeze dim"))


def expand(self: Tensor, *sizes) -> Tensor:
    """``torch.Tensor.expand``: broadcast size-1 dims (and new leading dims) to ``sizes``
    (-1 keeps a dim). SBP: a dim that keeps its size keeps its split; P passes.

    Raises ``RuntimeError`` as torch for sizes that do not broadcast."""
    sizes = tuple(_meta(self).expand(*_sizes(sizes)).shape)
    return apply("expand", self, sizes=sizes, in_shape=tuple(self.shape))


def expand_as(self: Tensor, other: Tensor) -> Tensor:
    """``torch.Tensor.expand_as``: :func:`expand` to ``other.shape``."""
    return expand(self, tuple(other.shape))


def repeat(self: Tensor, *sizes) -> Tensor:
    """``torch.Tensor.repeat``: tile by ``sizes`` (one per dim, more for new leading dims).
    SBP: a dim repeated once keeps its split; P passes."""
    sizes = _sizes(sizes)
    _meta(self).repeat(sizes)  # torch's checks and messages
    return apply("repeat", self, sizes=tuple(int(s) for s in sizes))


def unflatten(self: Tensor, dim: int, sizes) -> Tensor:
    """``torch.unflatten``: split dim ``dim`` into ``sizes`` (one may be -1); a reshape, with
    its layout rule (a split dim survives when it is carried whole)."""
    shape = tuple(_meta(self).unflatten(_dim(dim, self.ndim), tuple(sizes)).shape)
    return self.reshape(shape)


def narrow(self: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``torch.narrow``: elements ``start .. start + length - 1`` of dim ``dim`` (``start``
    may be negative). SBP as a slice (:func:`getitem`).

    Raises ``IndexError`` when the range does not fit in the dim."""
    dim = _dim(dim, self.ndim)
    n = self.shape[dim]
    at = start + n if start < 0 else start
    if not 0 <= at <= n or length < 0 or at + length > n:
        raise IndexError(f"narrow: start {start} and length {length} do not fit dim {dim} of "
                         f"size {n}")
    start = at
    return getitem(self, (slice(None),) * dim + (slice(start, start + length),))


def _pieces(x: Tensor, dim: int, sizes) -> tuple:
    x = _whole(x, {dim})  # one gather for all the pieces, not one per piece
    out, at = [], 0
    for s in sizes:
        out.append(getitem(x, (slice(None),) * dim + (slice(at, at + s),)))
        at += s
    return tuple(out)


def split(self: Tensor, split_size_or_sections, dim: int = 0) -> tuple:
    """``torch.split``: pieces of ``split_size_or_sections`` (an int: equal pieces, the
    last smaller; a list: those sizes) along ``dim``. A split ``dim`` is gathered once."""
    dim = _dim(dim, self.ndim)
    sizes = [p.shape[dim] for p in _meta(self).split(split_size_or_sections, dim)]
    return _pieces(self, dim, sizes)


def chunk(self: Tensor, chunks: int, dim: int = 0) -> tuple:
    """``torch.chunk``: ``chunks`` pieces (or fewer, as torch) along ``dim``."""
    dim = _dim(dim, self.ndim)
    sizes = [p.shape[dim] for p in _meta(self).chunk(chunks, dim)]
    return _pieces(self, dim, sizes)


def flip(self: Tensor, *dims) -> Tensor:
    """``torch.flip``: reverse ``dims``. SBP: flipped dims whole, others keep splits; P
    passes."""
    return apply("flip", self, dims=_dims(_sizes(dims), self.ndim))


def roll(self: Tensor, shifts, dims=None) -> Tensor:
    """``torch.roll``: shift by ``shifts`` along ``dims`` (None: the flattened tensor).
    SBP: rolled dims whole (all of them when ``dims`` is None); P passes."""
    if dims is None:
        return apply("roll", self, shifts=shifts, dims=None)
    dims = _dims(dims, self.ndim)
    shifts = (shifts,) if isinstance(shifts, numbers.Integral) else tuple(shifts)
    if len(shifts) != len(dims):
        raise ValueError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    return apply("roll", self, shifts=shifts, dims=dims)


def _tri(name):
    def fn(self: Tensor, diagonal: int = 0) -> Tensor:
        if self.ndim < 2:
            raise ValueError(f"{name} needs a tensor of at least 2 dims, got shape "
                             f"{tuple(self.shape)}")
        return apply(name, self, diagonal=int(diagonal))

    fn.__name__ = name
    fn.__doc__ = (f"``torch.{name}`` over the last two dims (``diagonal``: 0 main, > 0 above, "
                  f"< 0 below). SBP: the last two dims whole, batch dims keep splits; P passes.")
    return fn


def clone(self: Tensor) -> Tensor:
    """``torch.clone``: a copy with the same layout (differentiable)."""
    return apply("clone", self)


def contiguous(self: Tensor) -> Tensor:
    """``torch.Tensor.contiguous``: the same layout, local shard made contiguous."""
    return apply("contiguous", self)


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """``torch.nn.functional.one_hot``: int64 ``(*shape)`` -> int64 ``(*shape, classes)``.
    ``num_classes=-1`` takes ``max + 1`` (collective on a global tensor). SBP: splits kept.

    Raises ``TypeError`` for a non-int64 input (as torch)."""
    if tensor.dtype != torch.int64:
        raise TypeError(f"one_hot is only applicable to index tensors (int64), got {tensor.dtype}")
    if num_classes == -1:
        num_classes = int(tensor.amax().item()) + 1 if tensor.numel() else 0
    if tensor.is_global and any(s.is_partial() for s in tensor.sbp):
        tensor = _whole(tensor, (), partial_too=True)
    return apply("one_hot", tensor, num_classes=int(num_classes))


# ====================================================================== gather / scatter


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
    dim = _dim(dim, self.ndim)
    return apply("gather", self, _index_arg(self, index, "gather"), dim=dim)


def take_along_dim(self: Tensor, indices, dim=None) -> Tensor:
    """``torch.take_along_dim``: as :func:`gather` with broadcasting off ``dim``; ``dim``
    None flattens both. SBP as gather (a broadcast size-1 side stays B)."""
    indices = _index_arg(self, indices, "take_along_dim")
    if dim is None:
        return apply("take_along_dim", self.reshape(-1), indices.reshape(-1), dim=0)
    return apply("take_along_dim", self, indices, dim=_dim(dim, self.ndim))


def index_select(self: Tensor, dim: int, index) -> Tensor:
    """``torch.index_select``: rows ``index`` (1-D int64) of dim ``dim``. SBP: ``x`` whole
    on ``dim`` (other splits kept), or the index split (the output splits on ``dim``);
    ``(P, B) -> P``."""
    return apply("index_select", self, _index_arg(self, index, "index_select"),
                 dim=_dim(dim, self.ndim))


def scatter(self: Tensor, dim: int, index, src=None, *, value=None) -> Tensor:
    """``torch.scatter`` (out of place): ``out[index[i][j]][j] = src[i][j]`` (dim 0), or
    the number ``value``. SBP: ``x`` whole on ``dim``; another dim may be split in all
    inputs that share its size; ``(P, B, P) -> P`` with a tensor source."""
    dim = _dim(dim, self.ndim)
    index = _index_arg(self, index, "scatter")
    src, value = _scatter_source(self, src, value, "scatter")
    if src is None:
        x = _whole(self, (), partial_too=True)  # x + c is not linear in a summand
        return apply("scatter", x, index, dim=dim, value=value)
    return apply("scatter", self, index, src, dim=dim)


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
    dim = _dim(dim, self.ndim)
    if isinstance(src, torch.Tensor):
        src = _index_arg(self, src, "scatter_add")
    return apply("scatter", self, _index_arg(self, index, "scatter_add"), src, dim=dim, add=True)


# ====================================================================== sort / topk


def _outside(x: Tensor, shape, dtype) -> torch.Tensor:
    local = x._local
    out = torch.empty((0,) * max(len(shape), 1), dtype=dtype, device=local.device)
    if local.requires_grad and out.is_floating_point():
        out = out + local.reshape(-1)[:0].sum()
    return out


def sort(self: Tensor, dim: int = -1, descending: bool = False, stable: bool = False):
    """``torch.sort``: ``(values, indices)`` along ``dim``. SBP: ``dim`` whole (a split
    ``dim`` is gathered) and P summed first (B); other dims keep their splits."""
    dim = _dim(dim, self.ndim)
    if self.is_local:
        v, i = torch.sort(self._local, dim=dim, descending=descending, stable=stable)
        return torch.return_types.sort((Tensor(v), Tensor(i)))
    x = _whole(self, {dim}, partial_too=True)
    pl = x.placement
    if pl.coord() is None:
        v, i = _outside(x, x.shape, x.dtype), _outside(x, x.shape, torch.int64)
    else:
        v, i = torch.sort(x._local, dim=dim, descending=descending, stable=stable)
    return torch.return_types.sort((Tensor(v, pl, x.sbp, x.shape), Tensor(i, pl, x.sbp, x.shape)))


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
            v = _comm.all_gather(v, members, dim, sizes, axis=a)
            i = _comm.all_gather(i, members, dim, sizes, axis=a)
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
            gv = _comm.all_reduce(gv, pl.axis_ranks(a, coord), axis=a)
        gx = gv.new_zeros(local_shape)
        n = local_shape[dim]
        if n:
            pos = i - lo
            inside = (pos >= 0) & (pos < n)
            gx.scatter_add_(dim, pos.clamp(0, n - 1), gv * inside)
        return gx, None, None, None, None, None, None, None


def topk(self: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """``torch.topk``: the ``k`` largest (``largest=False``: smallest) along ``dim`` as
    ``(values, indices)``, int64 indices into the global dim.

    SBP: P is summed first (B); other dims keep their splits; over a split ``dim`` each
    rank takes its shard's top k and only the k candidates per shard are all-gathered (not
    the input); the outputs are then B on those axes. Global results are always sorted.

    Raises ``ValueError`` when ``k`` exceeds the dim's size.
    """
    dim = _dim(dim, self.ndim)
    n = self.shape[dim] if self.ndim else 1
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} is out of range for dim {dim} of size {n}")
    if self.is_local:
        v, i = torch.topk(self._local, k, dim, largest, sorted)
        return torch.return_types.topk((Tensor(v), Tensor(i)))
    x = _whole(self, (), partial_too=True)
    pl = x.placement
    axes = tuple(a for a, s in enumerate(x.sbp) if s.is_split() and s.dim == dim)
    for a in axes:  # every rank makes the groups, in the same order
        ensure_groups(pl.axis_groups(a))
    sbp = tuple(B if a in axes else s for a, s in enumerate(x.sbp))
    shape = tuple(k if d == dim else s for d, s in enumerate(x.shape))
    if pl.coord() is None:
        v, i = _outside(x, shape, x.dtype), _outside(x, shape, torch.int64)
    elif axes:
        v, i = _SplitTopK.apply(x._local, k, dim, largest, pl, x.sbp, tuple(x.shape), axes)
    else:
        v, i = torch.topk(x._local, k, dim, largest, sorted=True)
    return torch.return_types.topk((Tensor(v, pl, sbp, shape), Tensor(i, pl, sbp, shape)))


# Tensor methods contributed by this module (installed by sbpflow.ops._methods.install).
METHODS: dict = {
    "__getitem__": getitem,
    "__setitem__": setitem,
    "chunk": chunk,
    "clone": clone,
    "contiguous": contiguous,
    "expand": expand,
    "expand_as": expand_as,
    "flip": flip,
    "gather": gather,
    "index_select": index_select,
    "narrow": narrow,
    "repeat": repeat,
    "roll": roll,
    "scatter": scatter,
    "scatter_add": scatter_add,
    "sort": sort,
    "split": split,
    "squeeze": squeeze,
    "take_along_dim": take_along_dim,
    "topk": topk,
    "tril": _tri("tril"),
    "triu": _tri("triu"),
    "unflatten": unflatten,
    "unsqueeze": unsqueeze,
}
