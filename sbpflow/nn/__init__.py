"""sbpflow.nn: neural-network building blocks on global and local tensors."""

from . import functional

__all__ = ["functional"]
