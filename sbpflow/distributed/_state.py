"""Process-group state: lazy initialisation from torchrun's environment, sub-groups, config.

Environment variables read (torchrun sets the first five):

============================ =========================================================
RANK, WORLD_SIZE, LOCAL_RANK this process's global rank, the world size, rank on the node
MASTER_ADDR, MASTER_PORT     the rendezvous store (``env://`` init)
SBPFLOW_TIMEOUT              seconds a collective may wait for its peers (default 600;
                             finite, from 0.001 to 1e9: torch counts whole ms)
SBPFLOW_CHECK                how collectives are checked for agreement across the ranks
                             of their group before they run: ``fast`` (default: a 32-byte
                             fingerprint exchange), ``full`` (the whole description, as
                             ``SBPFLOW_DEBUG=1``) or ``off``
SBPFLOW_DEBUG                ``1``: the ``full`` check (default off)
SBPFLOW_BACKEND              override the backend (default ``gloo``, or
                             ``cpu:gloo,cuda:nccl`` where CUDA is available)
SBPFLOW_KEEP_EXCEPTHOOK      ``1``: keep Python's exit path after an uncaught exception
                             (default: print it and exit 1 without gloo teardown)
SBPFLOW_LAUNCHER_PID         set by sbpflow's launcher (``PID:START``): the process its
                             ranks outlive by at most ~0.5 s (:mod:`._watchdog`; without
                             it, or where it was not set for this process, the parent)
============================ =========================================================

With ``WORLD_SIZE`` unset the process is a world of 1 and no process group is made.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _watchdog

DEFAULT_TIMEOUT_S = 600.0


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer rank exited, hung, or diverged."""


class SoloExchangeError(RuntimeError):
    """A logical graph one rank builds alone (the ranks of an auto-parallel search each
    pricing their own layout: ``sbpflow.planner.auto``) needed the other ranks: a
    metadata exchange, an agreement check or a new process group. The caller prices that
    layout on every rank instead."""


def solo_guard(what: str) -> None:
    """Raise :class:`SoloExchangeError` when the logical graph being built is one rank's
    alone (its tracer's ``solo``): ``what`` (the exchange) would wait for ranks that are
    building other graphs."""
    if getattr(_state.tracer, "solo", False):
        raise SoloExchangeError(f"rank {_state.rank}: {what} while building a logical graph "
                                f"alone")


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group were about to run different collectives (a different kind,
    shape, dtype or layout, or a different number of collectives so far)."""


CHECK_MODES = ("off", "fast", "full")


@dataclass
class _Config:
    """Timeout, debug mode and check mode; ``None`` means "read the environment variable"."""

    timeout_s: float | None = None
    debug: bool | None = None
    check: str | None = None


def _env_check() -> str:
    raw = os.environ.get("SBPFLOW_CHECK", "").strip().lower()
    if raw == "":
        return "fast"
    if raw in ("0", "false", "no"):
        return "off"
    if raw not in CHECK_MODES:
        raise ValueError(f"SBPFLOW_CHECK={raw!r}: expected one of {', '.join(CHECK_MODES)}")
    return raw


#: Bounds of a collective's timeout, in seconds: torch's process groups count whole
#: milliseconds (a smaller value would become a timeout of 0 ms), and above 1e9 s (31
#: years) a deadline counted in int64 nanoseconds (9.2e9 s) comes close to overflowing.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 1e9


def _check_timeout(value: float, source: str, raw: object) -> float:
    """``value`` (seconds) if it is a usable timeout, else ValueError naming ``source`` (the
    variable or argument), the value ``raw`` given and a fix."""
    if not (math.isfinite(value) and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        raise ValueError(
            f"{source}={raw!r}: the seconds a collective may wait for its peers must be a "
            f"finite number from {MIN_TIMEOUT_S:g} (1 ms; torch counts whole milliseconds) "
            f"to {MAX_TIMEOUT_S:g}; e.g. {source}={DEFAULT_TIMEOUT_S:g} (the default)")
    return float(value)


def _env_timeout(name: str, default: float) -> float:
    """The timeout in environment variable ``name`` (seconds), or ``default`` if unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds; give e.g. "
                         f"{name}={DEFAULT_TIMEOUT_S:g} (the default), or unset it") from None
    return _check_timeout(value, name, raw)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class _State:
    def __init__(self) -> None:
        self.initialized = False
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.owns_group = False
        self.groups: dict[tuple[int, ...], object] = {}
        # collectives run so far per group (sorted ranks), for the agreement check
        self.sequence: dict[tuple[int, ...], int] = {}
        # per group: its same-host fingerprint pipes (a _fifo.FifoExchange), or None
        self.fifos: dict[tuple[int, ...], object] = {}
        # what issued the next collectives (an op name, "item()"...), for error messages
        self.activity = "user code"
        # the source line of a value read in progress (joins the fingerprints), or ""
        self.site = ""
        # an nn.Graph tracing a step (sbpflow.graph): its value_read(what, site) raises;
        # collectives become functional ones (distributed._comm.tracing)
        self.tracer = None
        self.untraced = 0  # depth of _comm.untraced() blocks
        self.p2p_seq = 0  # traced transfers so far: each one's point-to-point tag
        self.config = _Config()


