"""Fingerprints of collectives between ranks on one host, through named pipes (FIFOs).

The default collective check (:func:`sbpflow.distributed._comm._check`) exchanges a
32-byte fingerprint with every peer of a group before each collective. Between processes
on one host a named pipe carries it in about 20 us; a gloo message took about 300 us on a
2-core machine, which made the check cost 4% of a tensor-parallel training step (22 small
all-reduces a step) instead of under 1%.

Each rank makes one FIFO per group in a private temporary directory, the peers open it
for writing, and once every rank has its peers' FIFOs open the names are removed (the
pipes live on in the open descriptors; nothing is left on disk). A record is 32 bytes
(sender rank, sequence number, checksum, 0), below ``PIPE_BUF``, so writes from several
peers never interleave. Waiting is bounded by the collective timeout, and a peer process
that exits is noticed within a second (its pid is polled while waiting), as gloo notices
a closed connection.
"""

from __future__ import annotations

import collections
import os
import select
import shutil
import socket
import struct
import tempfile
import time

RECORD = struct.Struct("<qqqq")  # sender rank, sequence number, checksum, unused

def _base_dir() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def host_id() -> str:
    """This host's name and kernel boot id: equal ids can share FIFOs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def available() -> bool:
    return hasattr(os, "mkfifo") and os.name == "posix"


class FifoExchange:
    """This rank's end of the fingerprint exchange of one group (all ranks on one host).

    Made in two steps so that every rank's FIFO exists and is open for reading before
    any peer opens it for writing: :meth:`create` (own FIFO), then, after the ranks
    swapped paths and pids, :meth:`connect` (peers' FIFOs).
    """

    def __init__(self, rank: int, key: tuple[int, ...]):
        self.rank = rank
        self.dir = tempfile.mkdtemp(prefix="sbpflow-check-", dir=_base_dir())
        self.path = os.path.join(self.dir, "g" + "-".join(map(str, key)))
        os.mkfifo(self.path, 0o600)
        self.reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self.writers: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        # records that arrived ahead of their check (a peer may run one check ahead of
        # another's record reaching this rank), per sender, in order
        self.pending: dict[int, collections.deque] = {}
        self.partial = b""
        self.alive_at = 0.0

    def connect(self, peers: dict[int, tuple[str, int]]) -> bool:
        """Open every peer's FIFO (``rank -> (path, pid)``); False if one cannot be
        opened (another mount namespace: the caller falls back to gloo)."""
        try:
            for r, (path, pid) in peers.items():
                self.writers[r] = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                self.pids[r] = pid
                self.pending[r] = collections.deque()
        except OSError:
            self.close()
            return False
        return True

    def unlink(self) -> None:
        """Remove the FIFO's name once every peer has it open (the pipe lives on in the
        open descriptors; nothing is left on disk, even after a SIGKILL)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        for fd in [self.reader, *self.writers.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.writers.clear()
        self.unlink()

    def exchange(self, seq: int, checksum: int, timeout: float) -> dict[int, tuple[int, int]]:
        """Send ``(seq, checksum)`` to every peer and return each peer's ``(seq,
        checksum)``.

        Raises:
            TimeoutError: a peer did not send within ``timeout`` seconds.
            ConnectionError: a peer's process exited, or stopped reading (its pipe full).
        """
        record = RECORD.pack(self.rank, seq, checksum, 0)
        for r, fd in self.writers.items():
            try:
                os.write(fd, record)
            except (BlockingIOError, BrokenPipeError) as e:
                raise ConnectionError(f"rank {r} is not reading its fingerprints "
                                      f"({type(e).__name__}): it exited or is stuck") from e
        deadline = time.monotonic() + timeout
        while any(not self.pending[r] for r in self.writers):
            try:
                chunk = os.read(self.reader, 64 * RECORD.size)
            except BlockingIOError:
                chunk = None
            if chunk:
                self.partial += chunk
                n = len(self.partial) - len(self.partial) % RECORD.size
                for i in range(0, n, RECORD.size):
                    sender, s, c, _ = RECORD.unpack_from(self.partial, i)
                    self.pending.setdefault(sender, collections.deque()).append((s, c))
                self.partial = self.partial[n:]
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                late = [r for r in self.writers if not self.pending[r]]
                raise TimeoutError(f"no fingerprint from rank(s) {late} within {timeout:g}s")
            if chunk == b"":  # every writer closed: do not spin, look for the dead
                time.sleep(min(0.05, left))
            else:
                select.select([self.reader], [], [], min(1.0, left))
            now = time.monotonic()
            if chunk == b"" or now - self.alive_at >= 1.0:  # peers' pids, once a second
                self.alive_at = now
                gone = [r for r, pid in self.pids.items() if not _alive(pid)]
                if gone:
                    raise ConnectionError(f"rank(s) {gone} exited (pid "
                                          f"{', '.join(str(self.pids[r]) for r in gone)})")
        return {r: self.pending[r].popleft() for r in self.writers}


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
