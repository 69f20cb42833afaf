"""Views and layout of dims: ``reshape``/``view``/``flatten``/``unflatten``,
``permute``/``transpose``/``t``/``movedim``, ``squeeze``/``unsqueeze``,
``expand``/``repeat``/``tile``/``repeat_interleave``, ``narrow``/``select``/``split``/
``chunk``/``unbind``, ``flip``/``roll``, ``tril``/``triu``, ``diagonal``/``diag``/
``diag_embed``/``trace``, ``clone``/``contiguous``, ``cat``/``stack``/``hstack``/``vstack``.

SBP rules (one mesh axis, one small rule per kind below): a dim that survives whole keeps
its split, renumbered where dims disappear (squeeze) or appear (unsqueeze, expand,
repeat); a permutation moves a split with its data; a reshape keeps a split where every
rank's shard is exactly its shard of the result, so no data moves (on N-D meshes a later
mesh axis may land on a later dim: (8, 4) (S(0), S(0)) on 2x2 as (2, 4, 4) is (S(0),
S(1)); :func:`sbpflow.ops.rules.reshape`); dims that are
flipped, rolled, sliced, triangled or on a diagonal must be whole; ``P`` passes through
all of them (they are linear). ``repeat_interleave`` with an int keeps a split ``dim``
split where the shards line up (each shard repeats its own rows); with a tensor of
repeats it reads them (a collective) and needs ``dim`` whole. Methods that return views
in torch return copies here where the layout needed a gather (writes into them raise).
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch

from ..placement import shard_slices
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .algorithms import all_b, b_result, whole
from .api import function, method
from .args import meta_of, norm_dim, norm_dims, size_args, want_tensor
from .dispatch import dispatch
from .index import getitem
from .registry import register
from .rules import concat as concat_rule
from .rules import keep, maps, permutation, reshape_check, reshape_local_shape
from .rules import reshape as reshape_rule

S, B, P = Split, broadcast, partial_sum


def _identity_rule(metas, attrs):
    """clone, contiguous: every layout maps to itself."""
    return maps((d, d) for d in range(metas[0].ndim))


def _squeeze_rule(metas, attrs):
    """Squeezed (size-1) dims must be whole; the others keep their split, renumbered."""
    dims = attrs["dims"]
    return maps((d, d - sum(1 for r in dims if r < d))
                 for d in range(metas[0].ndim) if d not in dims)


def _unsqueeze_rule(metas, attrs):
    dim = attrs["dim"]
    return maps((d, d + (d >= dim)) for d in range(metas[0].ndim))


def _expand_rule(metas, attrs):
    """expand / repeat: a dim that is neither expanded nor repeated keeps its split."""
    (m,) = metas
    lead = len(attrs["sizes"]) - m.ndim
    if "in_shape" in attrs:  # expand: the dim keeps its size
        keep = [d for d in range(m.ndim) if attrs["sizes"][d + lead] == m.shape[d]]
    else:  # repeat: repeated once
        keep = [d for d in range(m.ndim) if attrs["sizes"][d + lead] == 1]
    return maps((d, d + lead) for d in keep)


def _other_dims_rule(metas, attrs):
    """flip, roll, tril/triu: the dims in ``attrs['dims']`` (roll: all when None; tril:
    the last two) must be whole, the rest keep their split."""
    (m,) = metas
    dims = attrs.get("dims")
    if "diagonal" in attrs:
        dims = (m.ndim - 2, m.ndim - 1)
    if dims is None:
        dims = tuple(range(m.ndim))
    return maps((d, d) for d in range(m.ndim) if d not in dims)


def _repeat_rule(metas, attrs):
    (m,) = metas
    dim, reps = attrs["dim"], attrs["repeats"]
    whole = () if isinstance(reps, int) else (dim,)
    return keep(m.ndim, whole)


def _repeat_check(metas, attrs, ins, out, pl) -> bool:
    """An int repeat of a split ``dim``: every shard's rows ``[a, b)`` must become exactly
    the output shard ``[a * r, b * r)`` (true for even splits; 7 rows over 4 ranks are
    2,2,2,1 but 14 are 4,4,3,3: then the chooser boxes)."""
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


def _diagonal_rule(metas, attrs):
    (m,) = metas
    d1, d2 = attrs["dim1"], attrs["dim2"]
    rest = [d for d in range(m.ndim) if d not in (d1, d2)]
    return keep(m.ndim, (d1, d2), lambda d: rest.index(d))


def _diag_embed_rule(metas, attrs):
    (m,) = metas
    d1, d2 = attrs["dim1"], attrs["dim2"]
    rest = [d for d in range(m.ndim + 1) if d not in (d1, d2)]
    return keep(m.ndim, (m.ndim - 1,), lambda d: rest[d])


# ---------------------------------------------------------------- registered kernels
# --------------------------------------------------------------- shape
register("permute", permutation)(lambda a, *, dims: a.permute(dims))
register("clone", _identity_rule)(lambda a: a.clone())
register("contiguous", _identity_rule)(lambda a: a.contiguous())
register("squeeze", _squeeze_rule)(lambda a, *, dims: a.squeeze(dims))
register("unsqueeze", _unsqueeze_rule)(lambda a, *, dim: a.unsqueeze(dim))
register("flip", _other_dims_rule)(lambda a, *, dims: a.flip(dims))
register("roll", _other_dims_rule)(lambda a, *, shifts, dims: torch.roll(a, shifts, dims))
register("tril", _other_dims_rule)(lambda a, *, diagonal: torch.tril(a, diagonal))
register("triu", _other_dims_rule)(lambda a, *, diagonal: torch.triu(a, diagonal))


@register("reshape", reshape_rule, check=reshape_check)
def _reshape_kernel(a, *, shape, in_shape):
    # Each group of dims keeps the elements this shard holds (reshape_check made sure they
    # are exactly the output shard's), so the local reshape needs only the local shape.
    return a.reshape(reshape_local_shape(tuple(a.shape), in_shape, shape))


# --------------------------------------------------------------- joining
register("cat", concat_rule)(lambda *ts, dim: torch.cat(ts, dim=dim))


register("stack", concat_rule)(lambda *ts, dim, new_dim: torch.stack(ts, dim=dim))


@register("expand", _expand_rule)
def _expand_kernel(a, *, sizes, in_shape):
    # Dims that keep their size keep their local (shard) size: -1.
    lead = len(sizes) - len(in_shape)
    return a.expand([s if e < lead or in_shape[e - lead] != s else -1
                     for e, s in enumerate(sizes)])


register("repeat", _expand_rule)(lambda a, *, sizes: a.repeat(sizes))


@register("repeat_interleave", _repeat_rule, check=_repeat_check)
def _repeat_interleave_kernel(a, *, repeats, dim):
    if isinstance(repeats, int):
        return torch.repeat_interleave(a, repeats, dim)
    reps = torch.tensor(repeats, dtype=torch.int64, device=a.device)
    return torch.repeat_interleave(a, reps, dim, output_size=sum(repeats))


register("diagonal", _diagonal_rule)(
    lambda a, *, offset, dim1, dim2: torch.diagonal(a, offset, dim1, dim2))
register("diag_embed", _diag_embed_rule)(
    lambda a, *, offset, dim1, dim2: torch.diag_embed(a, offset, dim1, dim2))
register("diag", lambda metas, attrs: [(P, P)])(lambda a, *, diagonal: torch.diag(a, diagonal))


# ---------------------------------------------------------------- methods


def _permute(self, *dims):
    """``torch.permute``; a split dim moves with its data (no communication)."""
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    return dispatch("permute", self, dims=norm_dims(dims, self.ndim, "permute: dims"))


def _transpose(self, dim0: int, dim1: int):
    if self.ndim == 0:  # torch: dims 0 and -1 name the scalar itself
        for d in (dim0, dim1):
            if d not in (0, -1):
                raise IndexError(f"transpose: dim {d} is out of range for a 0-d tensor "
                                 f"(valid: -1, 0)")
        return self
    dim0 = norm_dim(dim0, self.ndim, "transpose: dim0")
    dim1 = norm_dim(dim1, self.ndim, "transpose: dim1")
    dims = list(range(self.ndim))
    dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return dispatch("permute", self, dims=tuple(dims))


def _t(self):
    if self.ndim > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dims, got {self.ndim}")
    return self if self.ndim < 2 else _transpose(self, 0, 1)


def _reshape(self, *shape, **kwargs):
    """``torch.reshape(x, shape)`` / ``x.reshape(*shape)`` / ``x.view(*shape)``; ``shape=``
    may be given by keyword (``sbpflow.reshape(x, shape=(2, 3))``, as torch and OneFlow
    accept). One dim may be -1.

    SBP: a split that maps onto a dim of the result whose shards hold the same elements
    keeps its data where it is (no collective; on a 2-D mesh the mesh axes may land on
    different result dims: ``(8, 4)`` ``(S(0), S(0))`` on 2x2 viewed as ``(2, 4, 4)`` is
    ``(S(0), S(1))``); otherwise the input is boxed first (see
    :func:`sbpflow.ops.rules.reshape`). ``P`` stays ``P``.

    Raises:
        TypeError: both positional sizes and ``shape=``, or another keyword.
        ValueError: more than one -1, or a shape of another element count (names both).
    """
    if kwargs:
        if set(kwargs) != {"shape"} or shape:
            raise TypeError(f"reshape/view take the new shape positionally or as shape=, not "
                            f"both or other keywords; got sizes {shape} and keywords "
                            f"{sorted(kwargs)}")
        shape = (kwargs["shape"],)
    shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
    if shape.count(-1) > 1:
        raise ValueError(f"reshape: only one dim can be -1, got {shape}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(self.numel() // known if s == -1 else s for s in shape)
    if math.prod(shape) != self.numel():
        raise ValueError(f"reshape: shape {shape} is invalid for a tensor of shape "
                         f"{tuple(self.shape)} ({self.numel()} elements)")
    return dispatch("reshape", self, shape=shape, in_shape=tuple(self.shape))


def _flatten(self, start_dim: int = 0, end_dim: int = -1):
    s = norm_dim(start_dim, self.ndim, "flatten: start_dim")
    e = norm_dim(end_dim, self.ndim, "flatten: end_dim")
    shape = (*self.shape[:s], math.prod(self.shape[s:e + 1]), *self.shape[e + 1:])
    return _reshape(self, shape)


def cat(tensors, dim: int = 0) -> Tensor:
    """``torch.cat``: join along ``dim``; a dim other than ``dim`` that every input splits
    stays split, summands (P) join to summands, otherwise the inputs are gathered."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat needs at least one tensor")
    return dispatch("cat", *tensors, dim=norm_dim(dim, tensors[0].ndim, "cat: dim"))


