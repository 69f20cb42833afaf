"""Loss modules (torch.nn's arguments and defaults), thin wrappers of
:mod:`sbpflow.nn.functional`; a loss over a split batch is a 0-dim P (or B) tensor whose
``backward()`` gives the single-device gradients."""

from __future__ import annotations

import math
import warnings
from collections import namedtuple

from torch.nn import _reduction

from ...ops.pointwise import where
from ...ops.view import cat
from .. import functional as F
from ..module import Module
from .container import ModuleList, Sequential
from .linear import Linear

__all__ = ["CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCEWithLogitsLoss", "BCELoss",
           "CosineEmbeddingLoss", "CosineSimilarity", "HuberLoss", "KLDivLoss",
           "MarginRankingLoss", "PairwiseDistance", "SmoothL1Loss", "TripletMarginLoss",
           # issue 21
           "AdaptiveLogSoftmaxWithLoss", "CTCLoss", "GaussianNLLLoss", "HingeEmbeddingLoss",
           "LinearCrossEntropyLoss", "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss",
           "MultiMarginLoss", "NLLLoss2d", "PoissonNLLLoss", "SoftMarginLoss",
           "TripletMarginWithDistanceLoss"]


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


# ------------------------------------------------------------------ more losses (issue 21)
def _legacy_reduction(size_average, reduce, reduction: str) -> str:
    """torch's ``_Loss``: the deprecated ``size_average``/``reduce``, when either is given,
    decide the reduction (with torch's deprecation warning)."""
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_string(size_average, reduce)
    return reduction


class PoissonNLLLoss(_Loss):
    """``F.poisson_nll_loss``: ``exp(input) - target * input`` (``log_input``), else
    ``input - target * log(input + eps)``; ``full`` adds Stirling's term."""

    def __init__(self, log_input: bool = True, full: bool = False, size_average=None,
                 eps: float = 1e-8, reduce=None, reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))
        self.log_input, self.full, self.eps = log_input, full, eps

    def forward(self, log_input, target):
        return F.poisson_nll_loss(log_input, target, log_input=self.log_input, full=self.full,
                                  eps=self.eps, reduction=self.reduction)


class GaussianNLLLoss(_Loss):
    """``F.gaussian_nll_loss``: ``forward(input, target, var)`` (var: a tensor or a float)."""

    def __init__(self, *, full: bool = False, eps: float = 1e-6, reduction: str = "mean"):
        super().__init__(reduction)
        self.full, self.eps = full, eps

    def forward(self, input, target, var):  # noqa: A002
        return F.gaussian_nll_loss(input, target, var, full=self.full, eps=self.eps,
                                   reduction=self.reduction)


class HingeEmbeddingLoss(_Loss):
    """``F.hinge_embedding_loss``: ``x`` for target 1, ``max(0, margin - x)`` for -1."""

    def __init__(self, margin: float = 1.0, size_average=None, reduce=None,
                 reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))
        self.margin = margin

    def forward(self, input, target):  # noqa: A002
        return F.hinge_embedding_loss(input, target, margin=self.margin,
                                      reduction=self.reduction)


