"""Row-sharded embedding lookup: dedup, id all-to-all, row all-to-all, local pooling.

The algorithm of TorchRec's row-wise sharding and OneFlow's ``OneEmbedding`` model
parallelism, for one or many tables fused into one keyspace (table ``t``'s row ``r`` is key
``offset[t] + r``). Every rank of the exchange group ``ranks`` owns a contiguous range of
rows of each table (possibly empty: a table held whole by one rank is a table whose ranges
are empty on every other rank). A lookup on each rank:

1. ``torch.unique`` of this rank's keys (all tables at once), with the inverse;
2. the unique keys grouped by owner; the per-owner counts all-gathered (``all_gather`` of
   ``n`` ints per rank, which also carries the id range check);
3. **all-to-all 1**: keys to their owners;
4. owners gather the rows (each of its table's width) into one flat buffer;
5. **all-to-all 2**: rows back to the requesters, who cut them into per-table unique-row
   matrices ``U_t`` (unique ids of table ``t``, ``D_t``) and pool the bags locally with
   ``torch.nn.functional.embedding_bag(inverse, U_t, ...)``, i.e. torch's own kernel.

Backward (:class:`_Exchange`): **all-to-all 3** sends the unique keys to the owners again
and **all-to-all 4** the rows' gradients; each owner makes its shard's gradient from them:
dense (``index_add_`` into zeros of the shard's shape) or, with ``sparse=True``, a
``torch.sparse_coo_tensor`` of the shard's shape holding only the touched rows (as
``torch.nn.Embedding(sparse=True)`` makes; uncoalesced: a row asked for by several ranks
appears once per rank). A rank holding no row of a table (a shard of 0 rows, or the
empty shard of a rank outside a table-wise table's placement) gets an empty gradient of
its shard's shape, not None, so that optimizers keep the same state on every rank. The
owner does not keep the received keys between forward and
backward (their memory is the size of the batch's unique ids times the ranks that asked);
sending them again costs one all-to-all of int64 keys, the same bytes as step 3.

Bytes moved by this rank: ``8 * K`` for the keys and ``itemsize * sum(D_t over its unique
keys)`` for the rows (``K`` = unique keys), independent of the vocabulary sizes.
"""

from __future__ import annotations

import torch

from ..distributed import _comm
from ..distributed._state import _state as _dstate

__all__ = ["Keyspace", "check_everywhere", "fetch_unique_rows", "first_bad_id", "graph_guard",
           "raise_flagged"]


