"""A pool of real rank processes for multi-rank tests (CPU, gloo).

:class:`RankPool` starts ``world_size`` processes once (multiprocessing ``spawn``, no
threads, no fake process group) and runs many test bodies on them. Each worker gets the
torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) plus ``SBPFLOW_CHECK=fast`` (the default collective check),
``SBPFLOW_TIMEOUT`` and one torch thread;
sbpflow initialises its process group lazily from those variables the first time a body
uses it, and keeps it (and its cached sub-groups) for the following bodies.

A body is a module-level function (identified by its file and qualname, so it must be
importable from its file); its arguments and return value are pickled. Any failure (a rank
raised, exited, or did not answer within the timeout) raises ``AssertionError`` naming the
ranks, and restarts the pool: after one rank failed, the others may be blocked in a
collective or hold broken gloo pairs.

:func:`run_isolated` runs one body on fresh processes and reports what each rank did
(returned, raised, exited, timed out), for tests that kill or desynchronise ranks.

Worker output (stdout/stderr, including C++ logs) goes to a per-rank log file and is
forwarded to this process's stderr, prefixed ``[rank r]``, after each call, so pytest
shows it with the test that produced it. A rank that does not answer gets ``SIGUSR1``
first, which makes it dump its Python stacks (faulthandler) into the failure message.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import hashlib
import importlib
import importlib.util
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

DEFAULT_COLLECTIVE_TIMEOUT_S = 20.0  # SBPFLOW_TIMEOUT in the workers
DEFAULT_CALL_TIMEOUT_S = 120.0  # RankPool.run / run_isolated
STARTUP_TIMEOUT_S = 120.0  # spawning a worker and importing torch + sbpflow
CLOSE_TIMEOUT_S = 5.0
FAILURE_GRACE_S = 2.0  # after one rank failed, how long run() waits for the others
_MAX_REPR = 400
_MAX_OUTPUT = 4000


# ------------------------------------------------------------------------ shared helpers


def _unique_module_name(path: str) -> str:
    """Name a worker imports a test file under (unique per file path)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    return f"_sbpflow_rank_task_{digest}_{stem}"


def _fn_spec(fn) -> tuple[str, str, str, bool]:
    """(file path, qualname, module name, is a package member) identifying ``fn``."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or qualname is None or module is None:
        raise TypeError(f"a rank body must be a module-level function, got {fn!r}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"rank body {qualname!r} must be a module-level function (lambdas and nested "
            f"functions cannot be imported by the rank processes)"
        )
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if path is None:
        code = getattr(fn, "__code__", None)
        path = code.co_filename if code is not None else None
    if path is None:
        raise TypeError(f"cannot find the source file of rank body {module}.{qualname}")
    is_pkg_member = module != "__main__" and bool(getattr(mod, "__package__", "") or "")
    return os.path.abspath(path), qualname, module, is_pkg_member


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_environ_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env: dict[str, str | None]):
    """Temporarily apply ``env`` (``None`` unsets) to this process's environment, so that a
    spawned child starts with it: torch and sbpflow read theirs at import, and the spawn
    bootstrap may import them (via the parent's main module) before the worker runs."""
    with _environ_lock:
        saved = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as e:  # noqa: BLE001
        text = f"<unrepresentable {type(value).__name__}: {e}>"
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "...<truncated>"


def _tail(text: str, n: int = _MAX_OUTPUT) -> str:
    return text if len(text) <= n else "...<truncated>...\n" + text[-n:]


def _clean_stacks(text: str) -> str:
    """Drop the harness's and multiprocessing's frames from a faulthandler dump."""
    noise = (f"{os.sep}multiprocessing{os.sep}", f"{os.sep}threading.py", 'File "<string>"',
             os.path.abspath(__file__))
    return "".join(line for line in text.splitlines(True)
                   if not (line.lstrip().startswith("File ") and any(n in line for n in noise)))


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip().splitlines(True)) + "\n"


