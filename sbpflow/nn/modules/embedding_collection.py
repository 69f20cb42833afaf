"""Many embedding tables looked up together: :class:`EmbeddingBagCollection` (TorchRec's
name; ``EmbeddingCollection`` and OneFlow-style ``MultiTableEmbedding`` are aliases).

Sharding rule (per table, overridable with ``EmbeddingBagConfig.sharding`` or the
``sharding=`` dict; ``bytes = num_embeddings * embedding_dim * itemsize``):

==================  ===========================================================  =========
sharding            layout of the table's weight                                 lookup
==================  ===========================================================  =========
``"row_wise"``      S(0) over the placement (uneven rows allowed);               fused
                    default when ``bytes >= row_wise_min_bytes`` (1 MiB)         exchange
``"table_wise"``    the whole table on one rank (placement ``[r]``, S(0));       fused
                    default for smaller tables; ``r`` balances bytes: tables      exchange
                    in decreasing size go to the rank holding the fewest bytes
                    (a row-wise table counts ``bytes / n`` on every rank)
``"column_wise"``   S(1) over the placement (only when asked for): each rank     own
                    pools its columns of every bag (2-D ids, all-gathered),      all-gather
                    output boxed S(1) -> S(0) (an all-to-all)                    + all-to-all
``"replicated"``    B on every rank (only when asked for): local lookup, dense   none
                    gradient all-reduced like a data-parallel parameter          forward
==================  ===========================================================  =========

Row-wise and table-wise tables (of one dtype) form one keyspace and are looked up by
one exchange (:mod:`sbpflow.nn._sharded_lookup`): one all-gather of counts, two
all-to-alls forward and two backward for any number of tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as TF

from ...ops.creation import randn
from ...placement import placement as Placement
from ...sbp import broadcast, split
from ...tensor import Tensor
from .. import functional as F
from .._embedding_bag import check_bags, per_rank_to_global, row_ranges
from .._sharded_lookup import (
    Keyspace,
    check_everywhere,
    fetch_unique_rows,
    first_bad_id,
    graph_guard,
    raise_flagged,
)
from ..module import Module
from .container import ModuleDict
from .embedding_bag import EmbeddingBag
from .sparse import init_zero_row

__all__ = ["EmbeddingBagConfig", "EmbeddingBagCollection", "EmbeddingCollection",
           "MultiTableEmbedding", "SHARDINGS"]

SHARDINGS = ("row_wise", "table_wise", "column_wise", "replicated")
ROW_WISE_MIN_BYTES = 1 << 20
_SBPS = {"row_wise": split(0), "table_wise": split(0), "column_wise": split(1),
         "replicated": broadcast}


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table of an :class:`EmbeddingBagCollection` (TorchRec's ``EmbeddingBagConfig``).

    Attributes:
        name: the table's name (its weight is ``embedding_bags.<name>.weight``).
        num_embeddings: rows (vocabulary size).
        embedding_dim: columns (width of the pooled output).
        feature_names: the input features looked up in this table (default ``[name]``);
            several features may share a table (e.g. two id lists over one vocabulary).
        pooling: ``"sum"``, ``"mean"`` or ``"max"`` (``torch.nn.EmbeddingBag``'s mode).
        padding_idx: ids left out of their bag (torch's ``padding_idx``), or None.
        sharding: one of :data:`SHARDINGS` to override the size rule, or None.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: Sequence[str] = field(default_factory=tuple)
    pooling: str = "sum"
    padding_idx: int | None = None
    sharding: str | None = None

    def features(self) -> list[str]:
        return list(self.feature_names) or [self.name]


class EmbeddingBagCollection(Module):
    """Many ``EmbeddingBag`` tables (own vocabulary, width, pooling), one fused lookup.

    Args:
        tables: the tables (:class:`EmbeddingBagConfig`, or dicts of its fields).
        placement: a 1-D placement to shard the tables over (see the module doc for the
            rule); None keeps every table local (plain torch on this process). Tables
            are initialised as ``torch.nn.EmbeddingBag``'s (N(0, 1), the padding row
            zeroed), drawn directly as global tensors (``sbpflow.randn``): with the same
            seed every layout holds the values one process would (each rank draws a whole
            table at a time and keeps its shard; under ``sbpflow.random.per_shard()`` each
            rank draws only its shard, for tables too big to draw whole).
        sparse: the tables' gradients are sparse COO tensors of the touched rows (of each
            rank's shard): step them with ``sbpflow.optim.SGD``/``Adagrad``/``SparseAdam``/
            ``SparseAdamW``.
        sharding: ``{table name: sharding}`` overrides (as ``EmbeddingBagConfig.sharding``).
        row_wise_min_bytes: tables at least this large are split by rows (default 1 MiB).
        include_last_offset: offsets of every feature hold the end of the last bag too.
        check_ids: check every id against its table's size on every rank (default True;
            rides on the exchange's counts all-gather).
        device, dtype: of the tables (torch's factory kwargs).

    ``forward(features, concat=False)``: ``features`` maps each feature name to this
    rank's bags of that feature, as

    * a 2-D int tensor ``(B_r, L)`` (each row a bag; pad with the table's ``padding_idx``),
    * a tuple ``(ids, offsets)`` or ``(ids, offsets, per_sample_weights)``: 1-D ids and
      ``(B_r,)`` offsets (torch's ``EmbeddingBag`` input; weights: pooling ``"sum"``
      only), or
    * a global 2-D tensor laid out S(0) on ``placement`` (its shard is taken),

    every feature with the same number of bags ``B_r`` on this rank (torch or local
    sbpflow tensors). Returns ``{feature: (B, D_t)}`` (``concat=True``: one ``(B, sum of
    D_t)`` tensor, features in table order), global and laid out S(0) over the batch
    (rank r's bags r-th, so the ``B_r`` must follow ``shard_shape``: equal, or the first
    ranks one longer) when ``placement`` is set, local otherwise. A data-parallel dense
    network follows directly.

    Raises:
        ValueError: unknown sharding, duplicate table or feature names, a feature missing
            from ``features`` or unknown, features with different bag counts, bad bags
            (see ``functional.embedding_bag``).
        IndexError: an id out of range (naming the id, its table, the table's size).
        sbpflow.graph.GraphError: called inside ``nn.Graph`` with row- or table-wise tables
            (the exchange's sizes depend on the ids): look the tables up eagerly.
    """

    def __init__(self, tables, placement: Placement | None = None, *, sparse: bool = False,
                 sharding: Mapping[str, str] | None = None,
                 row_wise_min_bytes: int = ROW_WISE_MIN_BYTES,
                 include_last_offset: bool = False, check_ids: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.configs = [t if isinstance(t, EmbeddingBagConfig) else EmbeddingBagConfig(**t)
                        for t in tables]
        if not self.configs:
            raise ValueError("EmbeddingBagCollection needs at least one table")
        names = [c.name for c in self.configs]
        feats = [f for c in self.configs for f in c.features()]
        for what, seq in (("table", names), ("feature", feats)):
            dup = sorted({x for x in seq if seq.count(x) > 1})
            if dup:
                raise ValueError(f"EmbeddingBagCollection: duplicate {what} names {dup}")
        overrides = dict(sharding or {})
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"EmbeddingBagCollection: sharding given for unknown tables "
                             f"{unknown}; tables are {names}")
        self.sparse, self.include_last_offset, self.check_ids = sparse, include_last_offset, \
            check_ids
        self.row_wise_min_bytes = int(row_wise_min_bytes)
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        if sparse and any(c.pooling == "max" for c in self.configs):
            raise ValueError(f"EmbeddingBagCollection: max pooling does not support sparse "
                             f"gradients (torch's rule); tables "
                             f"{[c.name for c in self.configs if c.pooling == 'max']}")
        self.placement = placement
        self.plan: dict[str, tuple[str, Placement | None]] = {
            c.name: ("local", None) for c in self.configs}
        self._spaces: dict = {}
        if placement is None:
            self.embedding_bags = ModuleDict({
                c.name: EmbeddingBag(c.num_embeddings, c.embedding_dim, mode=c.pooling,
                                     sparse=sparse, padding_idx=c.padding_idx, device=device,
                                     dtype=dtype) for c in self.configs})
            return
        # Sharded from the start: no rank ever holds a whole table (beyond the draw of
        # layout-invariant randomness; see sbpflow.random.per_shard for huge tables).
        plan = self.sharding_plan(placement, overrides)
        bags = {}
        for c in self.configs:
            kind, pl = plan[c.name]
            w = randn(c.num_embeddings, c.embedding_dim, dtype=dtype, placement=pl,
                      sbp=_SBPS[kind])
            if c.padding_idx is not None:
                with torch.no_grad():
                    init_zero_row(w, c.padding_idx % c.num_embeddings)
            bags[c.name] = EmbeddingBag(c.num_embeddings, c.embedding_dim, mode=c.pooling,
                                        sparse=sparse, padding_idx=c.padding_idx, _weight=w)
        self.embedding_bags = ModuleDict(bags)
        self.plan = plan

    # ------------------------------------------------------------------ sharding
    def sharding_plan(self, placement: Placement, overrides: Mapping[str, str] | None = None
                      ) -> dict[str, tuple[str, Placement]]:
        """``{table: (sharding, placement of its weight)}`` by the module doc's rule."""
        if placement.ndim != 1:
            raise ValueError(f"EmbeddingBagCollection: shard over a 1-D placement, got mesh "
                             f"{placement.shape}")
        overrides = dict(overrides or {})
        ranks = list(placement.rank_list)
        n = len(ranks)
        load = [0] * n
        kinds = {}
        for c in self.configs:
            kind = overrides.get(c.name) or c.sharding
            if kind is None:
                kind = "row_wise" if self._bytes(c) >= self.row_wise_min_bytes else "table_wise"
            if kind not in SHARDINGS:
                raise ValueError(f"EmbeddingBagCollection: table {c.name!r}: sharding "
                                 f"{kind!r} is not one of {SHARDINGS}")
            kinds[c.name] = kind
            if kind != "table_wise":
                share = self._bytes(c) if kind == "replicated" else -(-self._bytes(c) // n)
                load = [x + share for x in load]
        plan = {}
        for c in sorted(self.configs, key=lambda c: -self._bytes(c)):  # stable: ties keep order
            kind = kinds[c.name]
            if kind == "table_wise":
                i = min(range(n), key=lambda j: (load[j], j))
                load[i] += self._bytes(c)
                plan[c.name] = (kind, Placement(placement.type, [ranks[i]]))
            else:
                plan[c.name] = (kind, placement)
        return {c.name: plan[c.name] for c in self.configs}

    def _bytes(self, c: EmbeddingBagConfig) -> int:
        return c.num_embeddings * c.embedding_dim * self._itemsize

    def shard(self, placement: Placement, overrides: Mapping[str, str] | None = None
              ) -> EmbeddingBagCollection:
        """Lay the tables out on ``placement`` by :meth:`sharding_plan` (in place; every
        rank of the world calls it; the tables' current values are kept). A table already
        laid out as the plan says is left as it is (its local tensor too, so an optimizer
        built over it keeps stepping it); the others get new local tensors: build the
        optimizer after ``shard()``, as after ``parallelize_module``."""
        plan = self.sharding_plan(placement, overrides)
        for c in self.configs:
            kind, pl = plan[c.name]
            w = self.embedding_bags[c.name].weight
            if w.is_global and w.placement == pl and tuple(w.sbp) == (_SBPS[kind],):
                continue
            self.embedding_bags[c.name].to_global(pl, _SBPS[kind])
        self.placement, self.plan, self._spaces = placement, plan, {}
        return self

    def _keyspace(self, names: list[str]) -> Keyspace:
        key = tuple(names)
        if key not in self._spaces:
            ranks = self.placement.rank_list
            tables = []
            for name in names:
                c = self._config(name)
                kind, pl = self.plan[name]
                if kind == "row_wise":
                    ranges = row_ranges(pl, c.num_embeddings, (split(0),))
                else:  # whole on one rank
                    owner = pl.rank_list[0]
                    ranges = [(0, c.num_embeddings) if r == owner else (0, 0) for r in ranks]
                tables.append((name, c.num_embeddings, c.embedding_dim, ranges))
            self._spaces[key] = Keyspace(ranks, tables)
        return self._spaces[key]

    def _config(self, name: str) -> EmbeddingBagConfig:
        return next(c for c in self.configs if c.name == name)

    # ------------------------------------------------------------------ lookup
    def forward(self, features: Mapping, concat: bool = False):
        what = "EmbeddingBagCollection"
        fused = [c for c in self.configs if self.plan[c.name][0] in ("row_wise", "table_wise")]
        try:
            bags, nbags = self._bags(features)
        except (ValueError, TypeError, NotImplementedError) as e:
            if self.placement is None:
                raise
            # join the lookup's first all-gather (the exchange's counts, or the replicated
            # and column-wise tables' agreement) with an error flag, so that every rank
            # raises instead of waiting for this one until the timeout
            if fused:
                group = [c for c in fused
                         if self.embedding_bags[c.name].weight.dtype ==
                         self.embedding_bags[fused[0].name].weight.dtype]
                fetch_unique_rows(self._keyspace([c.name for c in group]),
                                  [torch.zeros(0, dtype=torch.int64) for _ in group],
                                  [self.embedding_bags[c.name].weight._local for c in group],
                                  sparse=self.sparse, what=what, extra=(0, 0, -1, 0), error=e)
            else:
                check_everywhere(what, self.placement.rank_list, [], [], error=e, extra=(0,))
            raise
        # This rank's verdict on the ids of its replicated tables, gathered with the first
        # fused exchange's counts (or alone, with the bag counts, when no table is fused).
        rep = [(c, f) for c in self.configs if self.plan[c.name][0] == "replicated"
               for f in c.features()]
        rep_names = [c.name for c, _ in rep]
        rep_sizes = [c.num_embeddings for c, _ in rep]
        bad = first_bad_id([bags[f][0] for _, f in rep], rep_sizes) if self.check_ids and \
            self.placement is not None else [0, -1, 0]
        batches = None  # every rank's number of bags, gathered with the exchange's counts
        out: dict[str, torch.Tensor | Tensor] = {}
        if self.placement is None:
            for c in self.configs:
                w = self.embedding_bags[c.name].weight._local
                for f in c.features():
                    ids, offs, psw = bags[f]
                    out[f] = TF.embedding_bag(ids, w, offs, mode=c.pooling, sparse=self.sparse,
                                              per_sample_weights=psw,
                                              include_last_offset=self.include_last_offset,
                                              padding_idx=c.padding_idx)
            return self._finish(out, concat, None)
        by_dtype: dict = {}
        for c in fused:
            by_dtype.setdefault(self.embedding_bags[c.name].weight.dtype, []).append(c)
        for group in by_dtype.values():
            graph_guard(f"EmbeddingBagCollection (tables {[c.name for c in group]})")
            space = self._keyspace([c.name for c in group])
            ids, lens = [], []
            for c in group:
                parts = [bags[f][0].reshape(-1) for f in c.features()]
                lens.append([p.numel() for p in parts])
                ids.append(torch.cat(parts))
            rows, extras = fetch_unique_rows(
                space, ids, [self.embedding_bags[c.name].weight._local for c in group],
                sparse=self.sparse, padding=[c.padding_idx for c in group],
                check=self.check_ids, what=what, extra=(nbags, *bad))
            if batches is None:
                raise_flagged(what, space.ranks, [e[1:] for e in extras], rep_names, rep_sizes)
            batches = [e[0] for e in extras]
            for c, (U, idx, pad), ln in zip(group, rows, lens):
                for f, part in zip(c.features(), torch.split(idx, ln)):
                    i, offs, psw = bags[f]
                    offs = None if offs is None else offs.to(torch.int64)
                    out[f] = TF.embedding_bag(part.view(i.shape), U, offs, mode=c.pooling,
                                              per_sample_weights=psw,
                                              include_last_offset=self.include_last_offset,
                                              padding_idx=pad)
        if batches is None:  # no fused exchange: one all-gather of the verdicts and counts
            batches = [e[0] for e in check_everywhere(what, self.placement.rank_list, rep_names,
                                                      rep_sizes, bad=bad, extra=(nbags,))]
        for c in self.configs:
            kind, pl = self.plan[c.name]
            w = self.embedding_bags[c.name].weight
            if kind == "replicated":
                for f in c.features():
                    i, offs, psw = bags[f]
                    if self.sparse:
                        raise ValueError(f"EmbeddingBagCollection: table {c.name!r} is "
                                         f"replicated and sparse=True; a sparse all-reduce is "
                                         f"not implemented: shard it row_wise or table_wise")
                    out[f] = TF.embedding_bag(i, w._local, offs, mode=c.pooling,
                                              per_sample_weights=psw,
                                              include_last_offset=self.include_last_offset,
                                              padding_idx=c.padding_idx)
            elif kind == "column_wise":
                for f in c.features():
                    i, offs, psw = bags[f]
                    if i.dim() != 2:
                        raise ValueError(f"EmbeddingBagCollection: table {c.name!r} is "
                                         f"column_wise and needs 2-D (padded) bags for "
                                         f"feature {f!r}")
                    o = F.embedding_bag(Tensor(i), w, None, mode=c.pooling, sparse=self.sparse,
                                        per_sample_weights=None if psw is None else Tensor(psw),
                                        padding_idx=c.padding_idx, check_ids=self.check_ids)
                    out[f] = o.to_global(pl, split(0))
        return self._finish(out, concat, self.placement, batches)

    def _finish(self, out: dict, concat: bool, pl, batches=None):
        what = "EmbeddingBagCollection"
        order = [f for c in self.configs for f in c.features()]
        if concat:
            parts = [out[f] for f in order]
            if pl is None:
                return Tensor(torch.cat(parts, 1))
            if any(isinstance(p, Tensor) for p in parts):  # column-wise outputs: global
                parts = [p if isinstance(p, Tensor) else per_rank_to_global(p, pl, batches, what)
                         for p in parts]
                from ...ops.view import cat

                return cat(parts, 1)
            return per_rank_to_global(torch.cat(parts, 1), pl, batches, what)
        res = {}
        for f in order:
            o = out[f]
            res[f] = o if isinstance(o, Tensor) else (
                Tensor(o) if pl is None else per_rank_to_global(o, pl, batches, what))
        return res

    def _bags(self, features: Mapping) -> dict:
        """Per feature (ids, offsets, per_sample_weights) as this rank's torch tensors."""
        if not isinstance(features, Mapping):
            raise TypeError(f"EmbeddingBagCollection: features must be a dict of feature name "
                            f"-> bags, got {type(features).__name__}")
        known = {f: c for c in self.configs for f in c.features()}
        extra = sorted(set(features) - set(known))
        missing = sorted(set(known) - set(features))
        if extra or missing:
            raise ValueError(f"EmbeddingBagCollection: features {sorted(known)} expected; "
                             f"missing {missing}, unknown {extra}")
        out, counts = {}, {}
        for f, c in known.items():
            v = features[f]
            if isinstance(v, (tuple, list)):
                if len(v) not in (2, 3):
                    raise ValueError(f"EmbeddingBagCollection: feature {f!r}: give (ids, "
                                     f"offsets) or (ids, offsets, per_sample_weights), got a "
                                     f"{type(v).__name__} of {len(v)}")
                ids, offs, psw = (*v, None) if len(v) == 2 else v
            else:
                ids, offs, psw = v, None, None
            ids, offs, psw = (_torch(x, f) for x in (ids, offs, psw))
            what = f"EmbeddingBagCollection feature {f!r} (table {c.name!r})"
            check_bags(what, ids, offs, c.pooling, psw, self.include_last_offset)
            nb = ids.shape[0] if ids.dim() == 2 else offs.numel() - int(self.include_last_offset)
            counts[f] = nb
            out[f] = (ids, offs, psw)
        if len(set(counts.values())) > 1:
            raise ValueError(f"EmbeddingBagCollection: every feature needs the same number of "
                             f"bags on a rank, got {counts}")
        return out, next(iter(counts.values()))

    def extra_repr(self) -> str:
        return "\n".join(f"{c.name}: {c.num_embeddings} x {c.embedding_dim}, "
                         f"{c.pooling}, {self.plan[c.name][0]}" for c in self.configs)


def _torch(x, f: str):
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Tensor):
        return x._local
    raise TypeError(f"EmbeddingBagCollection: feature {f!r}: expected tensors, got "
                    f"{type(x).__name__}")


#: TorchRec's ``EmbeddingCollection`` pools nothing; here every table pools (a bag of one
#: id per row is a plain lookup), so the name is an alias of the bag collection.
EmbeddingCollection = EmbeddingBagCollection
#: OneFlow's ``MultiTableEmbedding`` (one fused lookup of many tables).
MultiTableEmbedding = EmbeddingBagCollection
