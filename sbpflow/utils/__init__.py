"""sbpflow.utils: data loading (``sbpflow.utils.data``)."""

from . import data

__all__ = ["data"]
