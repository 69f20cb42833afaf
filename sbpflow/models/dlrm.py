"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", arXiv:1906.00091): dense features through a bottom MLP, one
embedding per categorical feature, the pairwise dot products of all those vectors (the
"interaction"), and a top MLP over the dot products and the bottom MLP's output, giving
one logit of a click.

Shapes: N batch, D dense features, F single-valued categorical features, L ids of the
multi-valued feature (a bag, padded), d = ``embedding_dim``, V = F + 2 vectors interact
(the bottom MLP's output, F embeddings, the pooled bag).

Inputs (the ``"ctr"`` task, see :mod:`sbpflow.models`): ``model(dense, sparse, bag,
bag_weights) -> logits``; dense (N, D) float32, sparse (N, F) int64 (column f in
``[0, vocab_sizes[f])``), bag (N, L) int64 in ``[0, bag_vocab)``, bag_weights (N, L)
float32 (the bag is ``sum_l bag_weights[:, l] * E[bag[:, l]]``: 0 drops a padding id,
``1 / count`` averages); logits (N,) float32 (train with ``binary_cross_entropy_with_logits``).

Written with ``sbpflow.nn`` only: the same file runs as a plain ``torch.nn.Module``
(``spec.build_torch()``) and in sbpflow, laid out by the ``"dp"`` plan
(:data:`TABLES_BY_ROWS`): the MLPs replicated (B) with the batch split (S(0)), i.e. data
parallel, and every table split by rows (S(0)) over the ranks, i.e. model parallel: each
rank holds ``ceil(V / ranks)`` rows of a table, and a lookup exchanges only the ids its
batch touches and their rows (``sbpflow.nn.functional.embedding_bag``, two all-to-alls
forward and two backward per table).
"""

from __future__ import annotations

from dataclasses import dataclass

import sbpflow
import sbpflow.nn as nn
from sbpflow.models._twin import twin_builder
from sbpflow.models.spec import ModelSpec, register
from sbpflow.nn.parallel import ParallelStyle
from sbpflow.sbp import split


@dataclass
class DLRMConfig:
    vocab_sizes: tuple = (943, 1682, 7, 2, 21, 111)  # rows of each single-valued table
    bag_vocab: int = 20  # rows of the multi-valued (bag) feature's table; 0: no bag
    num_dense: int = 2  # dense features D; 0: no bottom MLP
    embedding_dim: int = 16  # d: width of every table and of the bottom MLP's output
    bottom_mlp: tuple = (32,)  # hidden widths of the bottom MLP (its output is d wide)
    top_mlp: tuple = (64, 32)  # hidden widths of the top MLP (its output is 1 logit)
    sparse: bool = False  # sparse table gradients (EmbeddingBag(sparse=True): touched rows)


class RowSplit(ParallelStyle):
    """Every parameter of the matched module split by rows, S(0): an embedding table's
    vocabulary spread over the ranks (model parallel)."""

    def param_sbp(self, module, name, t):
        return split(0)


#: The ``"dp"`` plan of the recommendation models: tables by rows, the rest replicated.
TABLES_BY_ROWS = {"*embedding_bags.*": RowSplit()}  # every table of a Tables


def check_features(sparse, bag, num_tables: int, has_bag: bool) -> None:
    """Raise ValueError unless ``sparse`` is (N, num_tables) and ``bag`` is given exactly
    when the model has a bag table. (Ids out of a table's range raise IndexError in the
    lookup, naming the id and the table.)"""
    if sparse.ndim != 2 or sparse.shape[1] != num_tables:
        raise ValueError(f"sparse features of shape {tuple(sparse.shape)}: the model has "
                         f"{num_tables} tables (config.vocab_sizes), so give (N, "
                         f"{num_tables}) ids, one column per table")
    if has_bag and bag is None:
        raise ValueError("the model has a bag table (config.bag_vocab > 0) but no bag ids "
                         "were given; pass bag and bag_weights, or set bag_vocab=0")
    if not has_bag and bag is not None:
        raise ValueError("bag ids given, but the model has no bag table (config.bag_vocab "
                         "is 0); set bag_vocab to the bag's vocabulary")


def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    """Linear layers ``widths[0] -> widths[1] -> ...``, ReLU between them (and after the
    last one when ``last_relu``)."""
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Tables(nn.Module):
    """Embedding tables looked up together. ``tables``: ``[(name, rows, width), ...]``;
    ``forward(features) -> [(N, width) per table, in order]`` with ``features[name] =
    (ids, weights)``: ids (N, L) int64 (each row a bag), weights (N, L) float32 or None;
    a bag is ``sum_l weights[:, l] * table[ids[:, l]]`` (torch's ``EmbeddingBag(mode=
    "sum")`` with ``per_sample_weights``).

    Under sbpflow the tables form one ``nn.EmbeddingBagCollection``: laid out by rows (the
    ``"dp"`` plan; the collection takes that layout at its first global lookup) every table
    is looked up by ONE exchange (an all-gather of counts and two all-to-alls forward, two
    backward), not one per table. In the torch twin (``torch.nn`` has no collection) they
    are ``EmbeddingBag``s in a ``ModuleDict``. Inside ``nn.Graph``, and whenever the tables
    are not all split by rows on one placement, each table is looked up on its own, in
    whatever layout its weight has (B, S(0), S(1); in a graph the registered
    ``embedding_bag``, whose sizes do not depend on the ids). Both name the weights
    ``collection.embedding_bags.<name>.weight`` and draw them N(0, 1) in list order, so one
    seed gives both the same values.
    """

    def __init__(self, tables: list, sparse: bool = False):
        super().__init__()
        self.names = [name for name, _, _ in tables]
        self.fused = hasattr(nn, "EmbeddingBagCollection")  # False in the torch twin
        if self.fused:
            self.collection = nn.EmbeddingBagCollection(
                [nn.EmbeddingBagConfig(name, rows, width, pooling="sum", sharding="row_wise")
                 for name, rows, width in tables], sparse=sparse)
        else:  # the torch twin
            self.collection = nn.Module()
            self.collection.embedding_bags = nn.ModuleDict({
                name: nn.EmbeddingBag(rows, width, mode="sum", sparse=sparse)
                for name, rows, width in tables})

    def _row_split(self) -> bool:
        """Every table split by rows (S(0)) on one 1-D placement: the layout the
        collection's one exchange looks up (the ``"dp"`` plan's)."""
        ws = self.weights()
        pl = ws[0].placement
        return pl.ndim == 1 and all(w.is_global and w.placement == pl and w.sbp == (split(0),)
                                    for w in ws)

    def _adopt_layout(self) -> None:
        """Make the collection look its tables up as they are laid out (every table S(0) on
        one placement: :meth:`_row_split`). The collection's ``shard()`` would lay the
        weights out again (new local tensors: an optimizer built before would step stale
        ones), so only its ``placement`` and ``plan`` are set."""
        pl = self.weights()[0].placement
        self.collection.placement = pl
        self.collection.plan = self.collection.sharding_plan(pl)

    def weights(self) -> list:
        return [self.collection.embedding_bags[name].weight for name in self.names]

    def forward(self, features: dict) -> list:
        bags = self.collection.embedding_bags
        if not self.fused:
            return [bags[n](features[n][0], per_sample_weights=features[n][1])
                    for n in self.names]
        if bags[self.names[0]].weight.is_global:
            if sbpflow.distributed.tracing() or not self._row_split():
                # inside nn.Graph, or laid out otherwise than all by rows (a plan or the
                # auto-parallel search chose each table's layout): each table on its own
                # (in a graph the registered embedding_bag, whose sizes are fixed: a
                # row-split table pools its rows of the gathered ids into a partial sum)
                return [bags[n](features[n][0], per_sample_weights=features[n][1])
                        for n in self.names]
            if self.collection.placement != self.weights()[0].placement:
                self._adopt_layout()
        inputs = {}
        for n in self.names:  # this rank's bags: 1-D ids, offsets, weights
            ids, w = features[n]
            ids = ids.to_local() if ids.is_global else ids
            w = None if w is None else (w.to_local() if w.is_global else w)
            offsets = sbpflow.arange(0, ids.shape[0] * ids.shape[1], ids.shape[1])
            inputs[n] = (ids.reshape(-1), offsets, None if w is None else w.reshape(-1))
        out = self.collection(inputs)
        return [out[n] for n in self.names]


class Embeddings(nn.Module):
    """One table per categorical feature (``f0``, ``f1``, ...) and one for the bag
    (``bag``), all of width d, in one :class:`Tables`: ``forward(sparse, bag,
    bag_weights) -> (N, F + 1, d)`` (the bag last; (N, F, d) without a bag). Tables are
    drawn N(0, 1) as torch's EmbeddingBag, then scaled by ``1 / sqrt(d)`` so that the dot
    products start near 1."""

    def __init__(self, config: DLRMConfig):
        super().__init__()
        d = config.embedding_dim
        self.num_features = len(config.vocab_sizes)
        self.has_bag = bool(config.bag_vocab)
        specs = [(f"f{i}", v, d) for i, v in enumerate(config.vocab_sizes)]
        if self.has_bag:
            specs.append(("bag", config.bag_vocab, d))
        self.tables = Tables(specs, sparse=config.sparse)
        with sbpflow.no_grad():
            for w in self.tables.weights():
                w.mul_(d ** -0.5)

    def forward(self, sparse, bag=None, bag_weights=None):
        check_features(sparse, bag, self.num_features, self.has_bag)
        features = {f"f{i}": (sparse[:, i:i + 1], None) for i in range(self.num_features)}
        if self.has_bag:
            features["bag"] = (bag, bag_weights)
        return sbpflow.stack(self.tables(features), dim=1)  # (N, F + 1, d)


class DotInteraction(nn.Module):
    """The pairwise dot products of V vectors: (N, V, d) -> (N, V (V - 1) / 2), the strictly
    lower triangle of ``x @ x.T`` in row-major order (DLRM's ``interaction_op="dot"``
    without self-interaction)."""

    def __init__(self, num_vectors: int):
        super().__init__()
        flat = [i * num_vectors + j for i in range(num_vectors) for j in range(i)]
        self.register_buffer("index", sbpflow.tensor(flat, dtype=sbpflow.int64),
                             persistent=False)

    def forward(self, x):  # (N, V, d)
        z = sbpflow.bmm(x, x.transpose(1, 2))  # (N, V, V)
        return z.flatten(1).index_select(1, self.index)  # (N, V (V - 1) / 2)


class DLRM(nn.Module):
    """``model(dense, sparse, bag=None, bag_weights=None) -> logits`` (N,) (see the module
    doc)."""

    def __init__(self, config: DLRMConfig):
        super().__init__()
        d = config.embedding_dim
        self.config = config
        self.bottom = mlp([config.num_dense, *config.bottom_mlp, d], last_relu=True) \
            if config.num_dense else None
        self.embeddings = Embeddings(config)
        v = len(config.vocab_sizes) + (1 if config.bag_vocab else 0) + \
            (1 if config.num_dense else 0)
        self.interaction = DotInteraction(v)
        top_in = v * (v - 1) // 2 + (d if config.num_dense else 0)
        self.top = mlp([top_in, *config.top_mlp, 1], last_relu=False)

    def forward(self, dense, sparse, bag=None, bag_weights=None):
        emb = self.embeddings(sparse, bag, bag_weights)  # (N, F + 1, d)
        if self.bottom is None:
            return self.top(self.interaction(emb)).squeeze(1)  # (N,)
        x = self.bottom(dense)  # (N, d)
        vectors = sbpflow.cat([x.unsqueeze(1), emb], dim=1)  # (N, V, d)
        z = sbpflow.cat([x, self.interaction(vectors)], dim=1)  # (N, d + V (V - 1) / 2)
        return self.top(z).squeeze(1)  # (N,)


# MovieLens-100k (sbpflow.apps.datasets.load_movielens): 6 categorical features, the genre bag,
# 2 dense features; 50k parameters. `sbpflow train dlrm-ml100k --nproc-per-node 2` (400
# steps of 1024): validation AUC 0.781 (the torch twin with the same settings: 0.781).
# Plain PyTorch, one process, Adam lr 1e-3, batch 256: 0.786 after 6 epochs.
register(ModelSpec(name="dlrm-ml100k", family="dlrm", task="ctr", config=DLRMConfig(),
                   builder=DLRM, plans={"dp": TABLES_BY_ROWS}, default_layout="dp",
                   torch_builder=twin_builder(__name__, "DLRM")))
