"""Wide & Deep (Cheng et al. 2016, "Wide & Deep Learning for Recommender Systems",
arXiv:1606.07792): a wide linear model over the sparse features (a 1-wide embedding per
id: the weight of that id) and the dense ones, plus a deep MLP over the concatenated
embeddings and the dense features; the logit of a click is their sum.

Shapes: N batch, D dense features, F single-valued categorical features, L ids of the
multi-valued feature (a bag, padded), d = ``embedding_dim``.

Inputs (the ``"ctr"`` task, see :mod:`sbpflow.models`), as DLRM's
(:mod:`sbpflow.models.dlrm`): ``model(dense, sparse, bag, bag_weights) -> logits``; dense
(N, D) float32, sparse (N, F) int64, bag (N, L) int64, bag_weights (N, L) float32; logits
(N,) float32.

Written with ``sbpflow.nn`` only (runs as a plain ``torch.nn.Module`` too: the torch twin).
Laid out as DLRM (:data:`sbpflow.models.dlrm.TABLES_BY_ROWS`): tables, the wide ones
included, split by rows over the ranks and looked up by one exchange; the MLP and the
dense linear replicated, the batch split.
"""

from __future__ import annotations

from dataclasses import dataclass

import sbpflow
import sbpflow.nn as nn
from sbpflow.models._twin import twin_builder
from sbpflow.models.dlrm import TABLES_BY_ROWS, Tables, check_features
from sbpflow.models.spec import ModelSpec, register


@dataclass
class WideDeepConfig:
    vocab_sizes: tuple = (943, 1682, 7, 2, 21, 111)  # rows of each single-valued table
    bag_vocab: int = 20  # rows of the multi-valued (bag) feature's table; 0: no bag
    num_dense: int = 2  # dense features D (inputs of both parts)
    embedding_dim: int = 16  # d: width of the deep part's tables
    deep_mlp: tuple = (64, 32)  # hidden widths of the deep MLP (its output is 1 logit)


class WideDeep(nn.Module):
    """``model(dense, sparse, bag=None, bag_weights=None) -> logits`` (N,) (see the module
    doc). All tables, the wide part's (``wide_f0``, ..., ``wide_bag``, width 1) and the
    deep part's (``f0``, ..., ``bag``, width d), are one :class:`~sbpflow.models.dlrm.Tables`:
    one lookup (under sbpflow one exchange) for both parts. The wide part's id weights
    start at 0 (a linear model's usual start); the deep tables N(0, 1) scaled by
    ``1 / sqrt(d)``."""

    def __init__(self, config: WideDeepConfig):
        super().__init__()
        self.config = config
        d = config.embedding_dim
        self.features = [f"f{i}" for i in range(len(config.vocab_sizes))]
        vocab = list(config.vocab_sizes)
        if config.bag_vocab:
            self.features.append("bag")
            vocab.append(config.bag_vocab)
        self.tables = Tables([("wide_" + f, v, 1) for f, v in zip(self.features, vocab)] +
                             [(f, v, d) for f, v in zip(self.features, vocab)])
        self.wide_dense = nn.Linear(config.num_dense, 1) if config.num_dense else None
        widths = [len(self.features) * d + config.num_dense, *config.deep_mlp]
        layers = []
        for i in range(len(widths) - 1):
            layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], 1))
        self.mlp = nn.Sequential(*layers)
        k = len(self.features)
        with sbpflow.no_grad():
            for i, w in enumerate(self.tables.weights()):
                if i < k:
                    w.zero_()  # wide
                else:
                    w.mul_(d ** -0.5)  # deep

    def forward(self, dense, sparse, bag=None, bag_weights=None):
        check_features(sparse, bag, len(self.config.vocab_sizes), bool(self.config.bag_vocab))
        ids = {f"f{i}": (sparse[:, i:i + 1], None) for i in range(sparse.shape[1])}
        if bag is not None:
            ids["bag"] = (bag, bag_weights)
        out = self.tables({**ids, **{"wide_" + f: v for f, v in ids.items()}})
        k = len(self.features)
        wide = sbpflow.cat(out[:k], dim=1).sum(dim=1)  # (N,): the sum of the ids' weights
        deep_in = sbpflow.cat(out[k:], dim=1)  # (N, (F + 1) d)
        if self.wide_dense is not None:
            wide = wide + self.wide_dense(dense).squeeze(1)
            deep_in = sbpflow.cat([deep_in, dense], dim=1)  # (N, (F + 1) d + D)
        return wide + self.mlp(deep_in).squeeze(1)  # (N,)


# MovieLens-100k, as dlrm-ml100k; 57k parameters. `sbpflow train wide-deep-ml100k
# --nproc-per-node 2`: validation AUC 0.783 (the torch twin with the same settings: 0.783).
register(ModelSpec(name="wide-deep-ml100k", family="wide_deep", task="ctr",
                   config=WideDeepConfig(), builder=WideDeep,
                   plans={"dp": TABLES_BY_ROWS}, default_layout="dp",
                   torch_builder=twin_builder(__name__, "WideDeep")))
