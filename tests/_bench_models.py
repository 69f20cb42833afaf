"""Small models registered for the ``sbpflow bench`` tests (``--import _bench_models``):

* ``bench-gpt``: the nanoGPT-style test file ``torch_models/gpt.py`` (2 layers, width 32),
  built for sbpflow and, as its plain-PyTorch twin, for torch (``_models.load_gpt``), with
  the GPT tensor-parallel plan; task ``lm``.
* ``bench-cnn``: a small CNN with BatchNorm (the per-rank statistics path), task ``image``.

Each spec has ``build_torch()``, the twin that ``sbpflow bench`` compares against (the zoo's
``ModelSpec.build_torch``; defined here on a subclass so the tests do not depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from _models import GPT_TP_PLAN, load_gpt

import sbpflow
from sbpflow.models import MODELS, ModelSpec, register
from sbpflow.models.gpt import pipeline_split as gpt_pipeline_split


@dataclass(frozen=True)
class _Spec(ModelSpec):
    torch_build: object = None

    def build_torch(self, **overrides):
        cfg = replace(self.config, **overrides) if overrides else self.config
        return self.torch_build(cfg)


@dataclass
class CNNConfig:
    in_channels: int = 3  # image channels
    image_size: int = 8  # square images of image_size x image_size
    width: int = 8  # channels of the conv layers
    num_classes: int = 10  # output classes
    extra: dict = field(default_factory=dict)


def _cnn(nn, cfg: CNNConfig):
    return nn.Sequential(
        nn.Conv2d(cfg.in_channels, cfg.width, 3, padding=1, bias=False),
        nn.BatchNorm2d(cfg.width), nn.ReLU(),
        nn.Conv2d(cfg.width, cfg.width, 3, padding=1, bias=False),
        nn.BatchNorm2d(cfg.width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cfg.width, cfg.num_classes))


def _gpt(framework: str, cfg):
    mod = load_gpt(framework)
    return mod.GPT(mod.GPTConfig(**vars(cfg)))


@dataclass
class GPTConfig:
    block_size: int = 16  # longest context
    vocab_size: int = 48  # token ids
    n_layer: int = 2  # blocks
    n_head: int = 4  # heads (divisible by the TP degree)
    n_embd: int = 32  # width
    dropout: float = 0.0
    bias: bool = True


if "bench-gpt" not in MODELS:
    register(_Spec(name="bench-gpt", family="gpt", task="lm", config=GPTConfig(),
                   builder=lambda cfg: _gpt("sbpflow", cfg), plans={"tp": GPT_TP_PLAN},
                   default_layout="tp", torch_build=lambda cfg: _gpt("torch", cfg),
                   pipeline_split=gpt_pipeline_split))
    register(_Spec(name="bench-cnn", family="resnet", task="image", config=CNNConfig(),
                   builder=lambda cfg: _cnn(sbpflow.nn, cfg), default_layout="dp",
                   torch_build=lambda cfg: _cnn(torch.nn, cfg)))
