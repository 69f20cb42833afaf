"""Classifiers with millions of classes: the combined margin softmax and the class-split
Partial FC head (InsightFace's names and parameters).

* :class:`CombinedMarginLoss` ``(s, m1, m2, m3)``: the target logit ``cos(theta)`` becomes
  ``cos(m1 * theta + m2) - m3`` and every logit is scaled by ``s``. ArcFace is ``(s, 1, m2,
  0)`` (Deng et al. 2019, arXiv 1801.07698), CosFace ``(s, 1, 0, m3)`` (Wang et al. 2018,
  arXiv 1801.09414), SphereFace-like ``m1`` (Liu et al. 2017) and any combination
  (InsightFace's combined margin). Source of the formulas and of the edge handling:
  InsightFace ``recognition/arcface_torch/losses.py`` (``CombinedMarginLoss``) and
  ``partial_fc_v2.py``.
* :class:`PartialFC`: the class weight ``(C, d)`` split by class (S(0)) over a 1-D
  placement, the embeddings all-gathered, the margin softmax with the max and the sum
  all-reduced, and optional sampling of negative classes with rate ``r`` (An et al. 2021,
  "Partial FC: Training 10 Million Identities on a Single Machine", arXiv 2010.05222;
  InsightFace ``PartialFC_V2``, arXiv 2203.15565).

Everything is written with global tensors and sbpflow ops: the all-gather of the features
is the boxing ``S(0) -> B`` (its backward, the dual ``P -> S(0)``, reduce-scatters their
gradient), the logits are a matmul ``(B, S(1)) -> S(1)`` (each rank ``(N, C_local)``; no
rank ever holds an ``(N, C)`` tensor), and the softmax over the split class dim is
sbpflow's vocabulary-parallel ``log_softmax`` (local max, all-reduce MAX, local sum of
exponentials, all-reduce SUM). The gradients follow from the dual rule.
"""

from __future__ import annotations

import math
import warnings

import torch

from ... import distributed as _dist
from ... import random as _rng
from ...checkpoint import StoredTensor
from ...ops.algorithms import unpartial as _unpartial
from ...ops.creation import empty
from ...ops.pointwise import where as _where
from ...placement import placement as Placement
from ...sbp import broadcast, partial_sum, split
from ...tensor import Tensor
from .. import functional as F
from .. import init
from .._sparse_source import note_sparse_grad
from ..module import Module, Parameter

