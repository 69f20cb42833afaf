"""The model zoo: GPT, BERT, ResNet, DLRM and Wide & Deep, each a file a person can read
top to bottom, with a config dataclass, named configs, and parallel plans.

Registry API (used by ``sbpflow train`` and ``sbpflow bench``)::

    spec = sbpflow.models.get("gpt-mini")   # a ModelSpec
    model = spec.build()                     # an sbpflow.nn.Module (local parameters)
    twin = spec.build_torch()                # the same file's model as a torch.nn.Module
    plan = spec.plan("tp")                   # {pattern: ParallelStyle} for parallelize_module

Task contracts (``spec.task``):

* ``"lm"`` (GPT): ``model(idx, targets=None) -> (logits, loss)``; idx/targets (B, T) int64;
  ``model.generate(idx, max_new_tokens, temperature=1.0, top_k=None)``.
* ``"mlm"`` (BERT): ``model(input_ids, labels=None) -> (logits, loss)``; labels -100 where
  not masked.
* ``"image"`` (ResNet): ``model(images) -> logits`` (N, num_classes); images (N, C, H, W).
* ``"ctr"`` (DLRM, Wide & Deep; click-through rate): ``model(dense, sparse, bag,
  bag_weights) -> logits`` (N,), one logit of a click per sample; dense (N, D) float32,
  sparse (N, F) int64 (one id per categorical feature), bag (N, L) int64 and bag_weights
  (N, L) float32 (a multi-valued feature, see :class:`sbpflow.apps.datasets.CTRSplit`); loss
  ``binary_cross_entropy_with_logits``.
* ``"face"`` (ArcFace over a million identities): ``model(features, labels) -> (logits,
  loss)``; features (N, F) float32, labels (N,) int64 in ``[0, num_classes)``; logits (N,
  C) the margin-scaled cosines, loss their mean softmax cross entropy.
"""

from .spec import MODELS, ModelSpec, get, names, register

__all__ = ["ModelSpec", "MODELS", "get", "register", "names"]

# The zoo (each file registers its named configs into .spec).
from . import bert, dlrm, face, gpt, resnet, wide_deep  # noqa: F401
