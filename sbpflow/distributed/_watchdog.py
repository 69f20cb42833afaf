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

The parent to watch is ``SBPFLOW_LAUNCHER_PID`` where the launcher set it (sbpflow's
launcher does, for its ranks, so a rank whose launcher died before the rank started its
watchdog exits too), else the parent at the time the thread starts. Any
launcher that sets ``RANK``/``WORLD_SIZE`` is covered (the test suite's rank pool too:
its workers exit when pytest dies). ``PR_SET_PDEATHSIG`` is not used: it fires when the
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


def _expected_parent() -> int:
    """The launcher's pid: ``SBPFLOW_LAUNCHER_PID`` when it is this process's parent or
    no longer alive (the launcher died before this rank got here); else (the variable
    inherited by a grandchild, or unset) the current parent."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if raw.isdigit():
        pid = int(raw)
        if pid == os.getppid() or not pid_alive(pid):
            return pid
    return os.getppid()


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