__all__ = ["CombinedMarginLoss", "PartialFC"]


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _margin_delta(t: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    """``cos(m1 * arccos(t) + m2) - m3 - t`` for target cosines ``t`` (no gradient): what
    the margin adds to each target logit before scaling. ``t`` is clamped to [-1, 1]
    (in float32 at least) before ``arccos``, as InsightFace's head does."""
    tf = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    tf = tf.clamp(-1.0, 1.0)
    if m1 == 1.0 and m2 == 0.0:
        out = torch.full_like(tf, -m3)
    else:
        out = torch.cos(m1 * torch.arccos(tf) + m2) - m3 - tf
    return out.to(t.dtype)


def _apply_margin(cos: Tensor, rows: torch.Tensor, cols: torch.Tensor, s: float, m1: float,
                  m2: float, m3: float) -> Tensor:
    """``s * cos`` with the margin added at the target entries ``(rows, cols)`` of this
    rank's shard of ``cos`` (local indices; a row's target lives on one rank of a
    class split): ``s * (cos(m1 arccos(c) + m2) - m3)`` there, the addition made without
    gradient (:func:`_margin_delta`), so ``d out / d cos = s`` everywhere. A per-shard op:
    no communication, the output laid out as ``cos``."""
    local = cos._local
    out = local * s
    if rows.numel() and not (m1 == 1.0 and m2 == 0.0 and m3 == 0.0):
        with torch.no_grad():
            delta = _margin_delta(local[rows, cols], m1, m2, m3) * s
        out.index_put_((rows, cols), delta.to(out.dtype), accumulate=True)
    return Tensor(out, cos.placement, cos.sbp, cos.shape) if cos.is_global else Tensor(out)


def _normalize_rows(t: Tensor) -> Tensor:
    """``F.normalize(t, dim=1)`` (``t / max(||t_i||, 1e-12)`` per row). Where no mesh axis
    splits dim 1 or holds P (the weight ``S(0)``, the gathered features ``B``) each row is
    whole on its rank, so it is torch's ``normalize`` on the shard (a per-shard op: its
    specialised 2-norm backward, a third of the elementwise passes of the generic p-norm
    composition); otherwise :func:`sbpflow.nn.functional.normalize`."""
    if t.is_global and all(not s.is_partial() and s != split(1) for s in t.sbp):
        out = torch.nn.functional.normalize(t._local, dim=1)
        return Tensor(out, t.placement, t.sbp, t.shape)
    return F.normalize(t, dim=1)


class CombinedMarginLoss(Module):
    """InsightFace's combined margin: the target logit ``cos(theta)`` of each row becomes
    ``cos(m1 * theta + m2) - m3``, then every logit is multiplied by ``s``.

    ``CombinedMarginLoss(64, 1.0, 0.5, 0.0)`` is ArcFace, ``(64, 1.0, 0.0, 0.4)`` CosFace,
    ``m1 > 1`` a SphereFace-like multiplicative angular margin, and any mix the combined
    margin (InsightFace's ``margin_list``). Formula source: InsightFace
    ``recognition/arcface_torch/losses.py`` (``CombinedMarginLoss``); ArcFace arXiv
    1801.07698 eq. 4, CosFace arXiv 1801.09414.

    Edge handling and gradient (as InsightFace's PyTorch code): the target cosine is clamped
    to [-1, 1] (float32 for half inputs) before ``arccos``; there is no "easy margin" (the
    plain ``cos(theta + m2)``, computed through ``arccos``, also for ``theta + m2 > pi``).
    The margin is applied without gradient, as InsightFace's ArcFace branch does it
    in place under ``torch.no_grad()``: the output's gradient reaches ``logits`` times
    ``s`` at every entry, targets included (``d out / d cos = s``; the exact derivative
    ``s * m1 * sin(m1 theta + m2) / sin(theta)`` is unbounded as theta -> 0). For CosFace
    (``m1 = 1, m2 = 0``) this is the exact gradient.

    Not supported: InsightFace's ``interclass_filtering_threshold`` (must be 0).

    Args:
        s: scale (> 0), e.g. 64.
        m1: multiplicative angular margin (> 0; 1 = none).
        m2: additive angular margin in radians (ArcFace; 0 = none).
        m3: additive cosine margin (CosFace; 0 = none).

    Shapes: ``forward(logits (N, C) float, labels (N,) int64) -> (N, C)``: ``logits`` are
    cosines; ``labels[i]`` is row ``i``'s class in ``[0, C)``, or ``-1`` for a row without
    a target (only scaled). SBP: ``logits`` may be split on either dim (class-split
    ``S(1)``: the rank holding a row's class adds its margin, a per-shard op with no
    communication); the output is laid out as ``logits``; ``labels`` any layout (boxed
    to ``B``: an all-gather of N ints). A ``P`` input is all-reduced first (the margin
    is not linear).

    Raises:
        ValueError: a margin or scale that is not finite, ``s <= 0``, ``m1 <= 0``,
            ``interclass_filtering_threshold != 0``; shapes that do not match.
        TypeError: float labels.
    """

    def __init__(self, s: float, m1: float, m2: float, m3: float,
                 interclass_filtering_threshold: float = 0):
        super().__init__()
        self.s, self.m1 = _finite("s", s), _finite("m1", m1)
        self.m2, self.m3 = _finite("m2", m2), _finite("m3", m3)
        if self.s <= 0:
            raise ValueError(f"CombinedMarginLoss: s must be > 0, got {s}")
        if self.m1 <= 0:
            raise ValueError(f"CombinedMarginLoss: m1 must be > 0 (1 = no multiplicative "
                             f"margin), got {m1}")
        if interclass_filtering_threshold:
            raise ValueError("CombinedMarginLoss: interclass_filtering_threshold is not "
                             "supported; leave it 0")

    def extra_repr(self) -> str:
        return f"s={self.s}, m1={self.m1}, m2={self.m2}, m3={self.m3}"

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        if logits.ndim != 2:
            raise ValueError(f"CombinedMarginLoss: logits must be (N, C) cosines, got shape "
                             f"{tuple(logits.shape)}")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"CombinedMarginLoss: labels must be integer class indices, got "
                            f"{labels.dtype}")
        labels = labels.reshape(-1)
        if labels.shape[0] != logits.shape[0]:
            raise ValueError(f"CombinedMarginLoss: {labels.shape[0]} labels for "
                             f"{logits.shape[0]} rows of logits")
        if logits.is_global:
            logits = _unpartial(logits)  # the margin is not linear
        rows, cols = self._targets(logits, labels)
        return _apply_margin(logits, rows, cols, self.s, self.m1, self.m2, self.m3)

    @staticmethod
    def _targets(logits: Tensor, labels: Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's target entries of ``logits`` as local ``(rows, cols)``: the rows of
        its shard whose label falls in its shard's columns."""
        if logits.is_local:
            lab = labels._local.long()
            rows = (lab >= 0).nonzero().squeeze(1)
            return rows, lab[rows]
        pl, nd = logits.placement, logits.sbp
        lab = labels.to_global(pl, (broadcast,) * pl.ndim)._local.long()  # all labels
        rs, cs = pl.shard_slices(logits.shape, nd)
        lab = lab[rs]
        rows = ((lab >= cs.start) & (lab < cs.stop)).nonzero().squeeze(1)
        return rows, lab[rows] - cs.start


class PartialFC(Module):
    """The class-split classification head of face recognition with a margin softmax
    loss, and optional Partial FC sampling (An et al. 2021; InsightFace's ``PartialFC``
    update by default, ``PartialFC_V2``'s with ``sparse_grad=False``).

    ``PartialFC(margin_loss, embedding_size, num_classes, sample_rate=1.0)``; ``forward(
    embeddings, labels)`` returns the mean margin-softmax cross entropy over the global
    batch (a 0-dim ``P`` tensor; ``item()`` reads it).

    Layout: ``weight`` is a global ``(C, d)`` parameter split by class (``S(0)``) over a 1-D
    ``placement`` (default: every rank), uneven ``C`` allowed (the first ``C % n`` ranks
    hold one more class, as InsightFace's ``num_local``/``class_start``). Per step:

    1. embeddings ``(N, d)`` (global, usually ``S(0)``, data parallel; a local tensor is
       taken as this rank's part of an ``S(0)`` batch) are boxed to ``B`` (all-gather; the
       backward reduce-scatters their gradient), labels ``(N,)`` likewise;
    2. labels are checked to lie in ``[0, C)`` (every rank holds all of them after the
       gather, so the check needs no collective; ``check_labels=False`` skips it);
    3. ``cos = normalize(x) @ normalize(W_used).T`` (each rank ``(N, C_local)``, ``S(1)``),
       clamped to [-1, 1] in float32 at least (InsightFace);
    4. ``margin_loss`` (a :class:`CombinedMarginLoss`) on the rank that holds each row's
       class; cross entropy over the split class dim (max and sum all-reduced).

    Gradients: the exact gradient of the global-mean loss for ``weight`` and the
    embeddings. (InsightFace multiplies the embeddings' gradient by the world size to
    undo DDP's averaging of the backbone's gradients; sbpflow's data-parallel gradients
    are sums of the global loss's, so no factor is needed and the backbone gets the same
    update.) The loss is ``-mean(log_softmax)`` at the targets (InsightFace clamps the
    target probability at 1e-30 first: equal unless a loss exceeds 69).

    Sampling (``sample_rate = r < 1``; An et al. 2021 and ``PartialFC_V2.sample``): each
    rank keeps the positive classes it owns (the unique labels of the all-gathered batch
    in its range) and fills up to ``k = max(int(r * C_local), 1)`` classes with negatives
    drawn uniformly without replacement (keys ``torch.rand(C_local)``, positives set to 2,
    top ``k``; at least one class, so a rank with no positive at a tiny ``r`` still takes
    part); if its positives alone exceed that, it uses exactly them. The
    random numbers come from a ``torch.Generator`` per rank seeded with ``seed * 1000003 +
    rank`` when the module is made and advanced by every sampling forward: the same seed,
    world and call sequence give the same samples; the generators' states are in the
    module's ``state_dict`` (see "Checkpoints" below). The sampled rows (sorted,
    ``self.sampled_index``: this rank's local row indices) are gathered from the shard
    inside autograd (ranks use different counts; the logits are padded to the largest
    count with columns that take no probability and no gradient). ``weight.grad`` is

    * with ``sparse_grad`` (the default while ``sample_rate < 1``): on each rank a
      ``torch.sparse_coo_tensor`` of its shard's shape holding the sampled rows only
      (``torch.nn.functional.embedding(index, shard, sparse=True)``; uncoalesced: the
      padding repeats the last row with a zero gradient), as ``nn.EmbeddingBag(sparse=
      True)`` makes; at ``r = 1`` every row is used and the gradient is dense unless
      ``sparse_grad=True`` is passed;
    * with ``sparse_grad=False``: dense, with exact zeros in the rows not sampled.

    Optimizer semantics. By default (``sparse_grad``) those of the original Partial FC
    (An et al. 2021; InsightFace v1 ``arcface_torch/partial_fc.py``, which steps a
    sub-parameter of the sampled rows and their momentum with ``torch.optim.SGD`` and
    writes both back): :class:`sbpflow.optim.SGD`'s *lazy momentum* updates only the
    sampled rows and their momentum rows, ``weight_decay`` applies to the sampled rows
    only, and the unsampled rows and their momentum stay bit-identical (frozen, not
    decayed). ``Adagrad``, ``SparseAdam`` and ``SparseAdamW`` also take the sparse
    gradient (touched rows only); ``Adam``/``AdamW`` refuse it with a ``RuntimeError``
    naming this module and the fix. With ``sparse_grad=False``, those of InsightFace's
    ``PartialFC_V2`` with ``torch.optim.SGD`` (checked in its ``train_v2.py``): the
    unsampled rows' gradient is zero, so plain SGD leaves them bit-identical; with
    ``momentum`` their buffer decays (``buf = momentum * buf``) and still moves them, and
    ``weight_decay`` shrinks every row, as torch's dense SGD does; any optimizer works
    (AdamW's moments of the unsampled rows decay likewise).

    Checkpoints: ``state_dict()`` holds, besides ``weight``, ``_extra_state`` (torch's
    ``get_extra_state`` protocol): every rank's sampler ``torch.Generator`` state as a
    global ``uint8`` tensor ``(n, L)`` laid out ``S(0)`` (row ``i`` = mesh coordinate
    ``i``'s generator), so ``sbpflow.save`` writes each rank's own row. Loading it into a
    module on the same number of ranks restores every generator: a resumed run samples
    exactly as an uninterrupted one (with the optimizer's state, the same updates).
    Loaded on a different number of ranks (the class ranges moved, so no continuation is
    meaningful) each rank's generator is reseeded ``seed * 1000003 + rank``, as in a fresh
    module, with a ``UserWarning``.

    Memory per rank: the weight shard, its gradient and optimizer state are ``O(C/n * d)``
    (a sparse gradient ``O(K * d)``); the logits ``(N, C_local)`` (``(N, K)`` with
    sampling); no ``(N, C)`` tensor anywhere. The weight is initialised ``N(0, 0.01)``
    (InsightFace) drawn per shard
    (:func:`sbpflow.random.per_shard`: shard-sized memory, deterministic per seed and
    layout, but not the one-process draw).

    Args:
        margin_loss: a :class:`CombinedMarginLoss`.
        embedding_size: ``d``.
        num_classes: ``C`` (at least the number of ranks of ``placement``).
        sample_rate: ``r`` in (0, 1]; 1 = every class (model parallel).
        placement: a 1-D placement (default ``placement.all("cpu")``).
        seed: the sampling seed (see above).
        check_labels: check labels against ``[0, C)`` (cheap; no collective).
        sparse_grad: ``None`` (default): a sparse ``weight.grad`` while ``sample_rate <
            1`` (read at each forward), dense at ``r = 1``; ``True``: always sparse;
            ``False``: always dense (``PartialFC_V2`` semantics, for optimizers without a
            sparse update such as AdamW).

    Raises:
        ValueError: ``sample_rate`` outside (0, 1]; ``num_classes`` smaller than the
            ranks; a non-1-D placement; labels outside ``[0, C)`` (naming the first bad
            label, its position and ``C``); shapes that do not match.
            ``load_state_dict``: an ``_extra_state`` that is not ``(n, L)`` generator
            states.
        TypeError: ``margin_loss`` not a :class:`CombinedMarginLoss`; float labels;
            ``sparse_grad`` not ``None`` or a bool.
    """

    def __init__(self, margin_loss: CombinedMarginLoss, embedding_size: int,
                 num_classes: int, sample_rate: float = 1.0, placement: Placement | None
                 = None, seed: int = 0, check_labels: bool = True,
                 sparse_grad: bool | None = None):
        super().__init__()
        if not isinstance(margin_loss, CombinedMarginLoss):
            raise TypeError(f"PartialFC: margin_loss must be a CombinedMarginLoss, got "
                            f"{type(margin_loss).__name__}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or \
                not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"PartialFC: sample_rate must be in (0, 1], got {sample_rate!r} "
                             f"(1.0 = every class)")
        for name, v in (("embedding_size", embedding_size), ("num_classes", num_classes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PartialFC: {name} must be a positive int, got {v!r}")
        pl = placement if placement is not None else Placement.all("cpu")
        if pl.ndim != 1:
            raise ValueError(f"PartialFC: placement must be 1-D (the classes are split over "
                             f"one mesh axis), got mesh shape {tuple(pl.shape)}")
        if num_classes < pl.size:
            raise ValueError(f"PartialFC: num_classes {num_classes} is smaller than the "
                             f"{pl.size} ranks of the placement; every rank needs a class")
        if sparse_grad is not None and not isinstance(sparse_grad, bool):
            raise TypeError(f"PartialFC: sparse_grad must be None (sparse while sample_rate "
                            f"< 1), True or False, got {sparse_grad!r}")
        self.margin_softmax = margin_loss
        self.embedding_size, self.num_classes = embedding_size, num_classes
        self.sample_rate = float(sample_rate)
        self.placement, self.seed, self.check_labels = pl, int(seed), bool(check_labels)
        self.sparse_grad = sparse_grad

        with _rng.per_shard():
            w = empty(num_classes, embedding_size, placement=pl, sbp=split(0))
            self.weight = Parameter(w)
            init.normal_(self.weight, 0.0, 0.01)
        note_sparse_grad(self.weight, "nn.PartialFC (a sparse weight gradient while "
                         "sampling: sample_rate < 1 with sparse_grad=None, the default, or "
                         "sparse_grad=True)", "nn.PartialFC(..., sparse_grad=False) "
                         "(InsightFace PartialFC_V2 semantics: dense gradient, every row's "
                         "optimizer state updated)")
        self._generator = torch.Generator()
        self._reseed()
        self.sampled_index: torch.Tensor | None = None

    def _reseed(self) -> None:
        self._generator.manual_seed(self.seed * 1000003 + _dist.get_rank())

    def extra_repr(self) -> str:
        return (f"embedding_size={self.embedding_size}, num_classes={self.num_classes}, "
                f"sample_rate={self.sample_rate}, placement={self.placement}"
                + ("" if self.sparse_grad is None else f", sparse_grad={self.sparse_grad}"))

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> Tensor:
        """Every rank's sampler state: a global ``uint8`` ``(n, L)`` tensor, ``S(0)``."""
        st = self._generator.get_state()
        pl = self.placement
        return Tensor(st.unsqueeze(0), pl, (split(0),), (pl.size, st.numel()))

    def set_extra_state(self, state) -> None:
        """Restore this rank's sampler from :meth:`get_extra_state`'s tensor (a global
        tensor, a checkpoint's stored tensor, or the whole ``(n, L)`` value); on another
        number of ranks reseed (see the class doc)."""
        pl = self.placement
        L = self._generator.get_state().numel()
        shape = tuple(getattr(state, "shape", ()))
        if len(shape) != 2 or shape[1] != L:
            raise ValueError(f"PartialFC: the state dict's _extra_state has shape {shape}; "
                             f"expected ({pl.size}, {L}), one torch.Generator state per rank "
                             f"(PartialFC.get_extra_state)")
        if shape[0] != pl.size:
            warnings.warn(f"PartialFC: the sampler state was saved on {shape[0]} ranks, this "
                          f"module has {pl.size}; the class ranges differ, so each rank's "
                          f"sampler is reseeded with seed * 1000003 + rank (seed "
                          f"{self.seed}) as in a fresh module, and the samples differ from "
                          f"an uninterrupted run", UserWarning, stacklevel=2)
            self._reseed()
            return
        me = pl.coord()[0]
        if isinstance(state, StoredTensor) or (isinstance(state, Tensor) and state.is_global
                                               and state.placement == pl):
            row = state.to_global(pl, split(0))._local[0]      # reads this rank's row only
        elif isinstance(state, Tensor):
            row = torch.as_tensor(state.numpy())[me]
        else:
            row = torch.as_tensor(state)[me]
        self._generator.set_state(row.detach().to("cpu", torch.uint8).contiguous())

    def _sparse(self) -> bool:
        """Whether this forward gives ``weight`` a sparse gradient."""
        return self.sample_rate < 1.0 if self.sparse_grad is None else self.sparse_grad

    def _rows(self, index: torch.Tensor) -> Tensor:
        """Rows ``index`` of this rank's shard, a local ``(K, d)`` tensor whose gradient
        reaches ``weight``: sparse (``embedding(sparse=True)``) or dense."""
        if self._sparse():
            return Tensor(torch.nn.functional.embedding(index, self.weight._local,
                                                        sparse=True))
        return self.weight.to_local()[Tensor(index)]

    # ------------------------------------------------------------------ helpers
    def _ranges(self) -> list[tuple[int, int]]:
        """(class_start, num_local) of every rank of the placement, in mesh order."""
        n, C = self.placement.size, self.num_classes
        base, extra = divmod(C, n)
        return [(i * base + min(i, extra), base + (1 if i < extra else 0)) for i in range(n)]

    def _gather(self, embeddings, labels) -> tuple[Tensor, Tensor]:
        pl = self.placement
        if isinstance(embeddings, torch.Tensor):
            embeddings = Tensor(embeddings)
        if isinstance(labels, torch.Tensor):
            labels = Tensor(labels)
        if not isinstance(embeddings, Tensor) or not isinstance(labels, Tensor):
            raise TypeError("PartialFC: embeddings and labels must be tensors")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(f"PartialFC: labels must be integer class indices, got "
                            f"{labels.dtype}")
        if embeddings.is_local:
            embeddings = embeddings.to_global(pl, split(0))
        if labels.is_local:
            labels = labels.to_global(pl, split(0))
        if embeddings.ndim != 2 or embeddings.shape[1] != self.embedding_size:
            raise ValueError(f"PartialFC: embeddings must be (N, {self.embedding_size}), got "
                             f"{tuple(embeddings.shape)}")
        labels = labels.reshape(-1)
        if labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"PartialFC: {labels.shape[0]} labels for "
                             f"{embeddings.shape[0]} embeddings")
        x = embeddings.to_global(pl, broadcast)                 # all-gather
        y = labels.to_global(pl, broadcast)._local.long()       # every rank: all labels
        if self.check_labels and y.numel():
            bad = (y < 0) | (y >= self.num_classes)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"PartialFC: label {int(y[i])} at position {i} of the "
                                 f"global batch is outside [0, {self.num_classes}) "
                                 f"(num_classes={self.num_classes}); labels are class "
                                 f"indices")
        return x, y

    def _sample(self, y: torch.Tensor):
        """Sample this rank's classes (sets ``sampled_index``). Every rank counts every
        rank's positives from the gathered labels, so all know the largest count ``K``
        without a collective. Returns ``(index (K,) local rows, padded by repeating the
        last; valid (K,) bool, K, whether any rank pads)``."""
        ranges = self._ranges()
        me = self.placement.coord()[0]
        start, n_local = ranges[me]
        uniq = torch.unique(y)
        owner = torch.bucketize(uniq, torch.tensor([s for s, _ in ranges[1:]],
                                                   dtype=uniq.dtype), right=True)
        n_pos = torch.bincount(owner, minlength=len(ranges)).tolist()
        counts = [max(int(self.sample_rate * nl), p, 1) for (_, nl), p in zip(ranges, n_pos)]
        K = max(counts)
        positive = uniq[owner == me] - start                    # sorted local rows
        k = counts[me]
        if k > positive.numel():
            keys = torch.rand(n_local, generator=self._generator)
            keys[positive] = 2.0
            index = torch.topk(keys, k).indices.sort().values
        else:
            index = positive
        self.sampled_index = index
        valid = torch.arange(K) < k
        if k < K:
            index = torch.cat([index, index[-1:].expand(K - k)])
        return index, valid, K, min(counts) < K

    # ------------------------------------------------------------------ forward
    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        pl = self.placement
        x, y = self._gather(embeddings, labels)
        N = y.numel()
        me = pl.coord()[0]
        start, n_local = self._ranges()[me]
        if self.sample_rate < 1.0:
            index, valid, K, padded = self._sample(y)
            sub = self._rows(index)                             # (K, d), grad to the shard
            w = sub.to_global(pl, split(0), check_meta=False)   # (n K, d) S(0)
            cols_total = K * pl.size
            mine = (y >= start) & (y < start + n_local)
            col_of = torch.searchsorted(self.sampled_index, (y - start).clamp(min=0))
        else:
            w, valid, K, padded = self.weight, None, n_local, False
            if self._sparse():                           # every row, sparse grad
                rows_all = self._rows(torch.arange(n_local, device=self.weight._local.device))
                w = Tensor(rows_all._local, pl, (split(0),), tuple(self.weight.shape))
            cols_total = self.num_classes
            mine = (y >= start) & (y < start + n_local)
            col_of = y - start
        xn = _normalize_rows(x)
        wn = _normalize_rows(w)
        cos = xn @ wn.t()                                       # (N, C) S(1): (N, K) here
        if cos.dtype in (torch.float16, torch.bfloat16):
            cos = cos.float()
        cos = cos.clamp(-1.0, 1.0)
        shape = (N, cols_total)
        rows = mine.nonzero().squeeze(1)                        # this rank's targets
        cols = col_of[rows]
        ml = self.margin_softmax
        logits = _apply_margin(cos, rows, cols, ml.s, ml.m1, ml.m2, ml.m3)
        if padded:  # every rank knows every rank's count: all take this branch
            keep = Tensor(valid.unsqueeze(0).expand(N, K).contiguous(), pl, (split(1),),
                          shape)
            logits = _where(keep, logits, torch.finfo(logits.dtype).min)
        logp = F.log_softmax(logits, dim=1)                     # max, sum all-reduced
        lp = logp._local
        picked = torch.zeros(N, dtype=lp.dtype, device=lp.device).index_put(
            (rows,), lp[rows, cols])                            # the target's, others 0
        nll = -Tensor(picked, pl, (partial_sum,), (N,))         # (N,) P
        return nll.mean()