def stack(tensors, dim: int = 0) -> Tensor:
    """``torch.stack``: join along a new dim ``dim`` (layouts as :func:`cat`)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack needs at least one tensor")
    return dispatch("stack", *tensors, dim=norm_dim(dim, tensors[0].ndim + 1, "stack: dim"),
                    new_dim=True)


def squeeze(self: Tensor, dim=None) -> Tensor:
    """``torch.squeeze``: drop dims of size 1 (``dim``: int, tuple, or None for all).
    Global sizes decide (a shard of size 1 of a longer dim is never squeezed). SBP: the
    squeezed dims are whole, the others keep their split, renumbered; P passes."""
    dims = range(self.ndim) if dim is None else norm_dims(dim, self.ndim, "squeeze dim")
    dims = tuple(d for d in dims if self.ndim and self.shape[d] == 1)
    return dispatch("squeeze", self, dims=dims)


def unsqueeze(self: Tensor, dim: int) -> Tensor:
    """``torch.unsqueeze``: a new dim of size 1 at ``dim`` (in ``[-ndim-1, ndim]``). SBP:
    splits are kept, renumbered; P passes."""
    return dispatch("unsqueeze", self, dim=norm_dim(dim, self.ndim + 1, "unsqueeze dim"))


def expand(self: Tensor, *sizes) -> Tensor:
    """``torch.Tensor.expand``: broadcast size-1 dims (and new leading dims) to ``sizes``
    (-1 keeps a dim). SBP: a dim that keeps its size keeps its split; P passes.

    Raises ``RuntimeError`` as torch for sizes that do not broadcast."""
    sizes = tuple(meta_of(self).expand(*size_args(sizes)).shape)
    return dispatch("expand", self, sizes=sizes, in_shape=tuple(self.shape))


def expand_as(self: Tensor, other: Tensor) -> Tensor:
    """``torch.Tensor.expand_as``: :func:`expand` to ``other.shape``."""
    return expand(self, tuple(want_tensor("expand_as", "other", other).shape))


def repeat(self: Tensor, *sizes) -> Tensor:
    """``torch.Tensor.repeat``: tile by ``sizes`` (one per dim, more for new leading dims).
    SBP: a dim repeated once keeps its split; P passes."""
    sizes = size_args(sizes)
    meta_of(self).repeat(sizes)  # torch's checks and messages
    return dispatch("repeat", self, sizes=tuple(int(s) for s in sizes))


def unflatten(self: Tensor, dim: int, sizes) -> Tensor:
    """``torch.unflatten``: split dim ``dim`` into ``sizes`` (one may be -1); a reshape, with
    its layout rule (a split dim survives when it is carried whole)."""
    shape = tuple(meta_of(self).unflatten(norm_dim(dim, self.ndim), tuple(sizes)).shape)
    return self.reshape(shape)


def narrow(self: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``torch.narrow``: elements ``start .. start + length - 1`` of dim ``dim`` (``start``
    may be negative). SBP as a slice (:func:`getitem`).

    Raises ``IndexError`` when the range does not fit in the dim."""
    dim = norm_dim(dim, self.ndim)
    n = self.shape[dim]
    at = start + n if start < 0 else start
    if not 0 <= at <= n or length < 0 or at + length > n:
        raise IndexError(f"narrow: start {start} and length {length} do not fit dim {dim} of "
                         f"size {n}")
    start = at
    return getitem(self, (slice(None),) * dim + (slice(start, start + length),))