_state = _State()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def default_backend() -> str:
    if os.environ.get("SBPFLOW_BACKEND"):
        return os.environ["SBPFLOW_BACKEND"]
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init(
    backend: str | None = None, timeout: float | None = None, debug: bool | None = None
) -> None:
    """Initialise sbpflow's process group from the torchrun environment variables.

    Called lazily by every sbpflow function that needs the rank or world size; call it
    yourself to pass options. A second call only updates ``debug``.

    Args:
        backend: torch.distributed backend string; default ``gloo`` on CPU-only machines,
            ``cpu:gloo,cuda:nccl`` where CUDA is available (cpu placements use gloo, cuda
            placements NCCL).
        timeout: seconds a collective may wait for its peers before it raises
            :class:`CollectiveError` (default ``SBPFLOW_TIMEOUT`` or 600); a finite
            number from :data:`MIN_TIMEOUT_S` (1 ms) to :data:`MAX_TIMEOUT_S`.
        debug: check each collective's agreement across ranks (default ``SBPFLOW_DEBUG``).

    Raises:
        ValueError: malformed or inconsistent environment (``RANK`` without ``WORLD_SIZE``,
            ``RANK >= WORLD_SIZE``, missing ``MASTER_ADDR``/``MASTER_PORT``), or a timeout
            (``timeout`` or ``SBPFLOW_TIMEOUT``) that is not a number in those bounds
            (NaN, inf, 1e-9, 0): the message names the variable, the value and a fix.
    """
    if debug is not None:
        _state.config.debug = bool(debug)
    if _state.initialized:
        return
    if timeout is not None:
        _state.config.timeout_s = _check_timeout(float(timeout), "timeout", timeout)
    # The environment is read now (not at import), so variables set after
    # `import sbpflow` still count; explicit arguments win.
    if _state.config.timeout_s is None:
        _state.config.timeout_s = _env_timeout("SBPFLOW_TIMEOUT", DEFAULT_TIMEOUT_S)
    if _state.config.debug is None:
        _state.config.debug = _env_flag("SBPFLOW_DEBUG")
    if _state.config.check is None:
        _state.config.check = _env_check()
    if dist.is_available() and dist.is_initialized():
        # The user made the default group themselves; adopt it.
        _state.rank, _state.world_size = dist.get_rank(), dist.get_world_size()
        _state.local_rank = _env_int("LOCAL_RANK") or 0
        _state.initialized = True
        return
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    if world is None:
        if rank not in (None, 0):
            raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not; launch with "
                             f"`sbpflow launch` (torchrun) or set both")
        _state.initialized = True
        return
    if world < 1 or rank is None or not 0 <= rank < world:
        raise ValueError(f"inconsistent environment: RANK={os.environ.get('RANK')!r}, "
                         f"WORLD_SIZE={world}; RANK must be in 0..WORLD_SIZE-1")
    _state.rank, _state.world_size = rank, world
    _state.local_rank = _env_int("LOCAL_RANK") or 0
    _watchdog.start(rank)  # a launched rank exits when its launcher dies (see _watchdog)
    if world > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ValueError(f"WORLD_SIZE={world} but {missing} not set; launch with "
                             f"`sbpflow launch --nproc-per-node {world} script.py`")
        if torch.cuda.is_available():
            torch.cuda.set_device(_state.local_rank % torch.cuda.device_count())
        with gloo_worker_threads():
            dist.init_process_group(
                backend=backend or default_backend(),
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=_state.config.timeout_s),
            )
        _state.owns_group = True
        atexit.register(_destroy_at_exit)
        _install_excepthook()
    _state.initialized = True


