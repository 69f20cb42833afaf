"""Test models written once for both frameworks: the nanoGPT-style file in
``torch_models/gpt.py`` loaded as plain PyTorch or with its imports switched to sbpflow
(the migration path: nothing else in the file changes), and a small MLP."""

from __future__ import annotations

import os
import sys
import types

import sbpflow
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, VocabParallel

_GPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_models", "gpt.py")
IMPORTS = {"import torch\n": "import sbpflow as torch\n",
           "import torch.nn as nn\n": "import sbpflow.nn as nn\n",
           "from torch.nn import functional as F\n": "from sbpflow.nn import functional as F\n"}


def load_gpt(framework: str) -> types.ModuleType:
    """The GPT model file as a module; ``framework`` ``"torch"`` or ``"sbpflow"``."""
    name = f"_gpt_{framework}"
    if name in sys.modules:
        return sys.modules[name]
    src = open(_GPT).read()
    if framework == "sbpflow":
        for old, new in IMPORTS.items():
            if old not in src:
                raise AssertionError(f"{_GPT} lost its import line {old!r}")
            src = src.replace(old, new)
    mod = types.ModuleType(name)
    mod.__file__ = _GPT
    sys.modules[name] = mod
    exec(compile(src, _GPT, "exec"), mod.__dict__)
    return mod


GPT_TP_PLAN = {
    "transformer.wte": VocabParallel(),
    "lm_head": VocabParallel(),
    "transformer.h.*.attn.[qkv]": ColwiseParallel(),
    "transformer.h.*.attn.c_proj": RowwiseParallel(),
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(),
}


def mlp(nn):
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8))


MLP_TP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def world_placement(kind: str):
    """``dp``/``tp``/``zero``: all ranks on a 1-D mesh; ``dp_tp``: a 2x2 mesh (DP axis 0)."""
    if kind == "dp_tp":
        return sbpflow.placement("cpu", [[0, 1], [2, 3]])
    return sbpflow.placement.all("cpu")