def _pieces(x: Tensor, dim: int, sizes) -> tuple:
    x = whole(x, {dim})  # one gather for all the pieces, not one per piece
    out, at = [], 0
    for s in sizes:
        out.append(getitem(x, (slice(None),) * dim + (slice(at, at + s),)))
        at += s
    return tuple(out)


def split(self: Tensor, split_size_or_sections, dim: int = 0) -> tuple:
    """``torch.split``: pieces of ``split_size_or_sections`` (an int: equal pieces, the
    last smaller; a list: those sizes) along ``dim``. A split ``dim`` is gathered once."""
    dim = norm_dim(dim, self.ndim)
    sizes = [p.shape[dim] for p in meta_of(self).split(split_size_or_sections, dim)]
    return _pieces(self, dim, sizes)


def chunk(self: Tensor, chunks: int, dim: int = 0) -> tuple:
    """``torch.chunk``: ``chunks`` pieces (or fewer, as torch) along ``dim``."""
    dim = norm_dim(dim, self.ndim)
    sizes = [p.shape[dim] for p in meta_of(self).chunk(chunks, dim)]
    return _pieces(self, dim, sizes)


def flip(self: Tensor, *dims) -> Tensor:
    """``torch.flip``: reverse ``dims``. SBP: flipped dims whole, others keep splits; P
    passes."""
    return dispatch("flip", self, dims=norm_dims(size_args(dims), self.ndim))


