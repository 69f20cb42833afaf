"""sbpflow.nn: neural-network building blocks on global and local tensors
(``torch.nn``'s API: Module, Parameter, layers, functional, init)."""

from . import functional, init, utils
from .module import IncompatibleKeys, Module, Parameter

__all__ = ["IncompatibleKeys", "Module", "Parameter", "functional", "init", "utils"]
