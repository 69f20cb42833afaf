"""sbpflow.distributed: the process group, mesh-axis sub-groups, timeouts, debug checks.

Initialises lazily from torchrun's environment variables on first use (see
:func:`init`); a plain single process with none set is a world of 1. Launch several
ranks with ``sbpflow launch --nproc-per-node N script.py`` (wraps torchrun).
"""

from ._comm import (
    CommRecord,
    CommRecorder,
    all_gather,
    all_gather_bytes,
    all_gather_meta,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast,
    broadcast_coalesced,
    check_agreement,
    reduce_scatter,
    send_recv,
    tracing,
    untraced,
)
from ._state import (
    CollectiveError,
    CollectiveMismatchError,
    check_mode,
    debug_enabled,
    default_backend,
    destroy,
    ensure_groups,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    set_activity,
    set_check,
    set_debug,
    timeout_s,
)

# The group collectives (all_reduce, all_gather, ...) take a torch tensor and the ranks of
# the group; every layer above talks to other ranks through them (recorded by CommRecorder,
# checked in debug mode, bounded by the timeout).
__all__ = [
    "all_gather",
    "all_gather_bytes",
    "all_gather_meta",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "broadcast_coalesced",
    "reduce_scatter",
    "send_recv",
    "CollectiveError",
    "CollectiveMismatchError",
    "CommRecord",
    "CommRecorder",
    "barrier",
    "check_agreement",
    "check_mode",
    "debug_enabled",
    "default_backend",
    "destroy",
    "ensure_groups",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "set_activity",
    "set_check",
    "set_debug",
    "timeout_s",
    "tracing",
    "untraced",
]