def roll(self: Tensor, shifts, dims=None) -> Tensor:
    """``torch.roll``: shift by ``shifts`` along ``dims`` (None: the flattened tensor).
    SBP: rolled dims whole (all of them when ``dims`` is None); P passes."""
    if dims is None:
        return dispatch("roll", self, shifts=shifts, dims=None)
    dims = norm_dims(dims, self.ndim)
    shifts = (shifts,) if isinstance(shifts, numbers.Integral) else tuple(shifts)
    if len(shifts) != len(dims):
        raise ValueError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    return dispatch("roll", self, shifts=shifts, dims=dims)


def _tri(name):
    def fn(self: Tensor, diagonal: int = 0) -> Tensor:
        if self.ndim < 2:
            raise ValueError(f"{name} needs a tensor of at least 2 dims, got shape "
                             f"{tuple(self.shape)}")
        return dispatch(name, self, diagonal=int(diagonal))

    fn.__name__ = name
    fn.__doc__ = (f"``torch.{name}`` over the last two dims (``diagonal``: 0 main, > 0 above, "
                  f"< 0 below). SBP: the last two dims whole, batch dims keep splits; P passes.")
    return fn


def clone(self: Tensor) -> Tensor:
    """``torch.clone``: a copy with the same layout (differentiable)."""
    return dispatch("clone", self)


def contiguous(self: Tensor) -> Tensor:
    """``torch.Tensor.contiguous``: the same layout, local shard made contiguous."""
    return dispatch("contiguous", self)


def _select(self, dim: int, index: int):
    dim = norm_dim(dim, self.ndim, "select: dim")
    return self[(slice(None),) * dim + (index,)]


def _unbind(self, dim: int = 0):
    return tuple(_select(self, dim, i) for i in range(self.shape[dim]))


def _tile(self, *dims):
    dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    dims = (1,) * (self.ndim - len(dims)) + tuple(dims)
    return self.repeat(*dims)