def _gloo_threads_setting() -> int:
    """``SBPFLOW_GLOO_THREADS``: worker threads per gloo process group (default 1).

    Raises:
        ValueError: not an integer >= 1 (the message names the variable and a fix)."""
    raw = os.environ.get("SBPFLOW_GLOO_THREADS", "").strip()
    if not raw:
        return 1
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"SBPFLOW_GLOO_THREADS={raw!r}: give an integer >= 1 (worker threads "
                         f"per gloo process group; 1 is the default, 2 is torch's), or unset "
                         f"it")
    return n


@contextlib.contextmanager
def gloo_worker_threads(threads: int | None = None):
    """Make the gloo process groups created inside the block run ``threads`` worker
    threads (default :func:`_gloo_threads_setting`: 1) instead of torch's two.

    Why: with two worker threads, two collectives of one process group run at once on its
    one gloo context, and in torch 2.13 that corrupts the heap now and then (issue 20: a
    ZeRO-3 + activation-checkpointing graph, every all-gather in flight at once, aborted
    with "malloc(): unaligned tcache chunk detected" in a gloo worker's allocation in
    2 of 4 loops over the suite's earlier files; in 0 of the 9 loops after with one
    worker thread, the only change). Collectives of one group then run one after another, still
    overlapped with compute (the main thread); on a CPU the two threads shared the cores
    anyway.

    torch builds a gloo group with its pybind constructor that fixes ``threads = 2 x
    devices``; ``torch.distributed`` offers no option for it, so this swaps the
    constructor ``distributed_c10d`` uses for the block for a subclass that passes
    ``_Options`` (devices chosen as torch does: one per interface in
    ``GLOO_SOCKET_IFNAME``, else the default device)."""
    from torch.distributed import distributed_c10d as c10d

    base = getattr(c10d, "ProcessGroupGloo", None)
    n = _gloo_threads_setting() if threads is None else threads
    if base is None or n == 2:
        yield
        return

    class _Gloo(base):
        def __init__(self, store, rank, size, timeout=None, **kwargs):
            opts = base._Options()
            if timeout is not None:
                opts._timeout = timeout
            ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
            opts._devices = [base.create_device(interface=i) for i in ifnames.split(",")] \
                if len(ifnames) > 1 else [base.create_default_device()]
            opts._threads = n
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = _Gloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = base


def _ensure() -> _State:
    if not _state.initialized:
        init()
    return _state


def get_rank() -> int:
    """This process's global rank (0 in a plain single process)."""
    return _ensure().rank


