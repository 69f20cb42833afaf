"""SBP rule generators for one mesh axis (see :mod:`sbpflow.ops.registry`).

Rules are generated from specs rather than written per op:

* :func:`elementwise` from torch's broadcasting: splitting output dim ``d`` splits every
  input that has ``d`` at full size and replicates the inputs broadcast along it; a
  ``linear`` argument says which partial-sum signatures are exact;
* :func:`einsum` from an einsum string (DTensor's ``_mm_like_strategy``): a letter kept
  in the output may be split everywhere it appears; a contracted letter split in every
  input gives P; a matmul is linear in each operand, so (P, B) -> P and (B, P) -> P;
* :func:`reduction`: a reduced split dim gives P (sum), a kept one stays split;
* :func:`maps` / :func:`keep`: one-input ops that move dims (a split follows its dim,
  the dims an op works along must be whole), plus P -> P for the linear ones.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Sequence

from ..placement import shard_slices
from ..sbp import SBP, Split, broadcast, partial_sum
from .registry import Meta

__all__ = ["concat", "elementwise", "einsum", "keep", "maps", "matmul_spec", "permutation",
           "reduced_dim", "reduction", "reshape", "reshape_carriers", "reshape_check",
           "reshape_groups", "reshape_local_shape"]


def _broadcast_shape(metas: Sequence[Meta]) -> int:
    return max((m.ndim for m in metas), default=0)


def elementwise(linear: str = "none"):
    """Rule for an op applied elementwise to broadcast inputs.

    ``linear``: ``"none"`` (no P rule), ``"sum"`` (P in every input -> P: add, sub, neg),
    ``"one"`` (P in any one input, B elsewhere -> P: mul), ``"first"`` (P in the first
    input, B elsewhere -> P: div, where the divisor must be whole).
    """

    def rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
        out_ndim = _broadcast_shape(metas)
        sigs: list[tuple[SBP, ...]] = []
        for d in range(out_ndim):
            sig = []
            size = max(m.shape[d - out_ndim + m.ndim] if d - out_ndim + m.ndim >= 0 else 1
                       for m in metas)
            for m in metas:
                di = d - out_ndim + m.ndim
                sig.append(Split(di) if di >= 0 and m.shape[di] == size else broadcast)
            if any(s.is_split() for s in sig):
                sigs.append((*sig, Split(d)))
        n = len(metas)
        if linear == "sum":
            sigs.append((partial_sum,) * (n + 1))
        elif linear in ("one", "first"):
            for i in range(n if linear == "one" else 1):
                sig = [broadcast] * n
                sig[i] = partial_sum
                sigs.append((*sig, partial_sum))
        return sigs

    return rule


def einsum(spec: str):
    """Rule for a contraction written as an einsum string, e.g. ``"mk,kn->mn"``."""
    ins, out = spec.replace(" ", "").split("->")
    operands = ins.split(",")

    def rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
        sigs: list[tuple[SBP, ...]] = []
        letters = dict.fromkeys("".join(operands))
        for letter in letters:
            sig = [Split(op.index(letter)) if letter in op else broadcast for op in operands]
            if letter in out:
                sigs.append((*sig, Split(out.index(letter))))
            elif all(letter in op for op in operands):
                sigs.append((*sig, partial_sum))
        for i in range(len(operands)):
            sig = [broadcast] * len(operands)
            sig[i] = partial_sum
            sigs.append((*sig, partial_sum))
        return sigs

    return rule


def matmul_spec(a: Meta, b: Meta) -> str:
    """The einsum string of ``torch.matmul`` for these operand shapes (1-D, 2-D, batched
    with broadcasting; a batch dim of size 1 that broadcasts gets its own letter so it
    is never split)."""
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul needs at least 1-D operands, got shapes {a.shape} and {b.shape}")
    letters = iter(string.ascii_letters)
    m, k, n = next(letters), next(letters), next(letters)
    a_core = (m + k) if a.ndim >= 2 else k
    b_core = (k + n) if b.ndim >= 2 else k
    out_core = (m if a.ndim >= 2 else "") + (n if b.ndim >= 2 else "")
    a_batch, b_batch = list(a.shape[:-2]), list(b.shape[:-2])
    nb = max(len(a_batch), len(b_batch))
    a_l, b_l, o_l = [], [], []
    for i in range(nb):
        ai = i - (nb - len(a_batch))
        bi = i - (nb - len(b_batch))
        sa = a_batch[ai] if ai >= 0 else None
        sb = b_batch[bi] if bi >= 0 else None
        size = max(s for s in (sa, sb) if s is not None)
        shared = next(letters)
        for s, lst in ((sa, a_l), (sb, b_l)):
            if s is not None:
                lst.append(shared if s == size else next(letters))
        o_l.append(shared)
    return f"{''.join(a_l)}{a_core},{''.join(b_l)}{b_core}->{''.join(o_l)}{out_core}"


def reduction(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    """Rule for a sum over ``attrs['dim']`` (None: all dims) with ``keepdim``."""
    (m,) = metas
    dim = attrs.get("dim")  # normalised by the front end (sbpflow.ops.args.norm_dims)
    dims = set(range(m.ndim)) if dim is None else set((dim,) if isinstance(dim, int) else dim)
    keep = attrs.get("keepdim", False)
    sigs: list[tuple[SBP, ...]] = [(partial_sum, partial_sum)]
    for d in range(m.ndim):
        if d in dims:
            sigs.append((Split(d), partial_sum))
        else:
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            sigs.append((Split(d), Split(out_d)))
    return sigs


def permutation(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    """Rule for ``permute(dims)``: input dim ``dims[i]`` becomes output dim ``i``."""
    (m,) = metas
    dims = list(attrs["dims"])  # normalised by the front end
    return [(partial_sum, partial_sum)] + [(Split(d), Split(dims.index(d))) for d in range(m.ndim)]


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]):
    """Consecutive dim groups holding the same elements before and after a reshape:
    ``[(input dims, output dims), ...]`` (e.g. (B, T, C) -> (B, T, nh, hs): ``[([0], [0]),
    ([1], [1]), ([2], [2, 3])]``). None for shapes with a zero-size dim."""
    if 0 in in_shape or 0 in out_shape:
        return None
    groups, i, j, n, m = [], 0, 0, len(in_shape), len(out_shape)
    while i < n or j < m:
        gi, gj, pi, pj = [], [], 1, 1
        if i < n:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < m:
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _carrier(dims, shape):
    """The first dim of a group with size > 1: the only one that may be split."""
    return next((d for d in dims if shape[d] != 1), None)


def reshape_carriers(in_shape, out_shape) -> dict[int, tuple[int, int, int]]:
    """``input dim d -> (output dim e, inner_in, inner_out)`` for each group's carrier
    dims: a split of ``d`` may become a split of ``e`` (merged or divided dims included)
    when the shard boundaries line up; ``inner_*`` are the element counts of the group's
    dims after the carrier (so input index ``i`` of ``d`` starts at element
    ``i * inner_in``)."""
    out = {}
    for gi, gj in reshape_groups(in_shape, out_shape) or []:
        d, e = _carrier(gi, in_shape), _carrier(gj, out_shape)
        if d is None or e is None:
            continue
        inner_in = math.prod(in_shape[k] for k in gi if k > d)
        inner_out = math.prod(out_shape[k] for k in gj if k > e)
        out[d] = (e, inner_in, inner_out)
    return out


def reshape(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    """Rule for ``reshape(shape)``, one mesh axis: within a group of dims that hold the same
    elements before and after (:func:`reshape_groups`), a split of any input dim of size > 1
    may become a split of any output dim of size > 1 (the carrier pairs first: C of (B, T,
    C) -> (B, T, nh, hs) stays split as nh). On one mesh axis only the carrier pair lines
    up; the others are there for N-D meshes, where mesh axis 0 splits first and a later
    axis may split the next dim of the result: ``(8, 4)`` ``(S(0), S(0))`` on 2x2 viewed as
    ``(2, 4, 4)`` is ``(S(0), S(1))``, and back. Which nd signatures hold on a given mesh
    (each rank's input shard is exactly its output shard) is :func:`reshape_check`'s job;
    P -> P always."""
    (m,) = metas
    shape = attrs["shape"]
    carriers = reshape_carriers(m.shape, shape)
    sigs: list[tuple[SBP, ...]] = [(partial_sum, partial_sum)]
    sigs += [(Split(d), Split(e)) for d, (e, _, _) in carriers.items()]
    for gi, gj in reshape_groups(m.shape, shape) or []:
        for d in gi:
            for e in gj:
                sig = (Split(d), Split(e))
                if m.shape[d] > 1 and shape[e] > 1 and sig not in sigs:
                    sigs.append(sig)
    return sigs


def _block_range(region, shape, dims):
    """The flat element range ``(start, stop)`` that the slices ``region`` cover within the
    group ``dims`` of ``shape`` (row-major), ``()`` when empty, None when the covered
    elements are not one contiguous range."""
    lens = [region[k].stop - region[k].start for k in dims]
    if any(n == 0 for n in lens):
        return ()
    partial = [i for i, k in enumerate(dims) if lens[i] != shape[k]]
    if partial and any(lens[i] != 1 for i in range(partial[-1])):
        return None
    start, stride = 0, 1
    for k in reversed(dims):
        start += region[k].start * stride
        stride *= shape[k]
    return start, start + math.prod(lens)


def reshape_local_shape(local_in, in_shape, out_shape) -> tuple[int, ...]:
    """The local output shape of a reshape of a shard of shape ``local_in`` (global
    ``in_shape`` -> ``out_shape``), group by group: a group's ``n`` local elements form
    the output block ``(1, ..., 1, k, whole dims...)`` (the one shape a contiguous range of
    ``n`` elements can take), and an empty block is empty at the group's carrier. Global
    (unsplit) inputs give ``out_shape``. :func:`reshape_check` accepts only signatures
    whose output shards have exactly this shape."""
    if tuple(local_in) == tuple(in_shape):
        return tuple(out_shape)
    groups = reshape_groups(in_shape, out_shape)
    if groups is None:
        return tuple(out_shape)
    out = list(out_shape)
    for gi, gj in groups:
        n = math.prod(local_in[k] for k in gi)
        if n == math.prod(in_shape[k] for k in gi):
            continue
        if n == 0:
            e = _carrier(gj, out_shape)
            out[e if e is not None else gj[0]] = 0
            continue
        suffix = 1
        for pos in range(len(gj) - 1, -1, -1):
            e = gj[pos]
            if n % suffix == 0 and n // suffix <= out_shape[e]:
                out[e] = n // suffix
                for f in gj[:pos]:
                    out[f] = 1
                break
            suffix *= out_shape[e]
    return tuple(out)


def reshape_check(metas, attrs, ins, out, pl) -> bool:
    """True if on every rank the input shard holds exactly the elements of its output
    shard, group by group (:func:`reshape_groups`), as one contiguous range of each
    group's elements, and the kernel's local output shape
    (:func:`reshape_local_shape`) is the output shard's: then the reshape is local, no
    data moves. E.g. a split of C = nh * hs over 2 ranks lines up with the heads when nh is
    even, not when it is odd; (8, 4) (S(0), S(0)) on 2x2 holds rows 2r..2r+1 on rank r,
    which are (2, 4, 4)'s [i, 2j:2j+2] under (S(0), S(1))."""
    (m,) = metas
    shape = attrs["shape"]
    if not any(s.is_split() for s in ins[0]) and not any(s.is_split() for s in out):
        return True
    groups = reshape_groups(m.shape, shape)
    if groups is None:
        return False
    for coord in itertools.product(*(range(n) for n in pl.shape)):
        si = shard_slices(m.shape, pl.shape, ins[0], coord)
        so = shard_slices(shape, pl.shape, out, coord)
        for gi, gj in groups:
            a = _block_range(si, m.shape, gi)
            if a is None or a != _block_range(so, shape, gj):
                return False
        local_in = tuple(r.stop - r.start for r in si)
        if reshape_local_shape(local_in, m.shape, shape) != tuple(r.stop - r.start for r in so):
            return False
    return True


def concat(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    """Rule for ``cat(tensors, dim)`` (``stack`` uses ``new_dim``): any dim other than the
    joined one may be split in every input; summands concatenate to summands (P)."""
    n = len(metas)
    nd = metas[0].ndim
    dim = attrs["dim"]  # normalised by the front end
    sigs: list[tuple[SBP, ...]] = [(partial_sum,) * (n + 1)]
    for d in range(nd):
        if attrs.get("new_dim"):
            sigs.append((Split(d),) * n + (Split(d if d < dim else d + 1),))
        elif d != dim:
            sigs.append((Split(d),) * (n + 1))
    return sigs


def maps(pairs, linear: bool = True) -> list[tuple[SBP, ...]]:
    """One-input signatures ``S(d) -> S(e)`` for ``d -> e`` in ``pairs``, plus ``P -> P``
    when the op is ``linear``."""
    return ([(partial_sum, partial_sum)] if linear else []) + [(Split(d), Split(e))
                                                               for d, e in pairs]


def keep(ndim: int, whole, out_of=None, linear: bool = True) -> list[tuple[SBP, ...]]:
    """One-input signatures ``S(d) -> S(out_of(d))`` for every dim not in ``whole``
    (``out_of``: the output dim of input dim ``d``; identity by default), plus ``P -> P``
    when ``linear``."""
    out_of = out_of or (lambda d: d)
    return maps(((d, out_of(d)) for d in range(ndim) if d not in whole), linear)


def reduced_dim(dim: int, keepdim: bool, lead: int = 0):
    """Output dim of input dim ``d`` after reducing ``dim`` (``lead`` new leading dims)."""
    return lambda d: d + lead - (0 if keepdim or d < dim else 1)
