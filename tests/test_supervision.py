"""Supervision and the rendezvous: runs that nothing can leave headless, share, or expose.

* The listening TCP sockets of a 2-rank ``sbpflow launch`` job (the launcher and its
  ranks, read from /proc/net/tcp{,6} and /proc/PID/fd): at least one (the store), none on
  a non-loopback address.
* SIGKILL of the launcher of ``sbpflow train``: every rank is gone within
  :data:`EXIT_WITHIN_S`, and the checkpoint folder does not change after. The watchdog
  trusts ``SBPFLOW_LAUNCHER_PID`` only where it was set for the process: a stale one
  (plain torchrun) does not stop a rank; a rank whose launcher died before it started
  still exits.
* The output folder's lock: a second run into it is refused naming the holder's pid and
  host; ``--resume`` works after the first ends; a fresh run into a run's folder is
  refused and ``--overwrite`` replaces it; ``--take-over`` (in process, with a holder
  process that keeps the flock); ``--resume`` names the holder too; the launcher's
  hand-off (``SBPFLOW_RUN_LOCK``) is honoured only for its pid, host and nonce, so set by
  hand it skips neither the lock nor the check of what the folder holds.
* Fault injection: ``sbpflow train gpt-mini --max-restarts 2`` with a random rank
  SIGKILLed at a random step finishes with exit 0, each step once in ``metrics.jsonl``,
  and the losses of the uninterrupted run within 1e-6 (one run here, five with
  ``pytest -m exhaustive``).

Every subprocess runs in a session of its own and is killed, with its ranks, on failure.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _procs import LEAKY, command_env, descendants, finish, kill_all

from sbpflow._proc import pid_alive
from sbpflow.apps import _runlock, train

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 400.0
EXIT_WITHIN_S = 10.0

# A tiny gpt-mini run: 1 layer, 12 steps of 8 windows of 32 characters.
STEPS = 12
TINY = ["gpt-mini", "--nproc-per-node", "2", "--steps", str(STEPS), "--batch-size", "8",
        "--block-size", "32", "--config", "n_layer=1", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--seed", "5"]


# ----------------------------------------------------------------------------- helpers
def _env() -> dict[str, str]:
    return command_env()


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sbpflow.cli", *args], cwd=REPO,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ranks_of(pid: int, marker: str) -> list[int]:
    return [p for p in descendants(pid) if marker in _cmdline(p)]


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> str:
    return finish(proc, timeout)


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = RUN_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_all([proc.pid, *descendants(proc.pid)])
            out = proc.communicate()[0]
            pytest.fail(f"{what} did not happen (exit {proc.returncode}):\n{out[-4000:]}")
        time.sleep(0.05)


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` -> (size, mtime in ns)."""
    out = {}
    for path in folder.rglob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def _lock_is_held(folder: Path) -> bool:
    """Whether another process holds the lock of ``folder``."""
    try:
        _runlock.RunLock(folder).acquire().release()
    except _runlock.RunLockedError:
        return True
    return False


