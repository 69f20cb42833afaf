"""``embedding_bag`` on local and global tables (exported as
:func:`sbpflow.nn.functional.embedding_bag`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed._state import _state as _dstate
from ..ops.dispatch import dispatch
from ..placement import split_sizes
from ..sbp import Split, broadcast, split
from ..tensor import Tensor
from ._sharded_lookup import (
    Keyspace,
    check_everywhere,
    fetch_unique_rows,
    first_bad_id,
    graph_guard,
)

__all__ = ["embedding_bag", "check_bags", "per_rank_to_global", "row_ranges"]

_MODES = ("sum", "mean", "max")


def check_bags(what: str, input, offsets, mode: str, per_sample_weights,  # noqa: A002
               include_last_offset: bool) -> None:
    """torch's argument checks of ``embedding_bag``, plus offsets that start at 0, do not
    decrease and stay within the ids (torch reads out of bounds or gives an unclear
    message on some of these). ``input``/``offsets``/``per_sample_weights``: torch tensors.

    Raises:
        ValueError: bad mode, 2-D input with offsets, 1-D input without them, offsets not
            1-D / not starting at 0 / decreasing / past the end, per_sample_weights of
            another shape than the input.
        TypeError: non-integer ids or offsets.
        NotImplementedError: (torch's) per_sample_weights with a mode other than 'sum'.
    """
    if mode not in _MODES:
        raise ValueError(f"{what}: mode must be one of {_MODES}, got {mode!r}")
    if input.dtype.is_floating_point or input.dtype in (torch.bool, torch.complex64,
                                                        torch.complex128):
        raise TypeError(f"{what}: ids must be an integer tensor (torch.int64 or torch.int32), "
                        f"got {input.dtype}")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(f"{what}: if input is 2D, then offsets has to be None, as input "
                             f"is treated as a mini-batch of fixed length sequences (each "
                             f"row one bag); got offsets of shape {tuple(offsets.shape)}")
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError(f"{what}: offsets has to be a 1D Tensor but got None (1-D input "
                             f"is the concatenated bags; offsets[i] is where bag i starts)")
        if offsets.dim() != 1:
            raise ValueError(f"{what}: offsets has to be a 1D Tensor, got shape "
                             f"{tuple(offsets.shape)}")
        if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise TypeError(f"{what}: offsets must be an integer tensor, got {offsets.dtype}")
        if offsets.numel():
            first = int(offsets[0])
            if first != 0:
                raise ValueError(f"{what}: offsets[0] has to be 0, i.e., the first sequence in "
                                 f"the mini-batch has to start from position 0. However, got "
                                 f"{first}")
            steps = offsets[1:] - offsets[:-1]
            if bool((steps < 0).any()):
                k = int(torch.nonzero(steps < 0)[0, 0])
                raise ValueError(f"{what}: offsets must not decrease, got offsets[{k}] = "
                                 f"{int(offsets[k])} > offsets[{k + 1}] = {int(offsets[k + 1])}")
            last = int(offsets[-1])
            if last > input.numel():
                raise ValueError(f"{what}: offsets[-1] = {last} is past the end of the "
                                 f"{input.numel()} ids")
        elif include_last_offset:
            raise ValueError(f"{what}: include_last_offset=True needs at least one offset "
                             f"(the end of the last bag)")
    else:
        raise ValueError(f"{what}: input has to be 1D or 2D Tensor, but got Tensor of "
                         f"dimension {input.dim()}")
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(
                f"{what}: per_sample_weights was not None. per_sample_weights is only "
                f"supported for mode='sum' (got mode={mode!r}); weight the ids yourself or "
                f"use mode='sum'")
        if tuple(per_sample_weights.shape) != tuple(input.shape):
            raise ValueError(f"{what}: per_sample_weights of shape "
                             f"{tuple(per_sample_weights.shape)} must have the input's shape "
                             f"{tuple(input.shape)}")


def row_ranges(pl, num_embeddings: int, nd_sbp) -> list[tuple[int, int]]:
    """Rows ``(start, stop)`` each member of the 1-D placement ``pl`` holds of a table of
    ``num_embeddings`` rows laid out ``nd_sbp`` (S(0) or B; :func:`shard_slices`)."""
    out = []
    for r in pl.rank_list:
        sl = pl.shard_slices((num_embeddings, 1), nd_sbp, r)[0]
        out.append((sl.start or 0, num_embeddings if sl.stop is None else sl.stop))
    return out


def per_rank_to_global(local: torch.Tensor, pl, batches: list[int] | None = None,
                       what: str = "embedding_bag") -> Tensor:
    """This rank's pooled bags ``(B_r, D)`` as its shard of the global ``(sum B_r, D)``
    laid out S(0) on ``pl`` (the local batches must follow ``shard_shape``: equal per-rank
    batches, or the first ranks one longer). Differentiable. ``batches``: every member's
    ``B_r`` when the caller already gathered them (no metadata exchange then).

    Raises:
        ValueError: (every rank) batch sizes that do not form an S(0) split."""
    if batches is None:
        return Tensor(local).to_global(pl, split(0))
    total = sum(batches)
    if list(batches) != split_sizes(total, len(batches)):
        raise ValueError(f"{what}: the ranks' numbers of bags {list(batches)} do not form an "
                         f"S(0) split of the {total}-bag batch (sbpflow.placement.shard_shape "
                         f"wants {split_sizes(total, len(batches))}); give every rank the "
                         f"same number of bags (or the first ranks one more)")
    return Tensor(local).to_global(pl, split(0), check_meta=False,
                                   size=(total, *local.shape[1:]))


def _local(x):
    return None if x is None else (x._local if isinstance(x, Tensor) else torch.as_tensor(x))


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2.0,  # noqa: A002
                  scale_grad_by_freq=False, mode="mean", sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=None, *,
                  check_ids: bool = True, name: str = "embedding_bag"):
    """Pooled rows of ``weight`` (V, D) over bags of ids (``torch.nn.functional.
    embedding_bag``: same arguments, defaults and values).

    Bags: ``input`` 2-D ``(B, L)`` (each row a bag of L ids; ``offsets`` None) or 1-D
    ``(N,)`` with ``offsets`` ``(B,)`` (bag i is ``input[offsets[i]:offsets[i+1]]``, the
    last to the end; with ``include_last_offset`` ``offsets`` is ``(B+1,)`` and its last
    entry ends the last bag). Ids: int64 or int32. ``mode``: ``'sum'``, ``'mean'``,
    ``'max'``; empty bags give zeros. ``per_sample_weights`` (input's shape, float, ``'sum'``
    only) scales each row. ``padding_idx``: ids equal to it are left out of their bag
    (also from the mean's count) and give no gradient. ``sparse``: the weight's gradient
    is a sparse COO tensor of the touched rows. Output ``(B, D)``, the weight's dtype.

    Local weight: exactly torch. Global weight (a 1-D placement of ranks; SBP per table):

    * ``B`` (replicated): torch on each rank's shard. Global ids keep their layout (S(0)
      ids give an S(0) output, B ids B); the gradient of an S(0) batch arrives P and is
      all-reduced like any data-parallel parameter (``sparse=True`` is refused: a sparse
      all-reduce is not implemented; use S(0) rows).
    * ``S(1)`` (columns split): the ids are boxed to ``B`` (an all-gather if they are
      S(0)), each rank pools its columns: output ``S(1)`` (split last dim), no further
      communication; backward is local.
    * ``S(0)`` (rows split, uneven allowed): the row-sharded lookup of
      :mod:`sbpflow.nn._sharded_lookup`: each rank deduplicates its ids, one all-gather of
      counts, one all-to-all of ids to the owners and one of rows back, local pooling with
      torch's kernel; backward: two all-to-alls (ids, row gradients). Bytes proportional to
      the unique ids, never to V. Output S(0) for S(0) ids, B for B ids.

    Inside ``nn.Graph`` (shapes are fixed there and no value is read), on a 2-D mesh and
    for an S(1) table, global 2-D ids with ``sparse=False`` run as the registered op
    ``nn.embedding_bag`` instead, whose signature the chooser picks per mesh axis like
    any op's (and the logical graph prices): a B weight follows the bags' split; S(1)
    gathers the bags (B) and gives S(1); S(0) (rows) or P gathers the bags and gives P,
    each rank pooling the ids in its row range (``sum`` and ``mean``; ``max`` gathers
    the rows), so the exchange moves ``N x L`` ids and ``N x D`` outputs, not the unique
    rows.

    Ids for a global weight are either a global 2-D tensor on the weight's placement
    (``S(0)`` or ``B`` over the batch; ``per_sample_weights`` laid out the same), or
    **local** tensors: each rank's own bags (1-D + offsets or 2-D), as a data-parallel
    loader gives them; the output is then the global ``(sum of B_r, D)`` laid out S(0),
    rank r's bags r-th (so the per-rank batch sizes must follow
    :func:`sbpflow.placement.shard_shape`: equal, or the first ranks one longer). S(1)
    tables need 2-D ids.

    ``check_ids`` (an sbpflow extension, default True): on a global weight, an id out of
    ``[0, V)`` on any rank makes every rank raise (the check rides on the counts'
    all-gather of the S(0) path, or on the B path's one small metadata all-gather, which
    per-rank ids need anyway for the bag counts; S(0) global ids are checked eagerly,
    not inside ``nn.Graph``); False skips the check (a bad id then gives wrong rows or a
    hang). Bad bags of per-rank ids (offsets, shapes) on one rank make every rank raise
    on B and S(0) weights too: that rank joins the same all-gather with an error flag.

    Raises:
        IndexError: an id out of range (naming it, ``name`` and V).
        ValueError / TypeError / NotImplementedError: see :func:`check_bags`; a 1-D
            global ``input``; an S(1) weight with 1-D per-rank ids; ids on another
            placement; ``sparse=True`` on a B weight.
        NotImplementedError: ``max_norm`` or ``scale_grad_by_freq`` on a global weight.
        sbpflow.graph.GraphError: an S(0) weight looked up inside ``nn.Graph`` with
            per-rank (local) ids or ``sparse=True`` (the exchange has data-dependent
            sizes): pass global 2-D ids, or run it eagerly.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"{name}: weight must be an sbpflow Tensor, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"{name}: weight must be (num_embeddings, embedding_dim), got shape "
                         f"{tuple(weight.shape)}")
    V, D = weight.shape
    if padding_idx is not None:
        if not -V <= padding_idx < V:
            raise ValueError(f"{name}: padding_idx {padding_idx} must be within "
                             f"num_embeddings ({V})")
        padding_idx %= V
    ids_g = isinstance(input, Tensor) and input.is_global
    ids, offs, psw = _local(input), _local(offsets), _local(per_sample_weights)
    try:
        check_bags(name, ids, offs, mode, psw, include_last_offset)
    except (ValueError, TypeError, NotImplementedError) as e:
        if ids_g or not weight.is_global or _dstate.tracer is not None:
            raise
        # this rank's own bags are bad: join the lookup's first all-gather (with an error
        # flag) so that every rank raises instead of waiting for this one until the timeout
        pl = weight.placement
        if all(s.is_broadcast() for s in weight.sbp):
            check_everywhere(name, pl.rank_list, [name], [V], error=e)
        elif pl.ndim == 1 and weight.sbp[0] == split(0):
            fetch_unique_rows(_space_of(pl, V, D, weight.sbp, name),
                              [torch.zeros(0, dtype=torch.int64)], [weight._local],
                              sparse=sparse, what=name, extra=(0,), error=e)
        raise
    if sparse and mode == "max":
        raise ValueError(f"{name}: max mode does not support sparse weights (torch's rule); "
                         f"use mode='sum'/'mean' or sparse=False")
    if weight.is_local:
        if ids_g:
            raise TypeError(f"{name}: global ids with a local weight; lay the weight out "
                            f"with weight.to_global(...) or pass local ids")
        return Tensor(F.embedding_bag(ids, weight._local, offs, max_norm, norm_type,
                                      scale_grad_by_freq, mode, sparse, psw,
                                      include_last_offset, padding_idx))
    if max_norm is not None or scale_grad_by_freq:
        raise NotImplementedError(f"{name}: max_norm and scale_grad_by_freq are supported on "
                                  f"local weights only")
    pl, sbp = weight.placement, weight.sbp
    if ids_g:
        if input.placement != pl:
            raise ValueError(f"{name}: ids on {input.placement!r} but the weight on {pl!r}; "
                             f"put them on the weight's placement")
        if input.ndim == 1:
            return _replicated_bags(name, input, weight, offsets, per_sample_weights, V, D,
                                    sparse, padding_idx, mode, include_last_offset,
                                    check_ids)
        if input.ndim != 2:
            raise ValueError(f"{name}: global ids must be 2-D (B, L) (each row a bag), or "
                             f"1-D with offsets (every rank's bags: the ids laid out B); got "
                             f"{input.ndim}-D")
        if offsets is not None:
            raise ValueError(f"{name}: global 2-D ids take no offsets")
        if any(isinstance(s, Split) and s.dim != 0 for s in input.sbp) or \
                any(s.is_partial() for s in input.sbp):
            input = input.to_global(pl, [broadcast if not (s.is_split() and s.dim == 0) else s
                                         for s in input.sbp])
        if per_sample_weights is not None and per_sample_weights.sbp != input.sbp:
            per_sample_weights = per_sample_weights.to_global(pl, input.sbp)
        if not sparse and (_dstate.tracer is not None or pl.ndim > 1 or sbp == (split(1),)):
            # inside nn.Graph (shapes fixed, no value read), on 2-D meshes and for column
            # split tables: one registered op the chooser lays out (S(0) rows: the ids
            # gathered, output P; S(1) columns: the ids gathered, output S(1))
            extra = () if per_sample_weights is None else (per_sample_weights,)
            return dispatch("nn.embedding_bag", input, weight, *extra, mode=mode,
                            padding_idx=padding_idx)
        ids, psw = input._local, _local(per_sample_weights)
    kw = dict(mode=mode, per_sample_weights=psw, include_last_offset=include_last_offset)
    if all(s.is_broadcast() for s in sbp):
        if sparse:
            raise ValueError(f"{name}: sparse=True with a replicated (B) weight would need a "
                             f"sparse all-reduce of its gradient; lay the table out by rows "
                             f"(split(0)) or use sparse=False")
        batches = None
        if not ids_g or (check_ids and any(s.is_split() for s in input.sbp) and
                         _dstate.tracer is None):
            # each rank holds its own ids: one all-gather of the verdict on them (and of
            # the per-rank bag counts), so that a bad id raises on every rank
            bad = first_bad_id([ids], [V]) if check_ids else None
            nbags = 0 if ids_g else \
                ids.shape[0] if ids.dim() == 2 else offs.numel() - int(include_last_offset)
            batches = [e[0] for e in check_everywhere(name, pl.rank_list, [name], [V],
                                                      bad=bad, extra=(nbags,))]
        out = F.embedding_bag(ids, weight._local, offs, padding_idx=padding_idx, **kw)
        if ids_g:
            return Tensor(out, pl, input.sbp, (input.shape[0], D))
        return per_rank_to_global(out, pl, batches, name)
    if pl.ndim != 1:
        raise NotImplementedError(f"{name}: a split weight on a {pl.ndim}-D mesh; use a 1-D "
                                  f"placement for sharded tables")
    s = sbp[0]
    if s.is_split() and s.dim == 1:
        if not ids_g:
            if ids.dim() != 2:
                raise NotImplementedError(
                    f"{name}: a column-split (S(1)) weight needs 2-D ids (each rank needs "
                    f"every bag); pad the bags to 2-D with padding_idx, or split the "
                    f"table by rows (S(0))")
            input = Tensor(ids).to_global(pl, split(0))
            if per_sample_weights is not None:
                per_sample_weights = Tensor(psw).to_global(pl, split(0))
        gi = input.to_global(pl, broadcast)
        gp = None if per_sample_weights is None else per_sample_weights.to_global(pl, broadcast)
        kw["per_sample_weights"] = _local(gp)
        out = F.embedding_bag(gi._local, weight._local, None, sparse=sparse,
                              padding_idx=padding_idx, **kw)
        return Tensor(out, pl, (split(1),), (gi.shape[0], D))
    if s.is_partial():
        raise ValueError(f"{name}: a partial-sum (P) weight; box it to B or split(0) first")
    graph_guard(f"{name} (a row-split S(0) table)")
    space = _space_of(pl, V, D, sbp, name)
    nbags = ids.shape[0] if ids.dim() == 2 else offs.numel() - int(include_last_offset)
    ((U, idx, pad),), extras = fetch_unique_rows(
        space, [ids], [weight._local], sparse=sparse, padding=[padding_idx], check=check_ids,
        what=name, extra=(nbags,))
    idx = idx.view(ids.shape)
    out = F.embedding_bag(idx, U, None if offs is None else offs.to(torch.int64),
                          padding_idx=pad, **kw)
    if ids_g:
        return Tensor(out, pl, input.sbp, (input.shape[0], D))
    return per_rank_to_global(out, pl, [e[0] for e in extras], name)


