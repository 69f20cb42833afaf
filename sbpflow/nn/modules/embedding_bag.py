"""EmbeddingBag (torch.nn's arguments, names and initialisation), on local and sharded
tables."""

from __future__ import annotations

import torch

from ...tensor import Tensor
from .. import functional as F
from ..module import Module, Parameter
from ._common import empty_param
from .sparse import check_padding_idx, reset_table

__all__ = ["EmbeddingBag"]


class EmbeddingBag(Module):
    """Sums, means or maxes of bags of embeddings, without materialising the per-id rows
    (``torch.nn.EmbeddingBag``: same arguments, defaults, ``weight`` (num_embeddings,
    embedding_dim) initialised N(0, 1) with the ``padding_idx`` row zeroed,
    ``from_pretrained``).

    ``forward(input, offsets=None, per_sample_weights=None)``: ``input`` 2-D ``(B, L)``
    (each row a bag) or 1-D ``(N,)`` with ``offsets`` ``(B,)`` (``(B+1,)`` with
    ``include_last_offset``); returns ``(B, embedding_dim)``. See
    :func:`sbpflow.nn.functional.embedding_bag` for the layouts: lay the module out with
    ``module.to_global(placement, sbp=split(0))`` (rows split over the ranks: the
    deduplicated all-to-all lookup, for tables larger than one device), ``split(1)``
    (columns split) or ``broadcast`` (replicated). With a global weight the ids may be each
    rank's own local bags (a data-parallel batch): the output is then global, S(0) over the
    batch.

    ``sparse=True``: the weight's gradient is a sparse COO tensor holding only the looked-up
    rows (on each rank, of its own shard); step it with ``sbpflow.optim.SGD``,
    ``Adagrad``, ``SparseAdam`` or ``SparseAdamW`` (lazy updates of the touched rows).

    Attributes:
        check_ids: (sbpflow) check ids against ``num_embeddings`` on every rank before
            the exchange (default True; see ``functional.embedding_bag``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm=None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = False, _weight=None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"EmbeddingBag: mode must be 'sum', 'mean' or 'max', got {mode!r}")
        padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.mode, self.sparse = scale_grad_by_freq, mode, sparse
        self.include_last_offset, self.padding_idx = include_last_offset, padding_idx
        self.check_ids = True
        if _weight is None:
            self.weight = empty_param(num_embeddings, embedding_dim, device=device, dtype=dtype)
            self.reset_parameters()
        else:
            w = _weight if isinstance(_weight, Tensor) else Tensor(torch.as_tensor(_weight))
            if tuple(w.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"EmbeddingBag: _weight has shape {tuple(w.shape)}, expected "
                                 f"({num_embeddings}, {embedding_dim})")
            self.weight = Parameter(w)

    def reset_parameters(self) -> None:
        reset_table(self.weight, self.padding_idx)

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, max_norm=None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        mode: str = "mean", sparse: bool = False,
                        include_last_offset: bool = False, padding_idx=None) -> EmbeddingBag:
        """``torch.nn.EmbeddingBag.from_pretrained``: a bag over the 2-D ``embeddings``."""
        if embeddings.ndim != 2:
            raise ValueError(f"Embeddings parameter is expected to be 2-dimensional, got "
                             f"shape {tuple(embeddings.shape)}")
        rows, cols = embeddings.shape
        bag = cls(rows, cols, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                  embeddings, include_last_offset, padding_idx)
        bag.weight.requires_grad_(not freeze)
        return bag

    def forward(self, input, offsets=None, per_sample_weights=None):  # noqa: A002
        return F.embedding_bag(input, self.weight, offsets, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.mode, self.sparse,
                               per_sample_weights, self.include_last_offset, self.padding_idx,
                               check_ids=self.check_ids, name=self._name())

    def _name(self) -> str:
        return f"EmbeddingBag({self.num_embeddings}, {self.embedding_dim})"

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.sparse:
            s += ", sparse=True"
        return s
