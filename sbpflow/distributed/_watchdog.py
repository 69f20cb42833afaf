"""Rank supervision: a rank process exits when its launcher dies.

torchrun's agent (in-process in ``sbpflow launch`` / ``sbpflow train``) starts every rank
as its child and stops them when a rank fails or the agent is signalled. Killed with
SIGKILL, though, the agent stops nothing: its ranks are re-parented (to init or a
sub-reaper) and would go on training and writing checkpoints unsupervised, beside any
run started after. So every rank of a multi-rank world runs :func:`start`'s daemon thread,
which polls ``os.getppid()`` every :data:`POLL_S` seconds and, once the parent has
changed, prints one line naming the rank and the dead launcher's pid and leaves with
``os._exit(EXIT_CODE)`` (no Python or gloo teardown: the launcher is gone and the peers
are exiting the same way). A save in flight is cut short; :func:`sbpflow.save` commits a
version only by a final rename, so the previous version stays the newest.

The parent to watch is the launcher named by ``SBPFLOW_LAUNCHER_PID`` where the variable
was set for this process, else the parent at the time the thread starts. sbpflow's
launcher sets it for its ranks to ``PID:START`` (its pid and its start time, in clock
ticks after boot, from ``/proc/PID/stat``), so that a rank whose launcher died before the
rank started its watchdog exits too. The variable is trusted only when it names this
process's parent, or a dead launcher that this process's current parent cannot have
replaced: a rank whose launcher died is adopted by an older ancestor (init or a
sub-reaper), which started no later than the launcher, whereas a variable inherited from
an earlier job (a stale export in a shell, then a plain ``torchrun``) names a launcher
that started before this process's parent. A value that fails that check (or a bare
``PID``, or one naming a live process that is not the parent: a job started by a rank)
is ignored with a one-line warning, and the current parent is watched. Any launcher
that sets ``RANK``/``WORLD_SIZE`` is covered (the test suite's rank pool too: its
workers exit when pytest dies). ``PR_SET_PDEATHSIG`` is not used: it fires when the
parent *thread* that started the child ends, not the process, and kills without a word.
"""

from __future__ import annotations

import os
import sys
import threading

from .._proc import pid_alive

#: Seconds between two checks of the parent process id.
POLL_S = 0.5
#: Exit code of a rank whose launcher died (nobody waits for it; a fixed code for logs).
EXIT_CODE = 1
#: Set by sbpflow's launcher in its ranks' environment: the pid the ranks must outlive.
LAUNCHER_PID_ENV = "SBPFLOW_LAUNCHER_PID"

_started = False


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field
    22), or ``None`` where that cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def launcher_value(pid: int | None = None) -> str:
    """What a launcher of pid ``pid`` (default this process) sets ``SBPFLOW_LAUNCHER_PID``
    to for its ranks: ``PID:START`` (``PID`` alone where its start time is unknown)."""
    pid = os.getpid() if pid is None else pid
    started = start_time(pid)
    return str(pid) if started is None else f"{pid}:{started}"


def _parse(raw: str) -> tuple[int, int | None] | None:
    pid, _, started = raw.strip().partition(":")
    if not pid.isdigit() or started and not started.isdigit():
        return None
    return int(pid), int(started) if started else None


def _expected_parent(environ=None, ppid: int | None = None) -> int:
    """The pid to outlive (see the module doc): the launcher ``SBPFLOW_LAUNCHER_PID``
    names when it is this process's parent, or when it is gone and this process was
    adopted from it; else the current parent ``ppid`` (default ``os.getppid()``), with a
    warning when the variable was set but does not hold for this process."""
    environ = os.environ if environ is None else environ
    ppid = os.getppid() if ppid is None else ppid
    raw = environ.get(LAUNCHER_PID_ENV, "")
    if not raw:
        return ppid
    parsed = _parse(raw)
    if parsed is None:
        why = "not PID or PID:START"
    else:
        pid, started = parsed
        if pid == ppid:
            return pid
        now = start_time(pid)
        alive = pid_alive(pid) and (started is None or now is None or now == started)
        if alive:
            # a live launcher that is not our parent: the variable was inherited through
            # a process it started (a job launched from inside a rank); watch our parent
            return ppid
        parent_started = start_time(ppid)
        if started is not None and parent_started is not None and \
                parent_started <= started:
            return pid  # adopted by an older ancestor: our launcher died before we got here
        why = ("no start time to check it against" if started is None or
               parent_started is None else
               f"process {pid} is gone and this process's parent ({ppid}) started after "
               f"it, so the variable was inherited from an earlier job")
    sys.stderr.write(f"sbpflow: ignoring {LAUNCHER_PID_ENV}={raw!r} ({why}): it is set by "
                     f"sbpflow's launcher for its own ranks; watching the parent process "
                     f"{ppid} instead. Unset it (e.g. after copying a rank's environment)\n")
    sys.stderr.flush()
    return ppid


def _orphaned(parent: int, rank: int) -> None:
    try:
        sys.stderr.write(f"sbpflow: rank {rank} (pid {os.getpid()}): its launcher (pid "
                         f"{parent}) is gone; exiting with code {EXIT_CODE}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)


def start(rank: int) -> bool:
    """Start the parent watchdog of this rank process once; returns whether it runs.

    Nothing is started for a process whose parent is already init (pid 1) and no launcher
    pid was given: such a process was started detached on purpose (``nohup``, a daemon)
    and has no launcher to outlive.
    """
    global _started
    if _started:
        return True
    parent = _expected_parent()
    if parent <= 1:
        return False
    if os.getppid() != parent:
        _orphaned(parent, rank)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            if os.getppid() != parent:
                _orphaned(parent, rank)

    threading.Thread(target=watch, name="sbpflow-parent-watchdog", daemon=True).start()
    _started = True
    return True
