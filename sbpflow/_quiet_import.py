"""A rank started by ``sbpflow launch`` that gets Ctrl-C while torch and sbpflow import
(seconds) exits quietly with ``128 + SIGINT`` (130): the launcher prints the one line for
the job, not a ``KeyboardInterrupt`` traceback per rank. Imported first by
``sbpflow/__init__``; :func:`done` gives Ctrl-C back to the program after the imports.
Outside a launched rank (no ``SBPFLOW_LAUNCHER_PID``) nothing changes."""

from __future__ import annotations

import os
import signal

_previous = None


def _exit_quietly(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    os._exit(128 + signum)


if os.environ.get("SBPFLOW_LAUNCHER_PID"):
    try:
        _previous = signal.signal(signal.SIGINT, _exit_quietly)
    except ValueError:  # imported off the main thread: leave the handler alone
        _previous = None


def done() -> None:
    """Restore the SIGINT handler the process had before the imports."""
    global _previous
    if _previous is not None:
        signal.signal(signal.SIGINT, _previous)
        _previous = None
