"""An output folder belongs to one run at a time: an exclusive lock on ``FOLDER/.lock``.

``sbpflow train --out X`` holds :class:`RunLock` on ``X`` for the whole job: the process
that launches the ranks holds it (``sbpflow train --nproc-per-node N``), or the run's
only process, or rank 0 when the ranks were started by a plain ``torchrun`` /
``sbpflow launch -m sbpflow.train`` (:data:`HELD_ENV` tells ranks that their launcher
holds it already). A second run into ``X`` raises :class:`RunLockedError` naming the
holder's pid, host, start time and command.

The lock is ``fcntl.flock(LOCK_EX)`` on ``X/.lock``, whose content records the holder
(JSON: pid, host, started, command). The kernel releases an flock when its holder dies
(SIGKILL, a crash, power loss of a local disk), so a dead run on this machine leaves no
stale lock to clean up: the next run takes the lock at once. A lock can stay held after
its run is gone only where the kernel cannot tell: a folder on a network filesystem
whose client host crashed (NFS keeps the lock until its lease expires or the server
restarts). ``take_over=True`` (``--take-over``) replaces such a lock: allowed when the
recorded holder is on another host (the user asserts that it is gone) or is a process of
this host that no longer runs; refused while that process runs.

``flock`` needs a filesystem that supports it (local filesystems do; NFS emulates it
with POSIX locks since Linux 2.6.12); where it is not supported, taking the lock raises
:class:`RunLockedError` saying so.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
from pathlib import Path

from ._proc import pid_alive

__all__ = ["RunLock", "RunLockedError", "HELD_ENV", "LOCK_NAME", "claim_output", "existing_run",
           "clear_run"]

LOCK_NAME = ".lock"
#: Set by a launcher that holds the lock for its ranks: the absolute path of the folder.
HELD_ENV = "SBPFLOW_RUN_LOCK"


class RunLockedError(RuntimeError):
    """The output folder is locked by another run (or cannot be locked here)."""


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that did not record itself (empty lock file)"
    cmd = holder.get("command") or "?"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')} ({cmd})")


class RunLock:
    """The exclusive lock of one output folder (see the module doc).

    Use as a context manager (``with RunLock(folder).acquire(): ...``) or call
    :meth:`release`; both remove the lock file and drop the lock.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> dict:
        """What the lock file records (pid, host, started, command); ``{}`` if nothing."""
        try:
            text = self.path.read_text()
        except (FileNotFoundError, IsADirectoryError):
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}

    def acquire(self, *, take_over: bool = False, command: list[str] | None = None) -> RunLock:
        """Take the lock (without waiting) and record this process as its holder.

        Args:
            take_over: replace a lock that is held although its run is gone (see the
                module doc for when this is allowed).
            command: the command line to record (default ``sys.argv``).

        Raises:
            RunLockedError: another run holds the lock (its pid, host, start time and
                command in the message, with the fixes), or the filesystem has no flock.
        """
        if self._fd is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = self.holder()
                if take_over:
                    self._check_take_over(holder)
                    # The old holder keeps its lock on the unlinked file; we lock a new one.
                    self.path.unlink(missing_ok=True)
                    continue
                raise RunLockedError(
                    f"output folder {self.folder} is in use by another run: "
                    f"{_describe(holder)}. Wait for it to finish, or give another --out. If "
                    f"that run is gone (its host crashed, or the folder is on a network "
                    f"filesystem that kept its lock), rerun with --take-over") from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise RunLockedError(
                        f"cannot lock output folder {self.folder}: its filesystem does not "
                        f"support flock ({e.strerror}); give an --out on a local "
                        f"filesystem") from None
                raise
            # A take-over may have replaced the file between our open and our flock.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": datetime.datetime.now().astimezone().isoformat(
                          timespec="seconds"),
                      "command": shlex.join(sys.argv if command is None else command)}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise RunLockedError(f"could not lock output folder {self.folder}: its lock file kept "
                             f"changing (several runs taking it over at once?)")

    def _check_take_over(self, holder: dict) -> None:
        host, pid = holder.get("host"), holder.get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() \
                and pid_alive(pid):
            raise RunLockedError(
                f"--take-over: output folder {self.folder} is held by {_describe(holder)}, "
                f"and process {pid} is running on this host. Stop that run first (kill "
                f"{pid}), or give another --out")

    def release(self) -> None:
        """Drop the lock and remove the lock file (no-op when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    self.path.unlink()
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


#: What ``sbpflow train`` writes into its output folder (files and the checkpoint folder).
TRAIN_OUTPUTS = ("metrics.jsonl", "ckpt", "config.json", "tokenizer.json", "loss.png",
                 "sample.txt")
#: The outputs whose presence means "this folder holds a run".
RUN_MARKERS = ("metrics.jsonl", "ckpt")


def existing_run(folder: str | os.PathLike) -> str | None:
    """A description of the run ``folder`` holds (its metrics' last step, its checkpoint
    folder), or ``None`` when it holds none (:data:`RUN_MARKERS` absent)."""
    folder = Path(folder)
    found = []
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        last = None
        try:
            for line in metrics.read_text().splitlines():
                try:
                    last = json.loads(line).get("step", last)
                except (json.JSONDecodeError, AttributeError):
                    pass
        except OSError:
            pass
        found.append(f"{metrics} (to step {last})" if last is not None else str(metrics))
    ckpt = folder / "ckpt"
    if ckpt.exists():
        latest = ckpt / "LATEST"
        version = latest.read_text().strip() if latest.is_file() else None
        found.append(f"{ckpt}/ (newest {version})" if version else f"{ckpt}/")
    return ", ".join(found) if found else None


def clear_run(folder: str | os.PathLike) -> list[str]:
    """Remove the outputs of ``sbpflow train`` (:data:`TRAIN_OUTPUTS`) from ``folder``;
    other files are left alone. Returns the names removed."""
    folder = Path(folder)
    removed = []
    for name in TRAIN_OUTPUTS:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def claim_output(folder: str | os.PathLike, *, resume: bool, overwrite: bool = False,
                 take_over: bool = False, restarted: bool = False,
                 command: list[str] | None = None) -> RunLock:
    """Lock ``folder`` for a ``sbpflow train`` run and check what it holds.

    A fresh run (not ``resume``, not an elastic ``restarted`` attempt) into a folder that
    holds a run (:func:`existing_run`) is refused unless ``overwrite``, which removes the
    old run's outputs (:func:`clear_run`; other files stay).

    Returns:
        The held :class:`RunLock` (release it when the run ends).

    Raises:
        RunLockedError: another run holds the folder (see :meth:`RunLock.acquire`).
        FileExistsError: a fresh run into a folder that holds a run, without
            ``overwrite``; the message names what is there and the three fixes.
    """
    lock = RunLock(folder).acquire(take_over=take_over, command=command)
    try:
        if not resume and not restarted:
            found = existing_run(folder)
            if found and not overwrite:
                raise FileExistsError(
                    f"output folder {folder} already holds a run: {found}. Continue it with "
                    f"--resume, write to another folder with --out DIR, or delete that run's "
                    f"outputs ({', '.join(TRAIN_OUTPUTS)}) and start over with --overwrite")
            if overwrite:
                clear_run(folder)
    except BaseException:
        lock.release()
        raise
    return lock
