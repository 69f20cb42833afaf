"""sbpflow.distributed: the process group, mesh-axis sub-groups, timeouts, debug checks.

Initialises lazily from torchrun's environment variables on first use (see
:func:`init`); a plain single process with none set is a world of 1. Launch several
ranks with ``sbpflow launch --nproc-per-node N script.py`` (wraps torchrun).
"""

from ._comm import CommRecord, CommRecorder, barrier
from ._state import (
    CollectiveError,
    CollectiveMismatchError,
    debug_enabled,
    default_backend,
    destroy,
    ensure_groups,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    set_debug,
    timeout_s,
)

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CommRecord",
    "CommRecorder",
    "barrier",
    "debug_enabled",
    "default_backend",
    "destroy",
    "ensure_groups",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "set_debug",
    "timeout_s",
]