def get_world_size() -> int:
    """Number of ranks in the world (1 in a plain single process)."""
    return _ensure().world_size


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 in a plain single process)."""
    return _ensure().local_rank


def is_initialized() -> bool:
    return _state.initialized


def timeout_s() -> float:
    """Seconds a collective may wait for its peers before raising."""
    return _ensure().config.timeout_s


def debug_enabled() -> bool:
    """Whether debug mode (``SBPFLOW_DEBUG``: the ``full`` collective check) is on."""
    return _ensure().config.debug


def set_debug(enabled: bool) -> None:
    """Turn debug mode (the ``full`` collective check) on or off for this process."""
    _state.config.debug = bool(enabled)


def check_mode() -> str:
    """How each collective is checked for agreement across its group's ranks before it
    runs: ``"full"`` in debug mode, else ``SBPFLOW_CHECK`` / :func:`set_check`
    (``"fast"`` by default, or ``"off"``)."""
    cfg = _ensure().config
    return "full" if cfg.debug else cfg.check


def set_check(mode: str) -> None:
    """Set the collective check for this process: ``"fast"`` (default), ``"full"`` or
    ``"off"``; every rank must use the same mode.

    Raises:
        ValueError: another mode.
    """
    if mode not in CHECK_MODES:
        raise ValueError(f"check mode {mode!r}: expected one of {', '.join(CHECK_MODES)}")
    _ensure().config.check = mode


def set_activity(what: str) -> None:
    """Name what issues the next collectives (an op, ``item()``...) in mismatch messages."""
    _state.activity = what


# The most recent finished works, kept alive a little longer on purpose. A gloo worker
# thread drops its own reference to a work just after marking it complete; if that is
# the last reference, the work's destructor (and the decref of the tensors it holds)
# runs on the worker thread and must take the GIL. While the interpreter is finalizing,
# taking the GIL ends the thread inside a noexcept destructor: std::terminate, SIGABRT
# ("terminate called without an active exception") after a run that succeeded. Holding
# the last few works here makes the worker's release a plain refcount decrement; they
# are freed on this thread, by later collectives or by release_works() at exit.
_recent_works: collections.deque = collections.deque(maxlen=8)


def release_works(settle_s: float = 0.05) -> None:
    """Free the works that :func:`sbpflow.distributed._comm._wait` kept, on this thread,
    after letting gloo's worker threads drop their references (``settle_s`` seconds with
    the GIL released)."""
    if _recent_works:
        time.sleep(settle_s)
        _recent_works.clear()


def destroy() -> None:
    """Destroy the process group sbpflow made (if any) and forget cached sub-groups."""
    release_works()
    for ex in _state.fifos.values():
        if ex is not None:
            ex.close()
    if _state.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _state.__init__()


def _install_excepthook() -> None:
    """After an uncaught exception, print it and leave with exit code 1 at once.

    Tearing down gloo after a failed or mismatched collective (peers gone or out of
    step) often aborts the interpreter in C++ ("terminate called without an active
    exception", SIGABRT), which hides the Python error behind exit code 134 and makes
    torchrun name the abort as the root cause. So once the traceback is printed and the
    standard streams and logging are flushed, the process ends without C++ teardown.
    Set ``SBPFLOW_KEEP_EXCEPTHOOK=1`` to keep Python's normal exit path.
    """
    if _env_flag("SBPFLOW_KEEP_EXCEPTHOOK"):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt):
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                pass
        os._exit(1)

    sys.excepthook = hook


def _destroy_at_exit() -> None:
    # Without this, gloo's threads abort the interpreter at exit ("terminate called"):
    # finished works are freed here, while the interpreter is whole (see _comm), and
    # then the process groups are destroyed.
    try:
        destroy()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def ensure_groups(groups: list[tuple[int, ...]]) -> None:
    """Create the process groups for ``groups`` (each a tuple of ranks) once and cache them.

    Every rank of the world must call this with the same groups in the same order:
    ``torch.distributed.new_group`` is collective over the world and names a group by a
    world-wide counter, so ranks that made groups in different orders would pair the
    wrong stores and hang. sbpflow calls it only from code that every rank runs with the
    same arguments (boxing plans and conversions are computed from metadata alone), also
    on ranks outside the placement. (``use_local_synchronization=True`` would avoid the
    world-wide call, but with gloo in torch 2.13 two overlapping groups made that way,
    e.g. (0, 1) then (1, 2), deadlock at creation.)
    """
    st = _ensure()
    for ranks in groups:
        key = tuple(sorted(ranks))
        if key in st.groups or len(key) == 1:
            continue
        if len(key) == st.world_size:
            st.groups[key] = dist.group.WORLD
        else:
            solo_guard(f"creating the process group of ranks {list(key)}")
            try:
                with gloo_worker_threads():
                    st.groups[key] = dist.new_group(
                        list(key), timeout=datetime.timedelta(seconds=st.config.timeout_s)
                    )
            except Exception as e:  # noqa: BLE001 - re-raised with context
                raise CollectiveError(
                    f"rank {st.rank}: creating the process group of ranks {list(key)} did not "
                    f"complete (timeout {st.config.timeout_s:g}s): {type(e).__name__}: {e}. "
                    f"Every rank of the world must make the same groups in the same order: "
                    f"the ranks' programs diverged (different placements or layouts per "
                    f"rank), or a rank exited"
                ) from e


def group_of(ranks: tuple[int, ...]):
    """The cached process group of ``ranks`` (made by :func:`ensure_groups`)."""
    key = tuple(sorted(ranks))
    try:
        return _state.groups[key]
    except KeyError:
        raise RuntimeError(
            f"internal: process group {key} was not created with ensure_groups") from None


