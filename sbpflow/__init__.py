"""sbpflow: write the program once as if for one device; say where each tensor lives
(placement) and how it is laid out (SBP); sbpflow infers layouts and inserts boxing.

Public API (thin re-exports; the modules below hold the code and docs):

* :class:`placement`, :mod:`sbpflow.sbp` (``split``, ``broadcast``, ``partial_sum``)
* :class:`Tensor` and creation: :func:`tensor`, :func:`zeros`, :func:`ones`,
  :func:`full`, :func:`randn`, :func:`from_torch`, :func:`manual_seed`
* :mod:`sbpflow.distributed` (ranks, groups, timeouts, debug checks, launcher);
  :mod:`sbpflow.env` (OneFlow's ``oneflow.env``: ``get_rank``, ``all_device_placement``...)
* :mod:`sbpflow.boxing` (layout-change plans and their execution)
* :mod:`sbpflow._C`: OneFlow's functional namespace (``oneflow._C.matmul``, the fused ops
  LiBai calls), composed of the ops above

This module is also the one place where upper layers install what they own into
:class:`Tensor` (the Tensor layer imports nothing above it; see :mod:`sbpflow.tensor`):
``ops`` its operators and methods (on import of :mod:`sbpflow.ops`), ``autograd`` the
gradient members; ``ops`` also sets the ``__torch_function__`` routing
(:mod:`sbpflow.ops.api`).
"""

import sys as _sys

from . import _quiet_import  # first: a launched rank's Ctrl-C during the imports

# isort: split
import torch as _torch

# Autograd runs on the local torch tensors, so torch's grad-mode switches apply as is; dtypes,
# devices and ``torch.cuda`` are torch's own (``import sbpflow as torch`` keeps them working).
from torch import (
    Size,
    bfloat16,
    bool,
    cuda,
    device,
    double,
    dtype,
    enable_grad,
    finfo,
    float16,
    float32,
    float64,
    half,
    iinfo,
    inference_mode,
    int8,
    int16,
    int32,
    int64,
    is_grad_enabled,
    long,
    no_grad,
    set_grad_enabled,
    uint8,
)
from torch import float as float  # noqa: PLC0414 - torch.float is float32
from torch import int as int  # noqa: PLC0414

from . import (
    _C,
    amp,
    autograd,
    boxing,
    comm,
    distributed,
    env,
    graph,
    nn,
    ops,
    optim,
    random,
    sbp,
    utils,
)
from .amp import autocast
from .autograd import get_bucket_size, no_sync, set_bucket_size
from .checkpoint import load, save
from .ops import cat, stack
from .ops.creation import *  # noqa: F403 - creation and sampling ops
from .ops.creation import (
    default_placement,
    full,
    manual_seed,
    ones,
    ones_like,
    rand,
    randint,
    randn,
    randn_like,
    tensor,
    zeros,
    zeros_like,
)
from .placement import placement, shard_shape, shard_slices
from .tensor import Tensor, from_torch

__version__ = "0.1.0"

__all__ = [
    "_C",
    "Tensor",
    "boxing",
    "cat",
    "comm",
    "stack",
    "distributed",
    "env",
    "from_torch",
    "full",
    "manual_seed",
    "ones",
    "ops",
    "placement",
    "rand",
    "randint",
    "randn",
    "randn_like",
    "zeros_like",
    "ones_like",
    "no_grad",
    "enable_grad",
    "set_grad_enabled",
    "sbp",
    "shard_shape",
    "shard_slices",
    "tensor",
    "zeros",
    "nn",
    "autograd",
    "optim",
    "save",
    "load",
    "amp",
    "autocast",
    "utils",
    "no_sync",
    "set_bucket_size",
    "get_bucket_size",
    "random",
    "default_placement",
    "Size", "bfloat16", "bool", "cuda", "device", "double", "dtype", "finfo", "float",
    "float16", "float32", "float64", "half", "iinfo", "inference_mode", "int", "int8",
    "int16", "int32", "int64", "is_grad_enabled", "long", "uint8",
]

# The op families' functions (sbpflow.where, sbpflow.einsum...) and torch's function forms
# of the Tensor methods (sbpflow.exp(x), sbpflow.sum(x, dim=1)...), generated from the
# registry's declarations (sbpflow.ops.api); a function defined above wins.
for _name, _fn in ops.functions().items():
    if _name not in globals():
        globals()[_name] = _fn
        __all__.append(_name)
del _name, _fn

# Upper layers install their Tensor members here, in one place (see sbpflow.tensor's
# docstring): ops did on import (operators, op methods, torch-function routing); autograd
# the gradient members.
autograd.install()
# torch functions called with sbpflow tensors (torch.exp(x), torch.zeros_like(x)...) run the
# sbpflow function of the same name: a table built once here, looked up by identity.
ops.api.route_module(_torch, globals())
del _torch
# nn.Graph lives a layer above nn (it holds modules and optimizers): OneFlow's names for it,
# sbpflow.nn.Graph and sbpflow.nn.graph.GraphModule, are installed here.
nn.Graph = graph.Graph
nn.graph = graph
_sys.modules["sbpflow.nn.graph"] = graph

_quiet_import.done()  # the imports are done: Ctrl-C is the program's again

#: Subpackages imported on first use (``sbpflow.models.gpt`` without an import of its own):
#: they sit above the framework and are not needed to run it.
_LAZY = ("models", "runtime")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'sbpflow' has no attribute {name!r}")