def _replicated_bags(name, input, weight, offsets, per_sample_weights, V: int, D: int,  # noqa: A002
                     sparse: bool, padding_idx, mode: str, include_last_offset: bool,
                     check_ids: bool):
    """Global 1-D ids with offsets (torch's ragged form): the ids, offsets and
    per-sample weights are taken whole on every rank (boxed to B), so every rank pools
    every bag. The output is B for a B or row-split (S(0)) weight (a row-split table
    fetches the rows of all ids from their owners; the gradient, P by the dual rule, goes
    back to them summed) and S(1) for a column-split weight.

    Raises:
        ValueError: no offsets, or offsets / weights on another placement."""
    pl = weight.placement
    if offsets is None:
        raise ValueError(f"{name}: 1-D ids need offsets (the start of each bag), as torch's")
    whole = (broadcast,) * pl.ndim

    def b(t, what):
        if t is None:
            return None
        if isinstance(t, Tensor) and t.is_global:
            if t.placement != pl:
                raise ValueError(f"{name}: {what} on {t.placement!r} but the weight on "
                                 f"{pl!r}; put them on the weight's placement")
            return t.to_global(pl, whole)._local
        return _local(t)  # a local tensor: the whole value (every rank holds the same)

    ids, offs, psw = b(input, "ids"), b(offsets, "offsets"), b(per_sample_weights,
                                                                  "per_sample_weights")
    check_bags(name, ids, offs, mode, psw, include_last_offset)
    kw = dict(mode=mode, per_sample_weights=psw, include_last_offset=include_last_offset)
    nbags = offs.numel() - int(include_last_offset)
    sbp = weight.sbp
    if all(s.is_broadcast() for s in sbp) or (pl.ndim == 1 and sbp[0].is_split()
                                              and sbp[0].dim == 1):
        if sparse and all(s.is_broadcast() for s in sbp):
            raise ValueError(f"{name}: sparse=True with a replicated (B) weight would need a "
                             f"sparse all-reduce of its gradient; lay the table out by rows "
                             f"(split(0)) or use sparse=False")
        bad = first_bad_id([ids], [V]) if check_ids else None
        check_everywhere(name, pl.rank_list, [name], [V], bad=bad)
        out = F.embedding_bag(ids, weight._local, offs, padding_idx=padding_idx,
                              sparse=sparse, **kw)
        return Tensor(out, pl, sbp if not all(s.is_broadcast() for s in sbp) else whole,
                      (nbags, D))
    if pl.ndim != 1 or sbp[0].is_partial():
        raise NotImplementedError(f"{name}: 1-D ids with a weight laid out {sbp} on a "
                                  f"{pl.ndim}-D mesh; use a B, S(0) or S(1) table on a 1-D "
                                  f"placement")
    graph_guard(f"{name} (a row-split S(0) table)")
    space = _space_of(pl, V, D, sbp, name)
    ((U, idx, pad),), _ = fetch_unique_rows(
        space, [ids], [weight._local], sparse=sparse, padding=[padding_idx], check=check_ids,
        what=name, extra=(nbags,))
    out = F.embedding_bag(idx.view(ids.shape), U, offs.to(torch.int64), padding_idx=pad, **kw)
    return Tensor(out, pl, whole, (nbags, D))


_SPACES: dict = {}


def _space_of(pl, V: int, D: int, sbp, name: str) -> Keyspace:
    key = (pl, V, D, tuple(sbp), name)
    if key not in _SPACES:
        _SPACES[key] = Keyspace(pl.rank_list, [(name, V, D, row_ranges(pl, V, sbp))])
    return _SPACES[key]
