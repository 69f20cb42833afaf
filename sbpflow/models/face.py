"""A face-recognition training job with a million classes: an embedding network and the
ArcFace margin-softmax head over every class (the model-parallel head of InsightFace's
Partial FC at ``sample_rate=1``), written with plain ops so that the head's layout is a
decision of automatic parallelism, not fixed by a module.

Shapes: N batch, F input features, d = ``embedding_size``, C = ``num_classes``.

``model(features, labels) -> (logits, loss)`` (the ``"face"`` task, see
:mod:`sbpflow.models`): features (N, F) float32 (synthetic stand-ins for images, as
``sbpflow bench partial-fc``'s), labels (N,) int64 in ``[0, C)``; the backbone stand-in
``Linear(F, d)`` gives the embeddings; the head's ``(C, d)`` weight is ``fc.weight``, an
``nn.Linear(d, C, bias=False)``; ``cos = normalize(emb) @ normalize(W).T`` clamped to
[-1, 1]; the target entry of each row becomes ``cos(m1 theta + m2) - m3`` (InsightFace's
``CombinedMarginLoss``, ArcFace by default: ``(64, 1, 0.5, 0)``), added without gradient
as InsightFace does (the loss's gradient reaches every cosine times ``s``); logits ``s x``
that (N, C); loss the mean softmax cross entropy.

Layouts (``spec.plan``): ``"dp"``, everything replicated (B) and the batch split: the
``(C, d)`` head, its gradient and optimizer state on every rank, its gradient all-reduced
every step (what PyTorch DDP does); ``"tp"``, the head split by class (``fc`` column-wise:
weight S(0), cosines S(1), the softmax's max and sum all-reduced), the embeddings
gathered: InsightFace's model-parallel head. The auto-parallel search chooses between
them (and ZeRO) by their cost.

Formula sources: ArcFace (Deng et al. 2019, arXiv 1801.07698, eq. 4); InsightFace
``recognition/arcface_torch/losses.py`` (``CombinedMarginLoss``) and ``partial_fc_v2.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sbpflow
import sbpflow.nn as nn
import sbpflow.nn.functional as F
from sbpflow.models._twin import twin_builder
from sbpflow.models.spec import ModelSpec, register
from sbpflow.nn.parallel import ColwiseParallel


@dataclass
class FaceConfig:
    num_classes: int = 1_000_000  # C: identities
    in_features: int = 128  # F: the synthetic input's width
    embedding_size: int = 128  # d
    s: float = 64.0  # logit scale
    m1: float = 1.0  # multiplicative angular margin (1: none)
    m2: float = 0.5  # additive angular margin, radians (ArcFace)
    m3: float = 0.0  # additive cosine margin (CosFace)

    def __post_init__(self):
        """Raises ValueError for fewer than 2 classes or a scale that is not > 0."""
        if self.num_classes < 2:
            raise ValueError(f"FaceConfig: num_classes must be >= 2, got {self.num_classes}")
        if not self.s > 0 or not math.isfinite(self.s):
            raise ValueError(f"FaceConfig: s must be a finite number > 0, got {self.s}")


class Face(nn.Module):
    """``model(features, labels) -> (logits (N, C), loss)`` (see the module doc)."""

    def __init__(self, config: FaceConfig):
        super().__init__()
        self.config = c = config
        self.backbone = nn.Linear(c.in_features, c.embedding_size)
        self.fc = nn.Linear(c.embedding_size, c.num_classes, bias=False)
        with sbpflow.no_grad():
            nn.init.normal_(self.fc.weight, 0.0, 0.01)  # InsightFace's head init
        # every class index, compared with the labels: the target entries (the mask takes
        # the cosines' layout: split by class with them)
        self.register_buffer("classes", sbpflow.arange(c.num_classes), persistent=False)

    def forward(self, features, labels):
        c = self.config
        emb = F.normalize(self.backbone(features), dim=1)  # (N, d)
        cos = F.linear(emb, F.normalize(self.fc.weight, dim=1)).clamp(-1.0, 1.0)  # (N, C)
        target = self.classes.unsqueeze(0) == labels.unsqueeze(1)  # (N, C) bool
        with sbpflow.no_grad():
            t = -F.nll_loss(cos, labels, reduction="none")  # (N,) each row's target cosine
            theta = t.acos()
            # the margin, no gradient: cos(m1 theta + m2) - m3 against cos(theta) (not t:
            # with the class dim split, t is a partial sum; theta is whole, so the (N, C)
            # product below stays whole too, not a partial sum to reduce-scatter)
            delta = (c.m1 * theta + c.m2).cos() - c.m3 - theta.cos()
        logits = c.s * (cos + target * delta.unsqueeze(1))
        return logits, F.cross_entropy(logits, labels)


#: The head split by class over the tensor-parallel axis (InsightFace's model parallel).
TP_PLAN = {"fc": ColwiseParallel()}


def _register(name: str, classes: int):
    return register(ModelSpec(name=name, family="face", task="face",
                              config=FaceConfig(num_classes=classes), builder=Face,
                              plans={"tp": TP_PLAN}, default_layout="tp",
                              torch_builder=twin_builder(__name__, "Face")))


_register("arcface-1e6", 1_000_000)  # the million classes (0.5 GiB head in fp32)
_register("arcface-1e4", 10_000)  # the same job small: tests, a quick look
