"""Embedding (torch.nn's arguments, names and initialisation)."""

from __future__ import annotations

import torch

from ...tensor import Tensor
from .. import functional as F
from .. import init
from ..module import Module, Parameter
from ._common import empty_param

__all__ = ["Embedding"]


class Embedding(Module):
    """A lookup table ``weight`` (num_embeddings, embedding_dim), initialised N(0, 1) with the
    ``padding_idx`` row zeroed (``torch.nn.Embedding``). Weight S(0) is the
    vocabulary-parallel embedding (output P), weight S(1) splits the output's last dim."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight=None, _freeze: bool = False, device=None,
                 dtype=None):
        super().__init__()
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise ValueError("Embedding: max_norm, scale_grad_by_freq and sparse are not "
                             "supported")
        padding_idx = check_padding_idx(padding_idx, num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        if _weight is None:
            self.weight = empty_param(num_embeddings, embedding_dim, device=device, dtype=dtype,
                                      requires_grad=not _freeze)
            self.reset_parameters()
        else:
            w = _weight if isinstance(_weight, Tensor) else Tensor(torch.as_tensor(_weight))
            self.weight = Parameter(w, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        reset_table(self.weight, self.padding_idx)

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, padding_idx=None, **kw):
        rows, cols = embeddings.shape
        return cls(rows, cols, _weight=embeddings, _freeze=freeze, padding_idx=padding_idx, **kw)

    def forward(self, input):  # noqa: A002
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


def check_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
    """torch's ``padding_idx`` rule: within ``[-num_embeddings, num_embeddings)``, made
    non-negative; raises ValueError naming both otherwise."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings "
                         f"({num_embeddings})")
    return padding_idx % num_embeddings


def reset_table(w: Tensor, padding_idx: int | None) -> None:
    """torch's embedding initialisation: N(0, 1), the ``padding_idx`` row zeroed."""
    init.normal_(w)
    if padding_idx is not None:
        with torch.no_grad():
            if w.is_local:
                w._local[padding_idx].fill_(0)
            else:
                init_zero_row(w, padding_idx)


def init_zero_row(w: Tensor, row: int) -> None:
    """Zero row ``row`` of a global weight in place (each rank zeroes it in its shard)."""
    sl = w.placement.shard_slices(tuple(w.shape), w.sbp)
    if w.placement.coord() is None:
        return
    start, stop = sl[0].start, sl[0].stop
    if start <= row < stop:
        w._local[row - start].fill_(0)