class SoftMarginLoss(_Loss):
    """``F.soft_margin_loss``: ``log(1 + exp(-target * input))``."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))

    def forward(self, input, target):  # noqa: A002
        return F.soft_margin_loss(input, target, reduction=self.reduction)


class MultiLabelSoftMarginLoss(_Loss):
    """``F.multilabel_soft_margin_loss``; ``weight`` (C,) is a buffer, as in torch."""

    def __init__(self, weight=None, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))
        self.register_buffer("weight", weight)

    def forward(self, input, target):  # noqa: A002
        return F.multilabel_soft_margin_loss(input, target, weight=self.weight,
                                             reduction=self.reduction)


class MultiMarginLoss(_Loss):
    """``F.multi_margin_loss`` (multi-class hinge); ``weight`` (C,) is a buffer.

    Raises:
        ValueError: ``p`` not 1 or 2, a weight that is not 1-D.
    """

    def __init__(self, p: int = 1, margin: float = 1.0, weight=None, size_average=None,
                 reduce=None, reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))
        if p not in (1, 2):
            raise ValueError("only p == 1 and p == 2 supported")
        if weight is not None and weight.ndim != 1:
            raise ValueError(f"MultiMarginLoss: weight must be one-dimensional, got shape "
                             f"{tuple(weight.shape)}")
        self.p, self.margin = p, margin
        self.register_buffer("weight", weight)

    def forward(self, input, target):  # noqa: A002
        return F.multi_margin_loss(input, target, p=self.p, margin=self.margin,
                                   weight=self.weight, reduction=self.reduction)


class MultiLabelMarginLoss(_Loss):
    """``F.multilabel_margin_loss`` (multi-label hinge; targets -1-terminated)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__(_legacy_reduction(size_average, reduce, reduction))

    def forward(self, input, target):  # noqa: A002
        return F.multilabel_margin_loss(input, target, reduction=self.reduction)


class TripletMarginWithDistanceLoss(_Loss):
    """``F.triplet_margin_with_distance_loss`` with a ``distance_function`` of sbpflow
    tensors (default ``F.pairwise_distance``).

    Raises:
        ValueError: ``margin <= 0``.
    """

    def __init__(self, *, distance_function=None, margin: float = 1.0, swap: bool = False,
                 reduction: str = "mean"):
        super().__init__(reduction)
        if margin <= 0:
            raise ValueError(f"TripletMarginWithDistanceLoss: expected margin to be greater "
                             f"than 0, got {margin} instead")
        self.distance_function = distance_function if distance_function is not None else \
            F.pairwise_distance
        self.margin, self.swap = margin, swap

    def forward(self, anchor, positive, negative):
        return F.triplet_margin_with_distance_loss(
            anchor, positive, negative, distance_function=self.distance_function,
            margin=self.margin, swap=self.swap, reduction=self.reduction)


class CTCLoss(_Loss):
    """``F.ctc_loss``: ``forward(log_probs, targets, input_lengths, target_lengths)``;
    a batch split of log_probs (dim 1) and of padded targets and lengths passes."""

    def __init__(self, blank: int = 0, reduction: str = "mean", zero_infinity: bool = False):
        super().__init__(reduction)
        self.blank, self.zero_infinity = blank, zero_infinity

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, self.blank,
                          self.reduction, self.zero_infinity)


