"""Models for the ``sbpflow train`` tests, registered in :mod:`sbpflow.models` when this file
is imported (``sbpflow train test-gpt --plugin tests/_train_models.py``).

* ``test-gpt``: the nanoGPT-style file ``torch_models/gpt.py`` (tiny: 2 layers, width 32,
  dropout 0.1), with the Megatron plan of ``_models.GPT_TP_PLAN`` and the zoo GPT's
  pipeline split (the file has nanoGPT's module names);
* ``test-gpt-mini``: the same file at gpt-mini's size (4 layers, width 128, 4 heads,
  block 128, no dropout), to tune the trainer's defaults before the zoo's gpt-mini exists;
* ``test-cnn``: a small conv net with BatchNorm for the image path (digits).

:func:`build` makes the same model in plain PyTorch (``framework="torch"``), the oracle.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _models import GPT_TP_PLAN, load_gpt  # noqa: E402

from sbpflow import models  # noqa: E402
from sbpflow.models.gpt import pipeline_split  # noqa: E402  (nanoGPT's module names)


@dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 1  # image channels
    num_classes: int = 10  # output classes
    width: int = 16  # channels of the first conv


def _gpt_config(**kw):
    gpt = load_gpt("sbpflow")
    return gpt.GPTConfig(**kw)


def build(family: str, cfg, framework: str = "sbpflow"):
    """The model of ``family`` (``"gpt"``/``"cnn"``) for config ``cfg`` in ``framework``."""
    if family == "gpt":
        gpt = load_gpt(framework)
        return gpt.GPT(gpt.GPTConfig(**{k: getattr(cfg, k) for k in (
            "block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias")}))
    if framework == "torch":
        import torch.nn as nn
    else:
        import sbpflow.nn as nn
    w = cfg.width
    return nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, padding=1, stride=2), nn.BatchNorm2d(2 * w), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, cfg.num_classes))


if "test-gpt" not in models.MODELS:
    models.register(models.ModelSpec(
        "test-gpt", "gpt", "lm",
        _gpt_config(block_size=16, vocab_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.1),
        lambda cfg: build("gpt", cfg), {"tp": GPT_TP_PLAN}, "tp",
        pipeline_split=pipeline_split))
    models.register(models.ModelSpec(
        "test-gpt-mini", "gpt", "lm",
        _gpt_config(block_size=128, vocab_size=96, n_layer=4, n_head=4, n_embd=128,
                    dropout=0.0),
        lambda cfg: build("gpt", cfg), {"tp": GPT_TP_PLAN}, "tp",
        pipeline_split=pipeline_split))
    models.register(models.ModelSpec("test-cnn", "cnn", "image", CNNConfig(),
                                     lambda cfg: build("cnn", cfg), {}, "dp"))
