"""sbpflow.nn: neural-network building blocks on global and local tensors
(``torch.nn``'s API: Module, Parameter, layers, functional, init)."""

from . import functional, init, parallel, utils
from .module import (
    IncompatibleKeys,
    Module,
    Parameter,
    UninitializedBuffer,
    UninitializedParameter,
)
from .modules import *  # noqa: F403 - the layers
from .modules import (
    activation,
    container,
    conv,
    embedding_bag,
    embedding_collection,
    lazy,
    linear,
    loss,
    margin,
    norm,
    padding,
    pooling,
    rnn,
    sparse,
    transformer,
)
from .parallel import DataParallel

_LAYERS = [n for m in (activation, container, conv, embedding_bag, embedding_collection,
                       lazy, linear, loss, margin, norm, padding, pooling, rnn, sparse,
                       transformer)
           for n in m.__all__]

__all__ = ["DataParallel", "IncompatibleKeys", "Module", "Parameter", "UninitializedBuffer",
           "UninitializedParameter", "functional", "init", "parallel", "utils", *_LAYERS]
