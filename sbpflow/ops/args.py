"""Argument normalisation shared by the op front ends (one copy each): dims, sizes,
numbers and tensor operands, as torch reads them.
"""

from __future__ import annotations

import numbers

import torch

from ..tensor import Tensor

__all__ = ["DimError", "check_global_pair", "is_number", "meta_of", "norm_dim", "norm_dims",
           "number", "size_args", "want_tensor"]


class DimError(IndexError, ValueError):
    """A dim out of range. torch raises IndexError; sbpflow's reductions raised
    ValueError before the front ends shared one normaliser, so it is both."""


def norm_dim(d, ndim: int, what: str = "dim") -> int:
    """``d`` normalised to ``[0, ndim)`` (``[0, 1)`` for a 0-dim tensor: dims 0 and -1 name
    the scalar itself, as torch).

    Raises:
        TypeError: ``d`` is not an int (bools are not dims).
        DimError: ``d`` outside ``[-ndim, ndim - 1]`` (an IndexError, as torch's, and a
            ValueError); the message names the dim, the ndim and the valid range.
    """
    if isinstance(d, bool) or not isinstance(d, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {d!r}")
    n = max(ndim, 1)
    if not -n <= d < n:
        raise DimError(f"{what} {d} is out of range for a tensor of {ndim} dims (expected a "
                       f"dim in [{-n}, {n - 1}])")
    return int(d) % n


def norm_dims(dims, ndim: int, what: str = "dim", *, single: bool = False) -> tuple[int, ...]:
    """``dims`` (an int, or a sequence of ints; ``single``: an int only) normalised with
    :func:`norm_dim`, in the given order.

    Raises:
        TypeError: not an int (or a sequence of ints where allowed).
        DimError: a dim out of range. ValueError: the same dim twice.
    """
    if single and (isinstance(dims, bool) or not isinstance(dims, numbers.Integral)):
        raise TypeError(f"{what} must be a single int, got {dims!r}; reduce one dim at a time")
    if isinstance(dims, numbers.Integral) and not isinstance(dims, bool):
        return (norm_dim(dims, ndim, what),)
    if not isinstance(dims, (tuple, list, torch.Size)):
        raise TypeError(f"{what} must be an int or a tuple of ints, got {dims!r}")
    out = tuple(norm_dim(d, ndim, what) for d in dims)
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {tuple(dims)!r} names the same dim twice")
    return out


def size_args(args) -> tuple:
    """``f(2, 3)`` and ``f((2, 3))`` both give ``(2, 3)``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def meta_of(x: Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``x``'s global shape and dtype: torch's own shape rules and
    error messages, without data."""
    return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")


def is_number(v) -> bool:
    return isinstance(v, numbers.Number) and not isinstance(v, Tensor)


def want_tensor(name: str, what: str, v) -> Tensor:
    """``v`` if it is an sbpflow Tensor.

    Raises:
        TypeError: naming the argument and how to wrap a torch tensor."""
    if not isinstance(v, Tensor):
        raise TypeError(f"{name}: {what} must be an sbpflow.Tensor, got {type(v).__name__} "
                        f"(wrap torch tensors with sbpflow.from_torch)")
    return v


def number(name: str, what: str, v) -> float:
    """A Python number from ``v`` (a number, or a 1-element tensor: read, a collective for
    a global one).

    Raises:
        TypeError: not a number. ValueError: a tensor of more than one element."""
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{name}: {what} must be a number or a 1-element tensor, got "
                             f"shape {tuple(v.shape)}")
        return v.item()
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Number):
        raise TypeError(f"{name}: {what} must be a number, got {v!r}")
    return v


def check_global_pair(name: str, x: Tensor, other: Tensor) -> None:
    """Raise if ``other`` is not a Tensor, or one of the two is local and the other global.

    Raises:
        TypeError: naming the conversion that fixes it."""
    if not isinstance(other, Tensor):
        raise TypeError(f"{name}: expected an sbpflow.Tensor, got {type(other).__name__}")
    if x.is_global != other.is_global:
        raise TypeError(f"{name}: one input is local and the other global; convert the local "
                        f"one with .to_global(placement, sbp) or the global one with .to_local()")
