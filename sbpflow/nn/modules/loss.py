"""Loss modules (torch.nn's arguments and defaults), thin wrappers of
:mod:`sbpflow.nn.functional`; a loss over a split batch is a 0-dim P (or B) tensor whose
``backward()`` gives the single-device gradients."""

from __future__ import annotations

from .. import functional as F
from ..module import Module

__all__ = ["CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCEWithLogitsLoss", "BCELoss",
           "CosineEmbeddingLoss", "CosineSimilarity", "HuberLoss", "KLDivLoss",
           "MarginRankingLoss", "PairwiseDistance", "SmoothL1Loss", "TripletMarginLoss"]


class _Loss(Module):
    def __init__(self, reduction: str = "mean", allowed=("none", "mean", "sum")):
        super().__init__()
        if reduction not in allowed:
            raise ValueError(f"{reduction!r} is not a valid value for reduction; use one of "
                             f"{allowed}")
        self.reduction = reduction


class CrossEntropyLoss(_Loss):
    """``F.cross_entropy``: logits (N, C) or (N, C, d...) and class indices or
    probabilities; on class-split logits the vocabulary-parallel algorithm runs."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, input, target):  # noqa: A002
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class NLLLoss(_Loss):
    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean"):
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index

    def forward(self, input, target):  # noqa: A002
        return F.nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index,
                          reduction=self.reduction)


class MSELoss(_Loss):
    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, input, target):  # noqa: A002
        return F.mse_loss(input, target, reduction=self.reduction)


class L1Loss(_Loss):
    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(reduction)

    def forward(self, input, target):  # noqa: A002
        return F.l1_loss(input, target, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
    def __init__(self, weight=None, size_average=None, reduce=None, reduction: str = "mean",
                 pos_weight=None):
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input, target):  # noqa: A002
        return F.binary_cross_entropy_with_logits(input, target, self.weight,
                                                  reduction=self.reduction,
                                                  pos_weight=self.pos_weight)


class BCELoss(_Loss):
    """``F.binary_cross_entropy`` on probabilities; ``weight`` (a buffer) broadcasts to the
    input."""

    def __init__(self, weight=None, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(reduction)
        self.register_buffer("weight", weight)

    def forward(self, input, target):  # noqa: A002
        return F.binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class KLDivLoss(_Loss):
    """``F.kl_div``: ``reduction`` also ``'batchmean'`` (sum / batch size)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean",
                 log_target: bool = False):
        super().__init__(reduction, ("none", "mean", "sum", "batchmean"))
        self.log_target = log_target

    def forward(self, input, target):  # noqa: A002
        return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)


class SmoothL1Loss(_Loss):
    def __init__(self, size_average=None, reduce=None, reduction: str = "mean",
                 beta: float = 1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):  # noqa: A002
        return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):  # noqa: A002
        return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class MarginRankingLoss(_Loss):
    def __init__(self, margin: float = 0.0, size_average=None, reduce=None,
                 reduction: str = "mean"):
        super().__init__(reduction)
        self.margin = margin

    def forward(self, input1, input2, target):
        return F.margin_ranking_loss(input1, input2, target, margin=self.margin,
                                     reduction=self.reduction)


class CosineEmbeddingLoss(MarginRankingLoss):
    def forward(self, input1, input2, target):
        return F.cosine_embedding_loss(input1, input2, target, margin=self.margin,
                                       reduction=self.reduction)


class TripletMarginLoss(_Loss):
    def __init__(self, margin: float = 1.0, p: float = 2.0, eps: float = 1e-6,
                 swap: bool = False, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(reduction)
        if margin <= 0:
            raise ValueError(f"TripletMarginLoss: margin must be > 0, got {margin}")
        self.margin, self.p, self.eps, self.swap = margin, p, eps, swap

    def forward(self, anchor, positive, negative):
        return F.triplet_margin_loss(anchor, positive, negative, margin=self.margin, p=self.p,
                                     eps=self.eps, swap=self.swap, reduction=self.reduction)


class CosineSimilarity(Module):
    """``F.cosine_similarity`` over ``dim``."""

    def __init__(self, dim: int = 1, eps: float = 1e-8):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1, x2):
        return F.cosine_similarity(x1, x2, self.dim, self.eps)


class PairwiseDistance(Module):
    """``F.pairwise_distance`` over the last dim."""

    def __init__(self, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False):
        super().__init__()
        self.norm, self.eps, self.keepdim = p, eps, keepdim

    def forward(self, x1, x2):
        return F.pairwise_distance(x1, x2, self.norm, self.eps, self.keepdim)