class NLLLoss2d(NLLLoss):
    """torch's deprecated alias of :class:`NLLLoss` (with torch's warning)."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean"):
        warnings.warn("`NLLLoss2d` has been deprecated. Please use `NLLLoss` instead as a "
                      "drop-in replacement and see https://pytorch.org/docs/main/nn.html#torch"
                      ".nn.NLLLoss for more details.", FutureWarning, stacklevel=2)
        super().__init__(weight, size_average, ignore_index, reduce,
                         _legacy_reduction(size_average, reduce, reduction))


class LinearCrossEntropyLoss(_Loss):
    """``torch.nn.LinearCrossEntropyLoss``: a ``Linear(in_features, C * prod(out_features),
    bias)`` (parameters ``linear.weight``/``linear.bias``, torch's initialisation) whose
    logits, reshaped to (N, C, *out_features), go to :func:`F.cross_entropy`
    (``F.linear_cross_entropy``). ``weight`` (C,) is a buffer; ``options`` is accepted
    and not used (see ``F.linear_cross_entropy``). Tensor parallel: ``linear.weight``
    S(0) splits the classes (vocabulary-parallel cross entropy, no gather of logits).

    Raises:
        ValueError: a weight that is not (C,), ``label_smoothing`` outside [0, 1].
    """

    def __init__(self, in_features: int, num_classes: int, *, out_features=(),
                 bias: bool = False, device=None, dtype=None, reduction: str = "mean",
                 weight=None, ignore_index: int | None = None, label_smoothing: float = 0.0,
                 options=None):
        if weight is not None and tuple(weight.shape) != (num_classes,):
            raise ValueError(f"LinearCrossEntropyLoss: expected weight shape to be "
                             f"{(num_classes,)}, got {tuple(weight.shape)}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"LinearCrossEntropyLoss: expected label_smoothing to be in "
                             f"range [0, 1], got {label_smoothing}")
        super().__init__(reduction)
        self.register_buffer("weight", weight)
        self.num_classes, self.out_features = num_classes, tuple(out_features)
        self.ignore_index, self.label_smoothing, self.options = (ignore_index,
                                                                 label_smoothing, options)
        self.linear = Linear(in_features, math.prod(self.out_features, start=num_classes),
                             bias=bias, device=device, dtype=dtype)

    def forward(self, input, target):  # noqa: A002
        w = self.linear.weight.reshape(self.num_classes, *self.out_features,
                                       self.linear.in_features)
        b = None if self.linear.bias is None else self.linear.bias.reshape(
            self.num_classes, *self.out_features)
        return F.linear_cross_entropy(input, w, target, linear_bias=b, weight=self.weight,
                                      reduction=self.reduction, ignore_index=self.ignore_index,
                                      label_smoothing=self.label_smoothing,
                                      options=self.options)

    def extra_repr(self) -> str:
        return (f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
                f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
                f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, options={self.options}")


_ASMoutput = namedtuple("_ASMoutput", ["output", "loss"])


class AdaptiveLogSoftmaxWithLoss(Module):
    """Efficient softmax approximation for large output spaces
    (``torch.nn.AdaptiveLogSoftmaxWithLoss``, Grave et al. 2016): the ``cutoffs[0]`` most
    frequent classes (the shortlist) and one token per cluster are scored by ``head``
    (Linear(in_features, shortlist + n_clusters, bias=head_bias)); the classes of cluster
    ``i`` by ``tail[i]`` (Linear(in_features, in_features // div_value^(i + 1), bias=False),
    Linear(that, cluster size, bias=False)). torch's parameters, names and initialisation.

    ``forward(input (N, in_features) or (in_features,), target (N,) or ())`` returns
    ``(output, loss)``: each sample's target log-probability (N,) and the mean negative
    log-likelihood. Unlike torch, which runs each cluster's tail on the rows whose target
    is in it (a data-dependent selection), every tail runs on all rows and a mask picks
    (the same values and gradients; more compute in the tails, no data-dependent shapes;
    a cluster that no target falls in gets zero gradients where torch leaves None), so
    that a split batch stays split: DP gives (output S(0), loss P) with no collective in
    forward. ``log_prob(input)``: (N, n_classes) log-probabilities; ``predict(input)``:
    their argmax (torch's shortcut gives the same classes).

    Raises:
        ValueError: cutoffs that are not unique increasing ints in [1, n_classes - 1];
            shapes of input and target that do not match; targets outside
            [0, n_classes - 1] (each rank checks the targets it holds: no collective).
    """

    def __init__(self, in_features: int, n_classes: int, cutoffs, div_value: float = 4.0,
                 head_bias: bool = False, device=None, dtype=None):
        super().__init__()
        cutoffs = list(cutoffs)
        if len(cutoffs) == 0:
            raise ValueError("cutoffs should be a sequence of length larger than 0")
        if cutoffs != sorted(cutoffs) or min(cutoffs) <= 0 or max(cutoffs) > n_classes - 1 \
                or len(set(cutoffs)) != len(cutoffs) or any(int(c) != c for c in cutoffs):
            raise ValueError("cutoffs should be a sequence of unique, positive integers sorted "
                             "in an increasing order, where each value is between 1 and "
                             "n_classes-1")
        self.in_features, self.n_classes = in_features, n_classes
        self.cutoffs = cutoffs + [n_classes]
        self.div_value, self.head_bias = div_value, head_bias
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        self.head_size = self.shortlist_size + self.n_clusters
        kw = dict(device=device, dtype=dtype)
        self.head = Linear(in_features, self.head_size, bias=head_bias, **kw)
        self.tail = ModuleList()
        for i in range(self.n_clusters):
            hsz = int(in_features // (div_value ** (i + 1)))
            osz = self.cutoffs[i + 1] - self.cutoffs[i]
            self.tail.append(Sequential(Linear(in_features, hsz, bias=False, **kw),
                                        Linear(hsz, osz, bias=False, **kw)))

    def reset_parameters(self) -> None:
        self.head.reset_parameters()
        for i2h, h2o in self.tail:
            i2h.reset_parameters()
            h2o.reset_parameters()

    def _check_targets(self, target) -> None:
        t = target._local
        if t.numel() and bool(((t < 0) | (t >= self.n_classes)).any()):
            raise ValueError(f"Target values should be in [0, {self.n_classes - 1}], but "
                             f"values in range [{int(t.min())}, {int(t.max())}] were found.")

    def forward(self, input_, target_):
        if target_.ndim == 1:
            if input_.shape[0] != target_.shape[0]:
                raise ValueError("Input and target should have the same size in the batch "
                                 "dimension.")
            if input_.ndim != 2:
                raise ValueError(f"1D target tensor expects 2D input tensors, but found "
                                 f"inputs with size {tuple(input_.shape)}")
        elif target_.ndim == 0:
            if input_.ndim != 1:
                raise ValueError(f"0D target tensor expects 1D input tensors, but found "
                                 f"inputs with size {tuple(input_.shape)}")
        else:
            raise ValueError("0D or 1D target tensor expected, multi-target not supported")
        batched = target_.ndim > 0
        input = input_ if batched else input_.unsqueeze(0)  # noqa: A001
        target = target_ if batched else target_.unsqueeze(0)
        self._check_targets(target)
        gather_inds = target
        output = None  # the tails' part: each row's log-probability within its cluster
        for i in range(1, self.n_clusters + 1):
            low, high = self.cutoffs[i - 1], self.cutoffs[i]
            in_cluster = (target >= low) & (target < high)
            relative = (target - low).clamp(0, high - low - 1)
            logprob = F.log_softmax(self.tail[i - 1](input), dim=1)
            picked = logprob.gather(1, relative.unsqueeze(1)).squeeze(1)
            part = where(in_cluster, picked, 0.0)
            output = part if output is None else output + part
            gather_inds = where(in_cluster, self.shortlist_size + i - 1, gather_inds)
        head_logprob = F.log_softmax(self.head(input), dim=1)
        head = head_logprob.gather(1, gather_inds.unsqueeze(1)).squeeze(1)
        output = head if output is None else output + head
        loss = (-output).mean()
        if not batched:
            output = output.squeeze(0)
        return _ASMoutput(output, loss)

    def _full_log_prob(self, input, head_output):  # noqa: A002
        head_logprob = F.log_softmax(head_output, dim=1)
        parts = [head_logprob[:, :self.shortlist_size]]
        for i in range(self.n_clusters):
            cluster_logprob = F.log_softmax(self.tail[i](input), dim=1)
            cluster = head_logprob[:, self.shortlist_size + i].unsqueeze(1)
            parts.append(cluster_logprob + cluster)
        return cat(parts, dim=1)

    def log_prob(self, input):  # noqa: A002
        """Log-probabilities of every class, (N, in_features) -> (N, n_classes)."""
        return self._full_log_prob(input, self.head(input))

    def predict(self, input):  # noqa: A002
        """The most probable class of each row, (N, in_features) -> (N,) int64."""
        return self.log_prob(input).argmax(dim=1)