def _movedim(self, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src = list(norm_dims(src, self.ndim, "movedim: source"))
    dst = list(norm_dims(dst, self.ndim, "movedim: destination"))
    rest = [d for d in range(self.ndim) if d not in src]
    order = [None] * self.ndim
    for s, d in zip(src, dst):
        order[d] = s
    it = iter(rest)
    order = [o if o is not None else next(it) for o in order]
    return self.permute(*order)


def concat(tensors, dim: int = 0) -> Tensor:
    """Alias of :func:`sbpflow.cat`."""
    return cat(tensors, dim)


concatenate = concat


def hstack(tensors) -> Tensor:
    """``torch.hstack``: along dim 1 (dim 0 for 1-D tensors)."""
    tensors = list(tensors)
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


def vstack(tensors) -> Tensor:
    """``torch.vstack``: along dim 0, 1-D tensors as rows."""
    return cat([t.reshape(1, -1) if t.ndim == 1 else t for t in tensors], 0)


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
        counts = all_b(self)
        local = torch.repeat_interleave(counts._local)
        return Tensor(local) if self.is_local else b_result(local, self.placement)
    x = self
    if dim is None:
        x, dim = self.reshape(-1), 0
    dim = norm_dim(dim, x.ndim)
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
    return dispatch("repeat_interleave", x, repeats=reps, dim=dim)


def _diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """``torch.diagonal``: the diagonal of dims ``dim1``/``dim2`` as the last dim (length
    of the ``offset`` diagonal). SBP: the other dims keep their split (renumbered), the two
    dims are whole; ``P`` passes.

    Raises:
        ValueError: ``dim1 == dim2``."""
    d1, d2 = norm_dim(dim1, self.ndim), norm_dim(dim2, self.ndim)
    if d1 == d2:
        raise ValueError(f"diagonal: dim1 and dim2 must differ, got {dim1} and {dim2}")
    return dispatch("diagonal", self, offset=int(offset), dim1=d1, dim2=d2)


def _diag_embed(self, offset: int = 0, dim1: int = -2, dim2: int = -1):
    """``torch.diag_embed``: the last dim of x (``(*, n)``) on the ``offset`` diagonal of
    new dims ``dim1``/``dim2`` (size ``n + |offset|``). SBP: batch dims keep their split;
    ``P`` passes.

    Raises:
        ValueError: ``dim1 == dim2``."""
    d1, d2 = norm_dim(dim1, self.ndim + 1), norm_dim(dim2, self.ndim + 1)
    if d1 == d2:
        raise ValueError(f"diag_embed: dim1 and dim2 must differ, got {dim1} and {dim2}")
    return dispatch("diag_embed", self, offset=int(offset), dim1=d1, dim2=d2)


def _diag(self, diagonal: int = 0):
    """``torch.diag``: a 1-D x gives the ``(n + |d|, n + |d|)`` matrix with x on diagonal
    ``d``; a 2-D x gives its diagonal ``d`` (1-D). SBP: ``P`` passes, splits are gathered.

    Raises:
        ValueError: x is not 1-D or 2-D."""
    if self.ndim not in (1, 2):
        raise ValueError(f"diag: expected a 1-D or 2-D tensor, got shape {tuple(self.shape)}")
    return dispatch("diag", self, diagonal=int(diagonal))


def _trace(self):
    """``torch.trace``: the sum of the main diagonal of a 2-D x (ints sum to int64). SBP:
    the diagonal's sum (a split diagonal gives ``P``)."""
    if self.ndim != 2:
        raise ValueError(f"trace: expected a 2-D tensor, got shape {tuple(self.shape)}")
    return _diagonal(self).sum()


# ---------------------------------------------------------------- Tensor methods and functions
method("permute", view=True)(_permute)
method("transpose", view=True)(_transpose)
method("swapaxes", "swapdims", view=True)(lambda self, a, b: _transpose(self, a, b))
method("t", view=True)(_t)
method("T", function=False)(property(_t))
method("reshape")(_reshape)
method("view", view=True)(_reshape)
method("view_as", view=True)(
    lambda self, other: _reshape(self, *want_tensor("view_as", "other", other).shape))
method("reshape_as")(
    lambda self, other: _reshape(self, *want_tensor("reshape_as", "other", other).shape))
method("flatten")(_flatten)
method("unflatten", view=True)(unflatten)
method("squeeze", view=True)(squeeze)
method("unsqueeze", view=True)(unsqueeze)
method("expand", view=True)(expand)
method("expand_as", view=True)(expand_as)
method("repeat")(repeat)
method("tile")(_tile)
method("repeat_interleave")(_repeat_interleave)
method("narrow", view=True)(narrow)
method("select", view=True)(_select)
method("split", view=True)(split)
method("chunk", view=True)(chunk)
method("unbind", view=True)(_unbind)
method("movedim", "moveaxis", view=True)(_movedim)
method("flip")(flip)
method("roll")(roll)
method("tril")(_tri("tril"))
method("triu")(_tri("triu"))
method("diagonal", view=True)(_diagonal)
method("diag_embed")(_diag_embed)
method("diag")(_diag)
method("trace")(_trace)
method("clone")(clone)
method("contiguous")(contiguous)
function("cat")(cat)
function("stack")(stack)
function("concat", "concatenate")(concat)
function("hstack")(hstack)
function("vstack")(vstack)

