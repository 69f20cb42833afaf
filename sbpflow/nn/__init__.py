"""sbpflow.nn: neural-network building blocks on global and local tensors
(``torch.nn``'s API: Module, Parameter, layers, functional, init)."""

from . import functional, init, parallel, utils
from .module import IncompatibleKeys, Module, Parameter
from .modules import *  # noqa: F403 - the layers
from .modules import (
    activation,
    container,
    conv,
    embedding_bag,
    embedding_collection,
    linear,
    loss,
    norm,
    padding,
    pooling,
    rnn,
    sparse,
    transformer,
)

_LAYERS = [n for m in (activation, container, conv, embedding_bag, embedding_collection,
                       linear, loss, norm, padding, pooling, rnn, sparse, transformer)
           for n in m.__all__]

__all__ = ["IncompatibleKeys", "Module", "Parameter", "functional", "init", "parallel", "utils",
           *_LAYERS]
