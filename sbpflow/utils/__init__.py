"""sbpflow.utils: data loading (``sbpflow.utils.data``); OneFlow's global-view helpers
(``sbpflow.utils.global_view``: ``global_mode``, ``to_global``, ``to_local``)."""

from . import data, global_view

__all__ = ["data", "global_view"]
