"""Evaluation metrics of binary classifiers (click-through rate), on plain ``torch.Tensor``s
(read a global tensor's value first: ``torch.from_numpy(x.numpy())``, collective).

* :func:`roc_auc`: the area under the ROC curve, by ranks (Mann and Whitney 1947: AUC =
  U / (n_pos n_neg), U = the rank sum of the positives less n_pos (n_pos + 1) / 2, tied
  scores given their average rank, so a tie between a positive and a negative counts
  1/2, as ``sklearn.metrics.roc_auc_score``).
* :func:`log_loss`: the mean binary cross-entropy of logits (``torch.nn.functional.
  binary_cross_entropy_with_logits``), in nats.
"""

from __future__ import annotations

import torch

__all__ = ["roc_auc", "log_loss"]


def _check(scores: torch.Tensor, labels: torch.Tensor, name: str) -> tuple:
    if not isinstance(scores, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name}: scores and labels must be torch.Tensors, got "
                        f"{type(scores).__name__} and {type(labels).__name__} (for a global "
                        f"sbpflow tensor pass torch.from_numpy(x.numpy()))")
    if scores.numel() != labels.numel():
        raise ValueError(f"{name}: {scores.numel()} scores (shape {tuple(scores.shape)}) but "
                         f"{labels.numel()} labels (shape {tuple(labels.shape)}); give one "
                         f"label per score")
    scores = scores.detach().reshape(-1).double()
    labels = labels.detach().reshape(-1)
    if not bool(((labels == 0) | (labels == 1)).all()):
        bad = labels[(labels != 0) & (labels != 1)][:3].tolist()
        raise ValueError(f"{name}: labels must be 0 or 1, got {bad}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{name}: {int((~torch.isfinite(scores)).sum())} scores are not "
                         f"finite (NaN or inf); the model diverged")
    return scores, labels.bool()


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` (any shape, any real dtype: logits or
    probabilities, higher means positive) against ``labels`` (same number of elements,
    0/1 or bool): the probability that a random positive scores above a random negative,
    ties counting 1/2 (see the module doc; O(N log N), a sort).

    Raises:
        TypeError: not torch tensors.
        ValueError: numbers of scores and labels differ, a label other than 0/1, a
            non-finite score, or only one class present (the AUC is undefined).
    """
    scores, pos = _check(scores, labels, "roc_auc")
    n_pos = int(pos.sum())
    n_neg = pos.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"roc_auc: {n_pos} positives and {n_neg} negatives; the AUC needs "
                         f"both classes")
    ordered, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True,
                                                  return_counts=True)
    last = counts.cumsum(0).double()  # 1-based rank of each tie group's last element
    ranks = (last - (counts.double() - 1) / 2)[inverse]  # average rank of the group
    u = ranks[pos[order]].sum().item() - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The mean binary cross-entropy (nats) of ``logits`` (pre-sigmoid, any shape) against
    ``labels`` (same number of elements, 0/1): ``-mean(y log p + (1 - y) log(1 - p))`` with
    ``p = sigmoid(logit)``, computed stably as ``binary_cross_entropy_with_logits``.

    Raises:
        TypeError, ValueError: as :func:`roc_auc` (one class alone is fine here).
    """
    logits, pos = _check(logits, labels, "log_loss")
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, pos.double()).item()