# ----------------------------------------------------------------------------- sockets
def _listening_inodes() -> dict[int, str]:
    """Socket inode -> "address:port" of every listening TCP socket (IPv4 and IPv6) of this
    network namespace (/proc/net/tcp and tcp6, state 0A)."""
    out = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            addr = ipaddress.ip_address(raw)
            out[int(fields[9])] = f"{addr}:{int(hex_port, 16)}"
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _is_loopback(address: str) -> bool:
    addr = ipaddress.ip_address(address.rsplit(":", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


_WAIT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import sbpflow.distributed as dist
    from sbpflow.distributed import _comm
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.ensure_groups([tuple(range(world))])
    total = _comm.all_reduce(torch.tensor([float(rank + 1)]), tuple(range(world)))
    folder = sys.argv[1]
    with open(os.path.join(folder, f"ready{rank}"), "w") as f:
        f.write(str(int(total.item())))
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    dist.barrier()
    dist.destroy()
""")


def test_two_rank_job_listens_on_loopback_only(tmp_path):
    script = tmp_path / "wait_script.py"
    script.write_text(_WAIT_SCRIPT)
    proc = _start(["launch", "--nproc-per-node", "2", str(script), str(tmp_path)])
    try:
        # both ranks past their first collective: gloo's sockets are up too
        _wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), proc,
                  "both ranks ready")
        ranks = _ranks_of(proc.pid, "wait_script")
        listening = _listening_inodes()
        sockets = {pid: sorted(listening[i] for i in _socket_inodes(pid) if i in listening)
                   for pid in [proc.pid, *ranks]}
    finally:
        (tmp_path / "go").write_text("")
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert len(ranks) == 2, sockets
    assert [(tmp_path / f"ready{r}").read_text() for r in (0, 1)] == ["3", "3"]
    found = [a for addrs in sockets.values() for a in addrs]
    assert sockets[proc.pid], f"the launcher's store is not listening? {sockets}"
    exposed = [a for a in found if not _is_loopback(a)]
    assert not exposed, f"listening on non-loopback addresses: {exposed} (all: {sockets})"


def test_socket_parser_sees_a_wildcard_listener():
    """The check above can fail: a socket bound to every interface is seen as exposed."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s4, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lo:
        s6.bind(("::", 0))
        s4.bind(("0.0.0.0", 0))
        lo.bind(("127.0.0.1", 0))
        for s in (s6, s4, lo):
            s.listen()
        listening = _listening_inodes()
        mine = sorted(listening[i] for i in _socket_inodes(os.getpid()) if i in listening)
        expect = sorted([f":::{s6.getsockname()[1]}", f"0.0.0.0:{s4.getsockname()[1]}",
                         f"127.0.0.1:{lo.getsockname()[1]}"])
    assert sorted(mine) == expect
    assert [_is_loopback(a) for a in expect] == [a.startswith("127.") for a in expect]


# ----------------------------------------------------------------------------- kill the launcher
def test_sigkill_of_the_launcher_stops_every_rank(tmp_path):
    out = tmp_path / "headless"
    proc = _start(["train", *TINY, "--steps", "400", "--ckpt-every", "2", "--out", str(out)])
    _wait_for(lambda: (out / "ckpt" / "LATEST").exists(), proc, "a first checkpoint")
    ranks = _ranks_of(proc.pid, "sbpflow.apps.train")
    assert len(ranks) == 2, [_cmdline(p) for p in descendants(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.communicate()
    try:
        while any(pid_alive(p) for p in ranks) and time.monotonic() - killed_at < EXIT_WITHIN_S:
            time.sleep(0.05)
        left = [p for p in ranks if pid_alive(p)]
        assert not left, f"ranks {left} still run {EXIT_WITHIN_S:.0f}s after the launcher died"
    finally:
        kill_all(ranks)
    before = _tree(out / "ckpt")
    steps_before = len(_metrics(out))
    time.sleep(3.0)
    assert _tree(out / "ckpt") == before
    assert len(_metrics(out)) == steps_before < 400
    assert not (out / ".lock").exists() or not _lock_is_held(out)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_launcher_pid_is_trusted_only_where_it_was_set_for_this_process(capsys):
    from sbpflow.distributed import _watchdog

    env = _watchdog.LAUNCHER_PID_ENV
    me, parent = os.getpid(), os.getppid()
    mine = _watchdog.start_time(me)
    dead = _dead_pid()
    init_started = _watchdog.start_time(1)
    assert mine is not None and init_started is not None
    expect = _watchdog._expected_parent
    # no variable, or the parent's own value: the parent
    assert expect({}, ppid=me) == me
    assert expect({env: _watchdog.launcher_value(me)}, ppid=me) == me
    # a live launcher that is not the parent (a job started from inside a rank): the parent
    assert expect({env: _watchdog.launcher_value(parent)}, ppid=me) == me
    assert capsys.readouterr().err == ""
    # the launcher died before this process got here, which an older ancestor (init)
    # adopted: the dead launcher, so that the rank exits
    assert expect({env: f"{dead}:{init_started}"}, ppid=1) == dead
    # stale: the launcher is gone and the parent started after it (a plain torchrun
    # under an exported variable); a bare pid, unverifiable; garbage: the parent, warned
    for value in (f"{dead}:{init_started}", str(dead), "12ab"):
        assert expect({env: value}, ppid=me) == me, value
        err = capsys.readouterr().err
        assert f"ignoring {env}={value!r}" in err and f"parent process {me}" in err, err
    # a pid reused by another process (its start time differs): as gone
    assert expect({env: f"{parent}:{init_started}"}, ppid=me) == me


_RANK_ALIVE = "import sbpflow.distributed as d; d.init(); print('rank ran', flush=True)"


def test_a_stale_launcher_pid_does_not_stop_a_rank(tmp_path):
    """A rank under a plain launcher (torchrun) with a SBPFLOW_LAUNCHER_PID inherited
    from a job long gone runs, with a warning (it exited, saying its launcher is gone)."""
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "1", "SBPFLOW_LAUNCHER_PID": str(_dead_pid())}
    proc = subprocess.run([sys.executable, "-c", _RANK_ALIVE], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "rank ran" in proc.stdout, proc.stderr[-3000:]
    assert "ignoring SBPFLOW_LAUNCHER_PID" in proc.stderr and "is gone" not in proc.stderr


_ORPHANING_LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    with open("/proc/self/stat") as f:
        started = f.read().rsplit(")", 1)[1].split()[19]
    env = dict(os.environ, SBPFLOW_LAUNCHER_PID=f"{os.getpid()}:{started}")
    rank = ("import os, sys, time\\n"
            "while os.getppid() == int(sys.argv[1]): time.sleep(0.02)\\n"  # orphaned
            "import sbpflow.distributed as d; d.init(); print('rank ran', flush=True)")
    child = subprocess.Popen([sys.executable, "-c", rank, str(os.getpid())], env=env,
                             stdout=open(sys.argv[1], "w"), stderr=subprocess.STDOUT)
    print(child.pid, flush=True)
    os._exit(0)  # the launcher dies before its rank gets to its watchdog
""")


def test_a_rank_whose_launcher_died_before_it_started_exits(tmp_path):
    log = tmp_path / "rank.log"
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", _ORPHANING_LAUNCHER, str(log)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    rank = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 120
    while pid_alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = pid_alive(rank)
    kill_all([rank])
    text = log.read_text()
    assert not alive and "rank ran" not in text, text[-3000:]
    assert "its launcher (pid" in text and "is gone" in text, text[-3000:]


# ----------------------------------------------------------------------------- the folder lock
def _train_here(args: list[str], monkeypatch, capsys,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """``sbpflow train`` in this process (with ``env`` set), expected to be refused before
    it launches or trains."""
    from sbpflow.distributed import launch

    def no_launch(*a, **k):
        raise AssertionError(f"sbpflow train {args} was not refused: it launched its ranks")

    def no_training(*a, **k):
        raise AssertionError(f"sbpflow train {args} was not refused: it trained")

    for k in (*LEAKY, _runlock.NONCE_ENV):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch, "main", no_launch)
    monkeypatch.setattr(train._Trainer, "run", no_training)
    try:
        code = train.main(args)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_second_run_into_a_folder_is_refused_then_resume_works(tmp_path, monkeypatch, capsys):
    out = tmp_path / "shared"
    first = _start(["train", *TINY, "--steps", "8", "--out", str(out)])
    holder = _wait_for(lambda: _runlock.RunLock(out).holder(), first, "the lock")
    assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
    for extra in ([], ["--resume"], ["--overwrite"], ["--take-over"]):
        code, err = _train_here([*TINY, "--out", str(out), *extra], monkeypatch, capsys)
        if first.poll() is not None:
            break
        assert code == 2, (extra, err)
        assert f"pid {first.pid} on host {socket.gethostname()}" in err, (extra, err)
        assert "in use by another run" in err or "is running on this host" in err, err
    text = _finish(first)
    assert first.returncode == 0, text[-4000:]
    assert first.poll() is not None and len(_metrics(out)) == 8
    assert not (out / ".lock").exists()  # released and removed at the end

    # a fresh run into the finished run's folder is refused, naming what is there
    code, err = _train_here([*TINY, "--out", str(out)], monkeypatch, capsys)
    assert code == 2
    assert "already holds a run" in err and "metrics.jsonl (to step 8)" in err, err
    assert "--resume" in err and "--overwrite" in err and "--out" in err
    assert len(_metrics(out)) == 8  # untouched

    resumed = _start(["train", *TINY, "--steps", "10", "--out", str(out), "--resume"])
    text = _finish(resumed)
    assert resumed.returncode == 0, text[-4000:]
    assert "steps 8->10" in text, text[-2000:]
    assert [r["step"] for r in _metrics(out)] == list(range(1, 11))


def _finished_run(out: Path) -> Path:
    """A folder holding a run (metrics to step 2, a checkpoint folder)."""
    (out / "ckpt" / "v000001").mkdir(parents=True)
    (out / "ckpt" / "LATEST").write_text("v000001\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.9}\n')
    return out


def test_refusal_of_a_finished_run_names_the_steps_that_resume_it(tmp_path, monkeypatch,
                                                                   capsys):
    """Found by a fresh-user trial: a second run into a finished run's folder was told to
    continue it with --resume, which was then refused (nothing past --steps to train)."""
    out = _finished_run(tmp_path / "done")
    i = TINY.index("--steps")
    args = TINY[:i] + TINY[i + 2:]
    code, err = _train_here([*args, "--steps", "2", "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "already holds a run" in err, err
    assert "reached step 2 and --steps is 2" in err and "--resume with --steps 4" in err, err
    # a run that has steps left to train: plain --resume advice, no --steps hint
    code, err = _train_here([*args, "--steps", "5", "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and "Continue it with --resume" in err and "reached step" not in err, err


@pytest.mark.parametrize("under_torchrun", [False, True])
def test_a_hand_off_variable_set_by_hand_does_not_skip_the_lock(tmp_path, monkeypatch, capsys,
                                                                under_torchrun):
    """SBPFLOW_RUN_LOCK=OUT (with or without a nonce) set by hand, in a plain process or
    in rank 0 of a plain torchrun: the run still takes the lock and checks what the
    folder holds (it replaced a finished run's metrics, and let two runs share a folder)."""
    out = _finished_run(tmp_path / "done")
    before = (out / "metrics.jsonl").read_text()
    ranks = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"} if under_torchrun else {}
    args = [*TINY, "--out", str(out)]
    for nonce in ({}, {_runlock.NONCE_ENV: "0" * 32}):
        env = {_runlock.HELD_ENV: str(out.resolve()), **nonce, **ranks}
        code, err = _train_here(args, monkeypatch, capsys, env)
        assert code == 2, err
        assert "already holds a run" in err and "metrics.jsonl (to step 2)" in err, err
        assert f"ignoring {_runlock.HELD_ENV}=" in err, err
    assert (out / "metrics.jsonl").read_text() == before
    # a folder that another run holds: refused naming it, the variables notwithstanding
    busy = tmp_path / "busy"
    holder = _holder(busy, socket.gethostname())
    try:
        env = {_runlock.HELD_ENV: str(busy.resolve()), _runlock.NONCE_ENV: "0" * 32, **ranks}
        code, err = _train_here([*TINY, "--out", str(busy)], monkeypatch, capsys, env)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"pid {holder.pid} on host" in err and "in use by another run" in err


def test_handed_off_checks_the_launchers_pid_host_and_nonce(tmp_path):
    out = tmp_path / "run"
    lock = _runlock.RunLock(out).acquire()
    try:
        env = lock.handoff_env()
        assert env[_runlock.HELD_ENV] == str(out.resolve())
        me = os.getpid()  # the holder: the launcher of the ranks we pretend to be
        assert _runlock.handed_off(out, env, parent=me) == (True, None)
        assert _runlock.handed_off(tmp_path / "other", env, parent=me) == (False, None)
        ok, why = _runlock.handed_off(out, env, parent=me + 1)
        assert not ok and f"pid {me} on host" in why and f"pid {me + 1}" in why
        ok, why = _runlock.handed_off(out, {**env, _runlock.NONCE_ENV: "f" * 32}, parent=me)
        assert not ok and "nonce" in why
        ok, why = _runlock.handed_off(out, {_runlock.HELD_ENV: str(out.resolve())}, parent=me)
        assert not ok and f"{_runlock.NONCE_ENV} is not set" in why
    finally:
        lock.release()
    ok, why = _runlock.handed_off(out, env, parent=me)  # released: nobody holds it
    assert not ok and "records no holder" in why
    with pytest.raises(RuntimeError, match="not held"):
        lock.handoff_env()


def test_resume_while_another_run_holds_the_folder_names_that_run(tmp_path, monkeypatch,
                                                                  capsys):
    """--resume into a folder another run holds (no checkpoint yet) names the holder, not
    a missing checkpoint."""
    out = tmp_path / "busy"
    holder = _holder(out, socket.gethostname())
    try:
        code, err = _train_here([*TINY, "--out", str(out), "--resume"], monkeypatch, capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"pid {holder.pid} on host" in err and "in use by another run" in err
    assert "no checkpoint" not in err, err


def test_claim_output_overwrite_removes_only_the_runs_outputs(tmp_path):
    out = tmp_path / "run"
    (out / "ckpt" / "v000001").mkdir(parents=True)
    (out / "ckpt" / "LATEST").write_text("v000001\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.9}\n')
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"metrics.jsonl \(to step 2\).*newest v000001"):
        _runlock.claim_output(out, resume=False)
    assert not _lock_is_held(out)  # a refusal releases the lock
    lock = _runlock.claim_output(out, resume=True)  # resuming is fine
    lock.release()
    lock = _runlock.claim_output(out, resume=False, overwrite=True)
    try:
        assert sorted(p.name for p in out.iterdir()) == [".lock", "notes.txt"]
    finally:
        lock.release()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


_HOLDER = textwrap.dedent("""
    import fcntl, json, os, sys, time
    path, host = sys.argv[1], sys.argv[2]
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": host, "started": "then",
                             "command": "sbpflow train elsewhere"}).encode())
    print("locked", flush=True)
    time.sleep(120)
""")


def _holder(folder: Path, host: str) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder / ".lock"), host],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_take_over(tmp_path):
    here = socket.gethostname()
    # the holder runs on this host: refused, with or without --take-over
    out = tmp_path / "a"
    holder = _holder(out, here)
    try:
        with pytest.raises(_runlock.RunLockedError,
                           match=rf"pid {holder.pid} on host {here}.*--take-over"):
            _runlock.RunLock(out).acquire()
        with pytest.raises(_runlock.RunLockedError, match=rf"process {holder.pid} is running"):
            _runlock.RunLock(out).acquire(take_over=True)
    finally:
        holder.kill()
        holder.wait()
    # its holder died: the kernel dropped the flock, the next run takes it without asking
    lock = _runlock.RunLock(out).acquire()
    assert lock.holder()["pid"] == os.getpid()
    lock.release()

    # a lock held for a run recorded on another host (crashed; a network filesystem):
    # refused, then taken over on request
    out = tmp_path / "b"
    holder = _holder(out, "other-host.example")
    try:
        with pytest.raises(_runlock.RunLockedError, match="on host other-host.example"):
            _runlock.RunLock(out).acquire()
        lock = _runlock.RunLock(out).acquire(take_over=True)
        try:
            assert lock.holder()["pid"] == os.getpid()
            with pytest.raises(_runlock.RunLockedError, match=f"pid {os.getpid()}"):
                _runlock.RunLock(out).acquire()  # and it is really held
        finally:
            lock.release()
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------- restarts
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _start(["train", *TINY, "--ckpt-every", "3", "--out", str(out)])
    text = _finish(proc)
    assert proc.returncode == 0, text[-4000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def _kill_a_rank_and_finish(tmp_path: Path, want: list[float], seed: int) -> None:
    rng = random.Random(seed)
    at_step = rng.randrange(1, STEPS - 2)
    out = tmp_path / f"restarts{seed}"
    proc = _start(["train", *TINY, "--ckpt-every", "3", "--max-restarts", "2",
                   "--out", str(out)])
    _wait_for(lambda: len(_metrics(out)) >= at_step, proc, f"step {at_step}")
    ranks = _ranks_of(proc.pid, "sbpflow.apps.train")
    assert len(ranks) == 2, ranks
    victim = rng.choice(ranks)
    latest = out / "ckpt" / "LATEST"
    ckpt_step = int(latest.read_text().strip()[1:]) if latest.exists() else 0
    os.kill(victim, signal.SIGKILL)
    text = _finish(proc)
    info = f"rank pid {victim} killed after step {at_step} (checkpoint {ckpt_step})"
    assert proc.returncode == 0, f"{info}\n{text[-4000:]}"
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), info
    got = [r["loss"] for r in rows]
    bad = [(i + 1, g, w) for i, (g, w) in enumerate(zip(got, want))
           if abs(g - w) > 1e-6 * abs(w)]
    assert not bad, f"{info}: steps whose loss differs (step, got, want): {bad}"
    banners = [line for line in text.splitlines() if line.startswith("sbpflow train gpt-mini:")]
    assert len(banners) == 2, f"{info}: expected one restart:\n{text[-4000:]}"
    # the restart resumed from a checkpoint at or after the one that existed at the kill
    resumed_from = int(banners[1].split("steps ")[1].split("->")[0])
    assert resumed_from >= ckpt_step and resumed_from % 3 == 0, (info, banners)
    assert not (out / ".lock").exists()


def test_max_restarts_resume_after_a_rank_is_killed(tmp_path, uninterrupted):
    _kill_a_rank_and_finish(tmp_path, uninterrupted, seed=random.randrange(1 << 30))


@pytest.mark.exhaustive
@pytest.mark.parametrize("run", range(5))
def test_max_restarts_fault_injection_5_runs(tmp_path, uninterrupted, run):
    _kill_a_rank_and_finish(tmp_path, uninterrupted, seed=1000 + run)
