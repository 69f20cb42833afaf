"""argparse value types shared by the command-line tools (launch, train, bench)."""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonneg_int", "positive_seconds"]


def _int_at_least(value: str, minimum: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return n


def positive_int(value: str) -> int:
    """An integer >= 1 (argparse ``type=``)."""
    return _int_at_least(value, 1, "a positive integer")


def nonneg_int(value: str) -> int:
    """An integer >= 0 (argparse ``type=``)."""
    return _int_at_least(value, 0, "an integer >= 0")


def positive_seconds(value: str) -> float:
    """A finite number of seconds > 0 (argparse ``type=``)."""
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return x
