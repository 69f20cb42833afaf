"""The model zoo: GPT, BERT and ResNet, each a file a person can read top to bottom, with a
config dataclass, named configs, and parallel plans.

Registry API (used by ``sbpflow train`` and ``sbpflow bench``)::

    spec = sbpflow.models.get("gpt-mini")   # a ModelSpec
    model = spec.build()                     # an sbpflow.nn.Module (local parameters)
    plan = spec.plan("tp")                   # {pattern: ParallelStyle} for parallelize_module

Task contracts (``spec.task``):

* ``"lm"`` (GPT): ``model(idx, targets=None) -> (logits, loss)``; idx/targets (B, T) int64;
  ``model.generate(idx, max_new_tokens, temperature=1.0, top_k=None)``.
* ``"mlm"`` (BERT): ``model(input_ids, labels=None) -> (logits, loss)``; labels -100 where
  not masked.
* ``"image"`` (ResNet): ``model(images) -> logits`` (N, num_classes); images (N, C, H, W).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ModelSpec", "MODELS", "get", "register", "names"]


@dataclass(frozen=True)
class ModelSpec:
    """A named model configuration.

    Attributes:
        name: e.g. ``"gpt-mini"``. family: ``"gpt"``, ``"bert"``, ``"resnet"``.
        task: ``"lm"``, ``"mlm"`` or ``"image"`` (see the module doc).
        config: the family's config dataclass instance.
        builder: ``builder(config) -> Module``.
        plans: ``layout -> {pattern: ParallelStyle}`` for ``"dp"``, ``"tp"`` (the TP part;
            on a 2-D mesh DP is the other axis).
        default_layout: e.g. ``"tp"`` or ``"dp"``.
    """

    name: str
    family: str
    task: str
    config: Any
    builder: Callable[[Any], Any]
    plans: dict = field(default_factory=dict)
    default_layout: str = "dp"

    def build(self, **overrides):
        """The model (local parameters; seed first for torch's initialisation)."""
        cfg = replace(self.config, **overrides) if overrides else self.config
        return self.builder(cfg)

    def plan(self, layout: str) -> dict:
        """The tensor-parallel plan for ``layout`` (``{}`` for pure data parallel)."""
        if layout == "dp":
            return {}
        if layout not in self.plans:
            raise ValueError(f"{self.name} has no {layout!r} plan; it has "
                             f"{sorted(self.plans) + ['dp']}")
        return self.plans[layout]


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in MODELS:
        raise ValueError(f"model {spec.name!r} is registered twice")
    MODELS[spec.name] = spec
    return spec


def names() -> list[str]:
    return sorted(MODELS)


def get(name: str) -> ModelSpec:
    """The spec named ``name``. Raises ValueError naming the known models."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"no model {name!r}; known models: {names()}") from None
