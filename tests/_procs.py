"""Process-tree helpers for tests that launch `sbpflow` commands and kill their ranks."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from sbpflow.apps import _runlock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a test process may have inherited from a launcher (a pool worker, torchrun)
LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
          "SBPFLOW_LAUNCHER_PID", _runlock.HELD_ENV, _runlock.NONCE_ENV)


def command_env() -> dict[str, str]:
    """The environment for an `sbpflow` command a test starts: no launcher variables,
    a 60 s collective timeout, this checkout first on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in LEAKY and not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["SBPFLOW_TIMEOUT"] = "60"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def descendants(pid: int) -> list[int]:
    """Process ids of every descendant of ``pid`` (torchrun starts each rank in a session
    of its own, so killing the launcher's process group does not reach the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_all(pids) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The output of ``proc`` once it exits; after ``timeout`` seconds kill it and its
    descendants and fail the test."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all([proc.pid, *descendants(proc.pid)])
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout:.0f}s:\n{out[-4000:]}")
    return out