class Keyspace:
    """The row ranges of a group of tables over the exchange group ``ranks``.

    Args:
        ranks: global ranks of the exchange group, in mesh order (member ``i`` is
            ``ranks[i]``).
        tables: per table ``(name, num_embeddings, embedding_dim, ranges)``; ``ranges[i]``
            is ``(start, stop)``, the rows member ``i`` holds (contiguous, covering
            ``[0, num_embeddings)`` in member order or not, each row exactly once).
    """

    def __init__(self, ranks, tables):
        self.ranks = tuple(int(r) for r in ranks)
        self.names = [t[0] for t in tables]
        self.sizes = [int(t[1]) for t in tables]
        self.dims = [int(t[2]) for t in tables]
        self.ranges = [list(t[3]) for t in tables]
        self.offsets = []
        off = 0
        for v in self.sizes:
            self.offsets.append(off)
            off += v
        segs = []  # (first key, owner member, table)
        for t, (off, ranges) in enumerate(zip(self.offsets, self.ranges)):
            if len(ranges) != len(self.ranks):
                raise ValueError(f"table {self.names[t]!r}: {len(ranges)} row ranges for "
                                 f"{len(self.ranks)} ranks")
            covered = 0
            for m, (a, b) in enumerate(ranges):
                if b > a:
                    segs.append((off + a, m, t))
                    covered += b - a
            if covered != self.sizes[t]:
                raise ValueError(f"table {self.names[t]!r}: row ranges {ranges} do not cover "
                                 f"its {self.sizes[t]} rows once")
        segs.sort()
        self.seg_start = torch.tensor([s[0] for s in segs], dtype=torch.int64)
        self.seg_owner = torch.tensor([s[1] for s in segs], dtype=torch.int64)
        self.seg_table = torch.tensor([s[2] for s in segs], dtype=torch.int64)
        self.dim_of = torch.tensor(self.dims, dtype=torch.int64)
        # every table equally wide (DLRM's case): rows travel as a (keys, D) matrix
        self.uniform = self.dims[0] if len(set(self.dims)) == 1 else None
        self._dev = {}

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(segment starts, owners, tables, table widths) on ``device`` (cached)."""
        key = str(device)
        if key not in self._dev:
            self._dev[key] = tuple(t.to(device) for t in (self.seg_start, self.seg_owner,
                                                          self.seg_table, self.dim_of))
        return self._dev[key]

    def locate(self, keys: torch.Tensor):
        """(owner member, table, row within the owner's shard, width) of each key."""
        start, owner, table, dim_of = self.on(keys.device)
        seg = torch.searchsorted(start, keys, right=True) - 1
        t = table[seg]
        return owner[seg], t, keys - start[seg], dim_of[t]


def graph_guard(what: str) -> None:
    """Raise the tracer's error when an ``nn.Graph`` traces a lookup whose collectives
    have data-dependent sizes (a graph fixes every size when it is traced)."""
    tracer = _dstate.tracer
    if tracer is not None and not _dstate.untraced:
        raise tracer.unsupported(
            f"{what} exchanges ids and rows with all-to-alls whose sizes depend on the ids "
            f"(the unique ids per rank), which a traced graph cannot hold. Run the "
            f"embedding lookup eagerly, outside nn.Graph (e.g. look up the tables in "
            f"eager mode and pass the pooled embeddings, an S(0) global tensor, to the "
            f"graph), or lay the tables out B (replicated)")


def _starts(width: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(width, 0) - width


def _cells(start: torch.Tensor, d: int) -> torch.Tensor:
    """Flat positions of ``len(start)`` rows of width ``d`` starting at ``start``."""
    return (start.unsqueeze(1) + torch.arange(d, device=start.device)).reshape(-1)


def _per_member(member: torch.Tensor, weight: torch.Tensor, n: int) -> list[int]:
    out = torch.zeros(n, dtype=torch.int64, device=member.device)
    out.index_add_(0, member, weight)
    return out.tolist()


def _gather_rows(space: Keyspace, keys: torch.Tensor, shards, dtype) -> torch.Tensor:
    """The owner's rows of ``keys`` (all held here) as one flat buffer, each key's row
    (its table's width) after the previous key's."""
    _, table, row, width = space.locate(keys)
    if space.uniform is not None:
        out = torch.empty(keys.numel(), space.uniform, dtype=dtype, device=keys.device)
        for t, w in enumerate(shards):
            m = table == t
            if w.numel():
                out[m] = w[row[m]].to(dtype)
        return out.view(-1)
    start = _starts(width)
    out = torch.empty(int(width.sum()), dtype=dtype, device=keys.device)
    for t, w in enumerate(shards):
        m = table == t
        if w.numel():
            out[_cells(start[m], space.dims[t])] = w[row[m]].reshape(-1).to(dtype)
    return out


class _Exchange(torch.autograd.Function):
    """Keys (grouped by owner) -> their rows, flat; differentiable in the shards."""

    @staticmethod
    def forward(ctx, info, keys, *shards):
        space, send, recv, sparse, dtype = info
        ranks = space.ranks
        n = len(ranks)
        got = _comm.all_to_all_v(keys, ranks, send, recv)  # all-to-all 1: ids
        _, _, _, gwidth = space.locate(got)
        src = torch.repeat_interleave(torch.arange(n, device=keys.device),
                                      torch.tensor(recv, device=keys.device))
        out_counts = _per_member(src, gwidth, n)  # floats this owner returns per requester
        owner, _, _, width = space.locate(keys)
        in_counts = _per_member(owner, width, n)  # floats this rank receives per owner
        rows = _gather_rows(space, got, shards, dtype)
        flat = _comm.all_to_all_v(rows, ranks, out_counts, in_counts)  # all-to-all 2: rows
        ctx.info = (space, send, recv, sparse, in_counts, out_counts)
        ctx.shard_meta = [(tuple(s.shape), s.dtype) for s in shards]
        ctx.save_for_backward(keys)
        return flat

    @staticmethod
    def backward(ctx, grad_flat):
        space, send, recv, sparse, in_counts, out_counts = ctx.info
        (keys,) = ctx.saved_tensors
        ranks = space.ranks
        got = _comm.all_to_all_v(keys, ranks, send, recv)  # all-to-all 3: ids again
        g = _comm.all_to_all_v(grad_flat.contiguous(), ranks, in_counts,
                               out_counts)  # all-to-all 4: row gradients
        _, table, row, width = space.locate(got)
        start = _starts(width)
        grads = []
        for t, (shape, sdtype) in enumerate(ctx.shard_meta):
            if not ctx.needs_input_grad[2 + t]:
                grads.append(None)
                continue
            m = table == t
            d = space.dims[t]
            g_rows = (g.view(-1, d)[m] if space.uniform is not None else
                      g[_cells(start[m], d)].view(-1, d)).to(sdtype)
            rows = row[m]
            if len(shape) != 2 or shape[1] != d:
                # a rank outside the table's placement (an empty shard, no row asked of
                # it): an empty gradient, not None, so that an optimizer makes its (empty)
                # state here as on the owners and the ranks save the same state dict
                g_rows = g_rows.reshape(0, *shape[1:])
            if sparse:
                grads.append(torch.sparse_coo_tensor(rows.unsqueeze(0), g_rows, shape,
                                                     check_invariants=False))
            else:
                grads.append(torch.zeros(shape, dtype=sdtype, device=g.device)
                             .index_add_(0, rows, g_rows))
        return (None, None, *grads)


def first_bad_id(ids: list, sizes: list[int]) -> list[int]:
    """This rank's verdict on its ids for :func:`raise_flagged`: ``[1, t, id]`` for the
    first id of table ``t`` (``ids[t]``, any shape) outside ``[0, sizes[t])``, else
    ``[0, -1, 0]``. Meta tensors (a logical graph's stand-ins: no values) pass."""
    for t, (i, n) in enumerate(zip(ids, sizes)):
        if i.is_meta:
            continue
        wrong = (i < 0) | (i >= n)
        if i.numel() and bool(wrong.any()):
            return [1, t, int(i[wrong].reshape(-1)[0])]
    return [0, -1, 0]


def raise_flagged(what: str, ranks, flags: list, names: list[str], sizes: list[int]) -> None:
    """Raise the same error on every rank from every member's ``[flag, table, value]``
    (member ``i`` is ``ranks[i]``; gathered by the caller): flag 2, that member's input
    was invalid (it raises its own error; the others a ``ValueError`` naming it); flag 1,
    id ``value`` of table ``names[table]`` is out of range (an ``IndexError``, the first
    flagged member's); flag 0, nothing is wrong."""
    wrong_input = [ranks[m] for m, f in enumerate(flags) if int(f[0]) == 2]
    if wrong_input:
        raise ValueError(f"{what}: the input of rank(s) {wrong_input} is invalid (see the "
                         f"error raised there); every rank stops at this lookup")
    flagged = [m for m, f in enumerate(flags) if int(f[0]) == 1]
    if flagged:
        m = flagged[0]
        t, v = int(flags[m][1]), int(flags[m][2])
        raise IndexError(f"{what}: id {v} of table {names[t]!r} (on rank {ranks[m]}) "
                         f"is out of range for its {sizes[t]} rows (expected 0 <= id < "
                         f"{sizes[t]})")


def check_everywhere(what: str, ranks, names: list[str], sizes: list[int], *,
                     bad: list[int] | None = None, error: Exception | None = None,
                     extra: tuple[int, ...] = ()) -> list[list[int]]:
    """The agreement of :func:`fetch_unique_rows` for lookups that exchange no rows (a
    replicated table): one all-gather over ``ranks`` of this rank's verdict (``bad`` from
    :func:`first_bad_id`, or ``error``: this rank's input was found invalid) and the
    caller's ``extra`` ints; then every rank raises the same error if any rank's input
    was bad (:func:`raise_flagged`; a rank with ``error`` raises it). Every member calls
    it, before any other collective of the lookup, so that no rank waits for a rank that
    stopped. Returns every member's ``extra``, in ``ranks`` order."""
    ranks = tuple(int(r) for r in ranks)
    row = ([2, -1, 0] if error is not None else list(bad or [0, -1, 0])) + list(extra)
    if len(ranks) > 1:  # every rank of the world runs the lookup: the group is made alike
        _comm._state.ensure_groups([ranks])
        rows = _comm.all_gather_meta(row, ranks)
    else:
        rows = [row]
    if error is not None:
        raise error
    raise_flagged(what, ranks, [r[:3] for r in rows], names, sizes)
    return [r[3:] for r in rows]


def fetch_unique_rows(space: Keyspace, ids: list, shards: list, *, sparse: bool,
                      padding: list | None = None, check: bool = True,
                      what: str = "EmbeddingBag", extra: tuple[int, ...] = (),
                      error: Exception | None = None):
    """Look up this rank's ids of every table of ``space`` in one fused exchange.

    Every rank of ``space.ranks`` calls it (a rank with no ids passes empty tensors).

    Args:
        ids: per table, a 1-D int tensor of row ids (this rank's, any order, repeats).
        shards: per table, this rank's local shard (rows ``space.ranges[t][me]``), a
            ``(rows, D_t)`` torch tensor (the empty shard of a rank outside the table's
            placement may have any shape); every shard has the same dtype.
        sparse: make the shards' gradients sparse COO tensors.
        padding: per table, a ``padding_idx`` or ``None``: those ids are not fetched and
            get no gradient (torch's ``EmbeddingBag``).
        check: raise when an id is outside ``[0, num_embeddings)`` (checked on every rank
            with the result of the counts' all-gather: every rank raises the same error).
        extra: a few ints of this rank to gather along with the counts (the callers'
            per-rank batch sizes), returned per member.
        error: this rank's input was found bad (before any collective): the rank still
            joins the counts' all-gather (so the others do not wait for it until the
            timeout), then raises ``error``; the other ranks raise a ``ValueError`` naming
            it.

    Returns:
        ``(rows, extras)``: ``extras[i]`` is member ``i``'s ``extra``; ``rows`` per table
        ``(U, index, pad)``: ``U`` ``(u_t (+1), D_t)``, the unique rows of the
        table asked for by this rank (differentiable in the shards), ``index`` the row of
        ``U`` for each id, ``pad`` the row of ``U`` that stands for the padding id (a zero
        row appended to ``U``) or ``None``. ``F.embedding_bag(index, U, ..., padding_idx=
        pad)`` then equals torch's lookup in the whole table.

    Raises:
        IndexError: an id out of range on any rank (naming the rank, table, id and size).
        TypeError: shards of different dtypes, or non-integer ids.
    """
    ranks = space.ranks
    n = len(ranks)
    if n > 1:  # every rank of the world runs the lookup: the group is made the same way
        _comm._state.ensure_groups([ranks])
    me = ranks.index(_comm._state.get_rank()) if n > 1 else 0
    device = shards[0].device
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1:
        raise TypeError(f"{what}: tables fused into one exchange must share a dtype, got "
                        f"{sorted(str(d) for d in dtypes)}; cast them or exchange them apart")
    dtype = dtypes.pop()
    keys, bad = [], [0, -1, 0]
    if error is not None:
        ids, bad = [i.reshape(-1)[:0] for i in ids], [2, -1, 0]
    for t, i in enumerate(ids):
        if i.dtype.is_floating_point or i.dtype in (torch.bool, torch.complex64,
                                                    torch.complex128):
            raise TypeError(f"{what}: ids of table {space.names[t]!r} must be integers "
                            f"(torch.int64 or torch.int32), got {i.dtype}")
        i = i.reshape(-1).to(device=device, dtype=torch.int64)
        if check and bad[0] == 0 and i.numel():
            wrong = (i < 0) | (i >= space.sizes[t])
            if bool(wrong.any()):
                bad = [1, t, int(i[wrong][0])]
        if padding is not None and padding[t] is not None:
            i = i[i != padding[t]]
        keys.append(i + space.offsets[t])
    allk = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64, device=device)
    uniq, inverse = torch.unique(allk, sorted=True, return_inverse=True)
    if bad[0]:  # do not locate out-of-range keys; the error is raised below on every rank
        uniq = uniq[:0]
    owner, table, _, width = space.locate(uniq)
    perm = torch.argsort(owner, stable=True)
    by_owner = uniq[perm]
    send = torch.bincount(owner, minlength=n)
    # Counts (and the range check, and the callers' extras) to every rank: one all-gather
    # of n + 3 + len(extra) ints.
    k = n + 3 + len(extra)
    if n > 1:
        row = torch.cat([send, torch.tensor(bad + list(extra), dtype=torch.int64,
                                            device=device)])
        table_m = _comm.all_gather(row, ranks, 0, [k] * n).view(n, k).cpu()
    else:
        table_m = torch.tensor([send.tolist() + bad + list(extra)])
    extras = table_m[:, n + 3:].tolist()
    if error is not None:
        raise error
    raise_flagged(what, ranks, table_m[:, n:n + 3].tolist(), space.names, space.sizes)
    send_l = table_m[me, :n].tolist()
    recv_l = table_m[:, me].tolist()
    flat = _Exchange.apply((space, send_l, recv_l, sparse, dtype), by_owner, *shards)

    # Cut the flat rows (in owner order) into per-table unique-row matrices.
    t_by_owner = table[perm]
    start = _starts(width[perm])
    pos_of = torch.empty_like(perm)
    pos_of[perm] = torch.arange(perm.numel(), device=device)
    out = []
    base = 0
    for t, i in enumerate(ids):
        d = space.dims[t]
        m = t_by_owner == t
        U = flat.view(-1, d)[m] if space.uniform is not None else \
            flat[_cells(start[m], d)].view(-1, d)
        rank_in_t = torch.cumsum(m.to(torch.int64), 0) - 1
        i = i.reshape(-1).to(device=device, dtype=torch.int64)
        pad = padding[t] if padding is not None else None
        k = int((i != pad).sum()) if pad is not None else i.numel()
        idx = rank_in_t[pos_of[inverse[base:base + k]]] if k else \
            torch.zeros(0, dtype=torch.int64, device=device)
        base += k
        if pad is not None:
            full = torch.full_like(i, U.shape[0])
            full[i != pad] = idx
            idx = full
            U = torch.cat([U, U.new_zeros(1, d)])
            pad = U.shape[0] - 1
        out.append((U, idx, pad))
    return out, extras