# -------------------------------------------------------------------------- worker side


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the test process dies, even if this rank is stuck in a collective."""
    armed = False
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != parent_pid:
        os._exit(70)
    if armed:
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=watch, name="sbpflow-pool-watchdog", daemon=True).start()


class _Worker:
    def __init__(self, default_debug: bool) -> None:
        self.modules: dict[str, Any] = {}
        self.default_debug = default_debug

    def load(self, path: str, qualname: str, module: str, is_pkg_member: bool):
        if is_pkg_member:
            mod = importlib.import_module(module)
        else:
            mod = self.modules.get(path)
            if mod is None:
                directory = os.path.dirname(path)
                if directory not in sys.path:
                    sys.path.insert(0, directory)  # so tests can import their helpers
                name = _unique_module_name(path)
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot import a module from {path}")
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    del sys.modules[name]
                    raise
                self.modules[path] = mod
                # Arguments pickled by the test process refer to the module by its pytest
                # name; make that name resolve to this copy.
                if module != "__main__" and module not in sys.modules:
                    sys.modules[module] = mod
        obj = mod
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def reset(self) -> None:
        """Undo per-test global state a body may leave behind in this reused process."""
        with contextlib.suppress(Exception):
            import torch

            torch.set_grad_enabled(True)
            torch.set_default_dtype(torch.float32)
            torch.set_num_threads(1)
        with contextlib.suppress(Exception):
            import sbpflow.distributed as sd
            from sbpflow.distributed import _comm

            _comm._recorders.clear()
            sd.set_debug(self.default_debug)

    def run(self, spec, args_bytes: bytes) -> tuple:
        t0 = time.perf_counter()
        try:
            fn = self.load(*spec)
            args = pickle.loads(args_bytes)
            value = fn(*args)
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            return ("ok", payload, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported to the test process
            elapsed = time.perf_counter() - t0
            tb_obj = e.__traceback__.tb_next if e.__traceback__ is not None else None
            tb = "".join(traceback.format_exception(type(e), e, tb_obj))  # minus this frame
            try:
                exc_bytes = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001
                exc_bytes = None
            return ("err", tb, exc_bytes, f"{type(e).__name__}: {e}", elapsed)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()


def _worker_main(rank: int, env: dict[str, str | None], conn, log_path: str,
                 parent_pid: int) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    with contextlib.suppress(Exception):
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    _die_with_parent(parent_pid)

    import torch  # after OMP_NUM_THREADS is set

    torch.set_num_threads(1)
    # A crash in a thread without Python frames (a gloo worker) also prints every
    # thread's native stack, then chains to faulthandler's Python stacks.
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    import sbpflow.distributed as sd

    worker = _Worker(default_debug=sd.debug_enabled())
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "run":
            _, task_id, spec, args_bytes = msg
            reply = worker.run(spec, args_bytes)
            conn.send((task_id, *reply))
            worker.reset()
        elif msg[0] == "close":
            try:
                sd.destroy()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            with contextlib.suppress(Exception):
                conn.send(("closed",))
            break
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip the interpreter's teardown (seconds with torch loaded on a busy machine); the
    # process group is destroyed and the output flushed.
    os._exit(0)


def heap_check_env() -> dict[str, str]:
    """The environment for glibc's full heap consistency checks in a rank process
    (``MALLOC_CHECK_=3``: a corrupted chunk, double free or overrun aborts at the next
    malloc/free naming it; since glibc 2.34 the checks live in ``libc_malloc_debug.so``,
    preloaded where it exists). For :func:`run_isolated` bodies: the pools run without
    it (it makes small torch ops about 1.6x slower), relying on glibc's default checks,
    which caught the corruption of issue 20 ("unaligned tcache chunk")."""
    env = {"MALLOC_CHECK_": "3"}
    for lib in ("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
                "/lib/aarch64-linux-gnu/libc_malloc_debug.so.0",
                "/usr/lib64/libc_malloc_debug.so.0", "/lib64/libc_malloc_debug.so.0"):
        if os.path.exists(lib):
            pre = os.environ.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = f"{pre} {lib}".strip() if lib not in pre else pre
            break
    return env


# ------------------------------------------------------------------------ parent side


@dataclass
class RankOutcome:
    """What one rank did with a body.

    Attributes:
        rank: the rank.
        status: ``"ok"`` (returned), ``"raised"``, ``"exited"`` (the process ended without
            answering) or ``"timeout"`` (no answer within the timeout; the process was killed).
        exitcode: the process's exit code once it ended (``-9`` when killed, ``None`` if
            still unknown).
        value: the return value (status ``ok``).
        error: the traceback (``raised``) or a description of the exit or timeout.
        exception: the exception object (``raised``) when it could be pickled across.
        elapsed: seconds from handing the body to the rank until it answered, exited or
            was given up on.
        output: what the rank printed while running the body (stdout and stderr).
    """

    rank: int
    status: str
    exitcode: int | None = None
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    elapsed: float = 0.0
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exc_type(self) -> str | None:
        """Name of the raised exception's type (``raised``), e.g. ``"CollectiveError"``."""
        if self.exception is not None:
            return type(self.exception).__name__
        if self.status == "raised" and self.error:
            last = self.error.rstrip().splitlines()[-1]
            return last.split(":", 1)[0].rsplit(".", 1)[-1]
        return None

    def describe(self) -> str:
        head = f"rank {self.rank}"
        if self.status == "ok":
            return f"{head} returned {_short_repr(self.value)} ({self.elapsed:.1f}s)\n"
        if self.status == "raised":
            return f"{head} raised after {self.elapsed:.1f}s:\n{_indent(self.error or '')}"
        return f"{head}: {self.error}\n"


