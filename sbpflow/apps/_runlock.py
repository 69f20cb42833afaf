"""An output folder belongs to one run at a time: an exclusive lock on ``FOLDER/.lock``.

``sbpflow train --out X`` holds :class:`RunLock` on ``X`` for the whole job: the process
that launches the ranks holds it (``sbpflow train --nproc-per-node N``), or the run's
only process, or rank 0 when the ranks were started by a plain ``torchrun`` /
``sbpflow launch -m sbpflow.apps.train``. A second run into ``X`` raises
:class:`RunLockedError` naming the holder's pid, host, start time and command.

**The hand-off to the ranks.** A launcher that holds the lock gives its ranks
:meth:`RunLock.handoff_env`: :data:`HELD_ENV` (the folder) and :data:`NONCE_ENV` (a random
nonce that the lock file records too). A rank skips the lock (and the check of what the
folder holds, which its launcher did) only when :func:`handed_off` verifies it: the lock
file of that folder records this process's parent as its holder, on this host, with that
nonce. Set by hand (``SBPFLOW_RUN_LOCK=X`` in a shell, or a rank's environment copied), the
variables are ignored with a warning and the process takes the lock as any run does, so
they cannot switch the lock or the existing-run check off.

The lock is ``fcntl.flock(LOCK_EX)`` on ``X/.lock``, whose content records the holder
(JSON: pid, host, started, command, nonce). The kernel releases an flock when its holder dies
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
import secrets
import shlex
import shutil
import socket
import sys
from pathlib import Path

from sbpflow._proc import pid_alive

__all__ = ["RunLock", "RunLockedError", "HELD_ENV", "NONCE_ENV", "LOCK_NAME", "claim_output",
           "existing_run", "clear_run", "handed_off", "has_checkpoint"]

LOCK_NAME = ".lock"
#: Set by a launcher that holds the lock for its ranks: the absolute path of the folder.
HELD_ENV = "SBPFLOW_RUN_LOCK"
#: Set with :data:`HELD_ENV`: the nonce the launcher's lock file records.
NONCE_ENV = "SBPFLOW_RUN_LOCK_NONCE"


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
        self._nonce: str | None = None

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
            nonce = secrets.token_hex(16)
            record = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": datetime.datetime.now().astimezone().isoformat(
                          timespec="seconds"),
                      "command": shlex.join(sys.argv if command is None else command),
                      "nonce": nonce}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
            self._fd, self._nonce = fd, nonce
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

    def handoff_env(self) -> dict[str, str]:
        """The variables that tell this process's children (its ranks) that it holds the
        lock for them (:func:`handed_off` checks them)."""
        if self._fd is None:
            raise RuntimeError(f"the lock of {self.folder} is not held; acquire it first")
        return {HELD_ENV: str(self.folder.resolve()), NONCE_ENV: self._nonce}

    def release(self) -> None:
        """Drop the lock and remove the lock file (no-op when not held)."""
        if self._fd is None:
            return
        fd, self._fd, self._nonce = self._fd, None, None
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


def handed_off(folder: str | os.PathLike, environ=None,
               parent: int | None = None) -> tuple[bool, str | None]:
    """Whether this process's launcher holds the lock of ``folder`` for it (module doc).

    Args:
        folder: the output folder of this run.
        environ: the environment to read :data:`HELD_ENV` and :data:`NONCE_ENV` from
            (default ``os.environ``).
        parent: the launcher's pid (default ``os.getppid()``: a rank is its launcher's
            child).

    Returns:
        ``(True, None)`` when verified; ``(False, None)`` when no hand-off names
        ``folder``; ``(False, why)`` when one names it but does not hold (``why`` says
        what failed, for a warning).
    """
    environ = os.environ if environ is None else environ
    parent = os.getppid() if parent is None else parent
    named = environ.get(HELD_ENV)
    if not named or named != str(Path(folder).resolve()):
        return False, None
    nonce = environ.get(NONCE_ENV, "")
    holder = RunLock(folder).holder()
    if not nonce:
        why = f"{NONCE_ENV} is not set"
    elif not holder:
        why = f"{Path(folder) / LOCK_NAME} records no holder (no run holds the folder)"
    elif holder.get("host") != socket.gethostname() or holder.get("pid") != parent:
        why = (f"the lock is held by {_describe(holder)}, not by this process's launcher "
               f"(pid {parent} on host {socket.gethostname()})")
    elif holder.get("nonce") != nonce:
        why = f"the lock file's nonce is not {NONCE_ENV}'s"
    else:
        return True, None
    return False, why


#: What ``sbpflow train`` writes into its output folder (files and the checkpoint folder).
TRAIN_OUTPUTS = ("metrics.jsonl", "ckpt", "config.json", "tokenizer.json", "loss.png",
                 "sample.txt")
#: The outputs whose presence means "this folder holds a run".
RUN_MARKERS = ("metrics.jsonl", "ckpt")


def has_checkpoint(ckpt: str | os.PathLike) -> bool:
    """Whether ``ckpt`` holds a committed checkpoint version (``LATEST``, or a version
    folder that :func:`sbpflow.load` can fall back to when ``LATEST`` is damaged)."""
    ckpt = Path(ckpt)
    if (ckpt / "LATEST").exists():
        return True
    return ckpt.is_dir() and any(p.name.startswith("v") and p.name[1:].isdigit()
                                 for p in ckpt.iterdir())


def existing_run(folder: str | os.PathLike) -> str | None:
    """A description of the run ``folder`` holds (its metrics' last step, its checkpoint
    folder), or ``None`` when it holds none (:data:`RUN_MARKERS` absent, or metrics that
    record no step and no checkpoint folder: a run that stopped before its first step,
    e.g. a bad plan file or calibration, left nothing to lose, and the same command runs
    again without ``--overwrite``)."""
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
        if last is not None:
            found.append(f"{metrics} (to step {last})")
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
            ``overwrite``; the message names what is there and the fixes (``--resume``
            only where it holds a checkpoint to continue from).
    """
    lock = RunLock(folder).acquire(take_over=take_over, command=command)
    try:
        if not resume and not restarted:
            found = existing_run(folder)
            if found and not overwrite:
                if has_checkpoint(Path(folder) / "ckpt"):
                    fixes = (f"Continue it with --resume, write to another folder with --out "
                             f"DIR, or delete that run's outputs ({', '.join(TRAIN_OUTPUTS)}) "
                             f"and start over with --overwrite")
                else:
                    fixes = (f"It has no checkpoint (it stopped before its first one), so "
                             f"--resume cannot continue it: start it over with --overwrite "
                             f"(deletes its outputs: {', '.join(TRAIN_OUTPUTS)}), or write "
                             f"to another folder with --out DIR")
                raise FileExistsError(f"output folder {folder} already holds a run: {found}. "
                                      f"{fixes}")
            if overwrite:
                clear_run(folder)
    except BaseException:
        lock.release()
        raise
    return lock