class _Unpickler(pickle.Unpickler):
    """Maps a worker's unique name for a test module back to this process's name."""

    def __init__(self, data: bytes, renames: dict[str, str]) -> None:
        super().__init__(io.BytesIO(data))
        self.renames = renames

    def find_class(self, module: str, name: str):
        return super().find_class(self.renames.get(module, module), name)


def _unpickle(data: bytes, spec) -> Any:
    path, _, module, _ = spec
    return _Unpickler(data, {_unique_module_name(path): module}).load()


_live_pools: weakref.WeakSet[RankPool] = weakref.WeakSet()


def close_pools(pools) -> None:
    """Close several pools at once (their workers shut down in parallel)."""
    closing = [p for p in pools if p._request_close()]
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for pool in closing:
        with contextlib.suppress(Exception):
            pool._finish_close(deadline)


@atexit.register
def _close_all_pools() -> None:
    close_pools(list(_live_pools))


class RankPool:
    """``world_size`` rank processes, started once and reused for many bodies.

    Args:
        world_size: number of ranks.
        env: extra environment for every worker (overrides the defaults below; ``None``
            as a value unsets the variable). Defaults: ``SBPFLOW_CHECK=fast``,
            ``SBPFLOW_TIMEOUT=20``, ``OMP_NUM_THREADS=1``, plus the torchrun variables.
        failure_grace: after one rank failed, seconds :meth:`run` still waits for the
            others before reporting (they are often blocked in a collective with it);
            ``None`` waits for everyone up to the timeout.
    """

    def __init__(self, world_size: int, env: dict[str, str | None] | None = None, *,
                 failure_grace: float | None = FAILURE_GRACE_S,
                 startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.env = dict(env or {})
        self.failure_grace = failure_grace
        self.startup_timeout = startup_timeout
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._conns: list = []
        self._pids: list[int | None] = []
        self._logdir: str | None = None
        self._ready = False
        self._closed = False
        self._task_id = 0
        _live_pools.add(self)
        self._start()

    # ----------------------------------------------------------------- lifecycle

    def _worker_env(self, rank: int, port: int) -> dict[str, str | None]:
        env: dict[str, str | None] = {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SBPFLOW_DEBUG": None,  # the default (fast) collective check, as users get it
            "SBPFLOW_CHECK": "fast",
            "SBPFLOW_TIMEOUT": str(DEFAULT_COLLECTIVE_TIMEOUT_S),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        env.update(self.env)
        return env

    def _start(self) -> None:
        port = _free_port()
        self._logdir = tempfile.mkdtemp(prefix=f"sbpflow-pool-w{self.world_size}-")
        self._procs, self._conns, self._pids = [], [], []
        for rank in range(self.world_size):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self._worker_env(rank, port), child_conn, self._log_path(rank),
                      os.getpid()),
                name=f"sbpflow-rank{rank}-of-{self.world_size}",
                daemon=True,
            )
            with _environment(self._worker_env(rank, port)):
                proc.start()  # the child inherits the environment from its first instruction
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._pids.append(None)
        self._ready = False

    def _log_path(self, rank: int) -> str:
        assert self._logdir is not None
        return os.path.join(self._logdir, f"rank{rank}.log")

    def _read_log(self, rank: int, offset: int = 0) -> str:
        try:
            with open(self._log_path(rank), "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._log_path(rank))
        except OSError:
            return 0

    def _wait_ready(self) -> None:
        if self._ready:
            return
        deadline = time.monotonic() + self.startup_timeout
        pending = set(range(self.world_size))
        problems: list[str] = []
        while pending and time.monotonic() < deadline:
            objs = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            mpc.wait(objs, timeout=max(0.0, deadline - time.monotonic()))
            for r in sorted(pending):
                msg = None
                if self._conns[r].poll():
                    with contextlib.suppress(EOFError, OSError):
                        msg = self._conns[r].recv()
                if msg is not None and msg[0] == "ready":
                    self._pids[r] = msg[1]
                    pending.discard(r)
                elif msg is not None or not self._procs[r].is_alive():
                    self._procs[r].join(1.0)
                    problems.append(f"rank {r} exited during startup (exit code "
                                    f"{self._procs[r].exitcode}):\n"
                                    f"{_indent(_tail(self._read_log(r)))}")
                    pending.discard(r)
        problems += [f"rank {r} did not start within {self.startup_timeout:g}s:\n"
                     f"{_indent(_tail(self._read_log(r)))}" for r in sorted(pending)]
        if problems:
            self._kill()
            raise RuntimeError(f"RankPool(world_size={self.world_size}) failed to start:\n"
                               + "".join(problems))
        self._ready = True

    def _kill(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(Exception):
                if proc.is_alive():
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.join(CLOSE_TIMEOUT_S)
        self._cleanup()

    def _cleanup(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._procs, self._conns, self._pids = [], [], []
        self._ready = False
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

    def restart(self) -> None:
        """Kill the workers; fresh ones start on the next :meth:`run`."""
        self._kill()
        self.restarts += 1

    def close(self) -> None:
        """Ask every worker to destroy its process group and exit; kill what is left."""
        close_pools([self])

    def _request_close(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        _live_pools.discard(self)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("close",))
        return True

    def _finish_close(self, deadline: float) -> None:
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        """The worker process ids (starting the workers if they are not running)."""
        self._ensure_running()
        return [p for p in self._pids if p is not None]

    def _ensure_running(self) -> None:
        if self._closed:
            raise RuntimeError("this RankPool is closed")
        if not self._procs:
            self._start()
        self._wait_ready()

    # ----------------------------------------------------------------- running bodies

    def run_outcomes(self, fn, *args, timeout: float | None = None) -> list[RankOutcome]:
        """Run ``fn(*args)`` on every rank; one :class:`RankOutcome` per rank, never raises
        for a rank's failure (the caller decides). Does not restart the pool."""
        self._ensure_running()
        timeout = DEFAULT_CALL_TIMEOUT_S if timeout is None else float(timeout)
        spec = _fn_spec(fn)
        args_bytes = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        self._task_id += 1
        task_id = self._task_id
        n = self.world_size
        offsets = [self._log_size(r) for r in range(n)]
        outcomes: dict[int, RankOutcome] = {}
        t0 = time.monotonic()
        for r in range(n):
            try:
                self._conns[r].send(("run", task_id, spec, args_bytes))
            except (BrokenPipeError, OSError) as e:
                outcomes[r] = self._exited(r, t0, f"could not be sent the body ({e})")

        deadline = t0 + timeout
        first_failure: float | None = None
        pending = set(range(n)) - set(outcomes)
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            objs = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            mpc.wait(objs, timeout=deadline - now)
            for r in sorted(pending):
                out = self._poll_rank(r, task_id, spec, t0)
                if out is not None:
                    outcomes[r] = out
                    pending.discard(r)
                    if not out.ok and first_failure is None:
                        first_failure = time.monotonic()
                        if self.failure_grace is not None:
                            deadline = min(deadline, first_failure + self.failure_grace)

        if pending:
            self._dump_stacks(pending)
            for r in sorted(pending):
                waited = time.monotonic() - t0
                if first_failure is not None and waited < timeout:
                    why = (f"did not answer within {self.failure_grace:g}s after another rank "
                           f"failed (probably blocked in a collective with it)")
                else:
                    why = f"did not answer within the timeout of {timeout:g}s"
                outcomes[r] = RankOutcome(r, "timeout", error=why, elapsed=waited)

        for r in range(n):
            outcomes[r].output = self._read_log(r, offsets[r])
            if r in pending:
                stack = _clean_stacks(outcomes[r].output)
                outcomes[r].error += (f"; its output and Python stacks (SIGUSR1):\n"
                                      f"{_indent(_tail(stack))}" if stack.strip()
                                      else "; it printed nothing")
        self._forward_output(outcomes)
        return [outcomes[r] for r in range(n)]

    def _exited(self, r: int, t0: float, what: str) -> RankOutcome:
        proc = self._procs[r]
        proc.join(1.0)
        return RankOutcome(r, "exited", exitcode=proc.exitcode,
                           error=f"the process exited with code {proc.exitcode} "
                                 f"without answering ({what})",
                           elapsed=time.monotonic() - t0)

    def _poll_rank(self, r: int, task_id: int, spec, t0: float) -> RankOutcome | None:
        conn = self._conns[r]
        try:
            if conn.poll():
                msg = conn.recv()
            elif not self._procs[r].is_alive():
                return self._exited(r, t0, "it died while running the body")
            else:
                return None
        except (EOFError, OSError):
            return self._exited(r, t0, "it died while running the body")
        if msg[0] != task_id:
            return RankOutcome(r, "raised", error=f"harness: unexpected message {msg!r:.200}",
                               elapsed=time.monotonic() - t0)
        elapsed = time.monotonic() - t0
        if msg[1] == "ok":
            try:
                value = _unpickle(msg[2], spec)
            except Exception as e:  # noqa: BLE001
                return RankOutcome(r, "raised", elapsed=elapsed,
                                   error=f"the return value could not be unpickled in the "
                                         f"test process: {type(e).__name__}: {e}")
            return RankOutcome(r, "ok", value=value, elapsed=elapsed)
        _, _, tb, exc_bytes, _summary, _ = msg
        exception = None
        if exc_bytes is not None:
            with contextlib.suppress(Exception):
                exception = _unpickle(exc_bytes, spec)
        return RankOutcome(r, "raised", error=tb, exception=exception, elapsed=elapsed)

    def _dump_stacks(self, ranks) -> None:
        if not hasattr(signal, "SIGUSR1"):
            return
        sent = False
        for r in ranks:
            proc = self._procs[r]
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGUSR1)
                    sent = True
        if sent:
            time.sleep(0.5)

    def _forward_output(self, outcomes: dict[int, RankOutcome]) -> None:
        for r in sorted(outcomes):
            if outcomes[r].status == "timeout":
                continue  # its output is in the failure message
            text = outcomes[r].output
            if text.strip():
                sys.stderr.write("".join(f"[rank {r}] {line}"
                                         for line in text.rstrip().splitlines(True)) + "\n")

    def run(self, fn, *args, timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank and return the per-rank return values.

        Raises:
            AssertionError: a rank raised, exited or did not answer within ``timeout``
                seconds (default 120); the message names the ranks, shows each failing
                rank's traceback (or stacks) and what the others did. The pool is
                restarted before raising.
        """
        outcomes = self.run_outcomes(fn, *args, timeout=timeout)
        if all(o.ok for o in outcomes):
            return [o.value for o in outcomes]
        self.restart()
        raise AssertionError(_failure_message(fn, self.world_size, outcomes))


def _failure_message(fn, world_size: int, outcomes: list[RankOutcome]) -> str:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    failed = [o for o in outcomes if not o.ok]
    silent = [o.rank for o in failed if o.status == "timeout"]
    raised = [o.rank for o in failed if o.status == "raised"]
    exited = [o.rank for o in failed if o.status == "exited"]
    parts = []
    if raised:
        parts.append(f"rank(s) {raised} raised")
    if exited:
        parts.append(f"rank(s) {exited} exited")
    if silent:
        parts.append(f"rank(s) {silent} did not answer")
    lines = [f"{name} failed on world size {world_size}: {'; '.join(parts)} "
             f"(the rank pool was restarted)\n"]
    # The likely culprits first: raised/exited before silent, then the healthy ones.
    order = {"raised": 0, "exited": 1, "timeout": 2, "ok": 3}
    for o in sorted(outcomes, key=lambda o: (order[o.status], o.rank)):
        lines.append("--- " + o.describe())
    return "".join(lines)


def run_isolated(world_size: int, fn, *args, timeout: float = DEFAULT_CALL_TIMEOUT_S,
                 env: dict[str, str | None] | None = None) -> list[RankOutcome]:
    """Run ``fn(*args)`` once on ``world_size`` fresh rank processes and report each rank.

    For bodies that kill ranks (``os._exit``), hang them, or desynchronise them. Waits for
    every rank up to ``timeout`` seconds (startup not counted), then kills whatever is
    left; never raises for a rank's failure. ``env`` as for :class:`RankPool`.
    """
    pool = RankPool(world_size, env, failure_grace=None)
    try:
        outcomes = pool.run_outcomes(fn, *args, timeout=timeout)
        procs = list(pool._procs)
        if not all(o.status in ("ok", "raised") for o in outcomes):
            pool._kill()
        pool.close()  # destroy the process groups and exit; kill what does not
        for o, proc in zip(outcomes, procs):
            o.exitcode = proc.exitcode
        return outcomes
    finally:
        pool.close()
