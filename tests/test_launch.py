"""Tests of ``sbpflow launch`` / ``python -m sbpflow.distributed.launch`` (torchrun wrapper).

The subprocess tests launch tests/launch_script.py, which all-reduces ``rank + 1`` and
prints ``rank=R world=W local_rank=L threads=T sum=S`` per rank. Every subprocess runs in
its own session and is killed (with its ranks) after a hard timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbpflow import cli
from sbpflow.distributed import launch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "launch_script.py")
LINE = re.compile(r"rank=(\d+) world=(\d+) local_rank=(\d+) threads=(\d+) sum=(\d+)")
TIMEOUT_S = 45.0

# Variables that would make the children think they are already part of a job.
_LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
          "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LEAKY and not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["SBPFLOW_TIMEOUT"] = "30"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _sbpflow() -> list[str]:
    """The ``sbpflow`` console script if installed (pip install -e .), else the module."""
    exe = shutil.which("sbpflow")
    return [exe] if exe else [sys.executable, "-m", "sbpflow.cli"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_all(procs: list[subprocess.Popen], timeout: float = TIMEOUT_S):
    """Wait for every process; kill all of them (and their ranks) past the deadline."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        dumps = [f"--- {p.args}\n" + "".join(x or "" for x in p.communicate()) for p in procs]
        pytest.fail(f"launch did not finish within {timeout:.0f}s:\n" + "\n".join(dumps))
    return results


def _run(cmd: list[str], env: dict[str, str] | None = None):
    return _wait_all([_start(cmd, env)])[0]


def _ranks(out: str) -> list[dict[str, int]]:
    keys = ("rank", "world", "local_rank", "threads", "sum")
    return [dict(zip(keys, map(int, m))) for m in LINE.findall(out)]


def _check_job(rc: int, out: str, err: str, world: int, threads: int) -> list[dict[str, int]]:
    assert rc == 0, f"exit code {rc}\nstdout:\n{out}\nstderr:\n{err}"
    ranks = _ranks(out)
    assert sorted(r["rank"] for r in ranks) == list(range(world)), out
    for r in ranks:
        assert r["world"] == world, out
        assert r["sum"] == world * (world + 1) // 2, out
        assert r["threads"] == threads, out
    return ranks


# --------------------------------------------------------------------------- one node


@pytest.mark.exhaustive  # about 20 s; the 2-rank launches run in the default suite
def test_sbpflow_launch_four_ranks_one_thread_each():
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "4", SCRIPT])
    ranks = _check_job(rc, out, err, world=4, threads=1)
    assert sorted(r["local_rank"] for r in ranks) == [0, 1, 2, 3]
    assert "Setting OMP_NUM_THREADS" not in err  # torchrun's warning is silenced


def test_python_m_launch_two_ranks():
    rc, out, err = _run([sys.executable, "-m", "sbpflow.distributed.launch",
                         "--nproc-per-node", "2", SCRIPT])
    _check_job(rc, out, err, world=2, threads=1)


def test_threads_per_rank_overrides_default_and_env():
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "2",
                         "--threads-per-rank", "2", SCRIPT], env=_env(OMP_NUM_THREADS="3"))
    _check_job(rc, out, err, world=2, threads=2)


def test_failing_rank_exit_code_is_the_jobs():
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "2", SCRIPT,
                         "--fail-rank", "1", "--exit-code", "3"])
    assert rc == 3, f"exit code {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert "FAILED" in err and "exitcode  : 3" in err, err


def test_a_reported_exit_adds_no_failure_report():
    """sbpflow's own commands (``launch.main(..., reported=True)``) whose rank exits with
    ``REPORTED_EXIT`` has said why itself: the job exits 1 with no torchrun report (a
    plain ``sbpflow launch`` keeps a script's exit code 3 and its report: the test
    above)."""
    code = ("import sys; from sbpflow.distributed import launch; "
            f"sys.exit(launch.main(['--nproc-per-node', '2', {SCRIPT!r}, '--fail-rank', '1', "
            "'--exit-code', sys.argv[1]], reported=True))")
    rc, out, err = _run([sys.executable, "-c", code, "3"], env=_env())
    assert rc == 1 and "FAILED" not in err and "exitcode" not in err, (rc, err)


@pytest.mark.exhaustive  # about 20 s; the suite checks the core install by its imports
def test_global_mlp_example_trains_on_two_ranks():
    """examples/global_mlp.py, what a `pip install -e .` without extras runs (README "On a
    new machine"): a tensor-parallel MLP whose loss falls below a quarter in 60 steps."""
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "2",
                         str(REPO / "examples" / "global_mlp.py")], env=_env())
    assert rc == 0, f"exit code {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert "world 2: layer 0 weight (S(0),), layer 2 weight (S(1),)" in out, out


@pytest.mark.exhaustive  # about 20 s
def test_auto_parallel_example_chooses_two_layouts(tmp_path):
    """examples/auto_parallel.py: the wide MLP gets its weights split, the tall one keeps
    them whole (data parallel); both losses fall. Priced on a calibration made in
    ``tmp_path`` (``$SBPFLOW_CACHE``): the user's cache is not touched."""
    env = dict(_env(), SBPFLOW_CACHE=str(tmp_path))
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "2",
                         str(REPO / "examples" / "auto_parallel.py")], env=env)
    assert rc == 0, f"exit code {rc}\nstdout:\n{out}\nstderr:\n{err}"
    wide, tall = out.split("tall MLP")
    assert "0.weight (S(" in wide and "2.weight (S(" in wide, out
    assert "0.weight (B,)" in tall and "| inputs x, y (batch 512) | S(0) |" in tall, out
    assert wide.count("auto-parallel plan of Step on mesh [2]") == 1


# --------------------------------------------------------------------------- two nodes


def _two_nodes(node_args: list[list[str]]):
    procs = [_start([*_sbpflow(), "launch", "--nnodes", "2", "--nproc-per-node", "2",
                     *args, SCRIPT]) for args in node_args]
    results = _wait_all(procs)
    local = []
    for rc, out, err in results:
        ranks = _ranks(out)
        assert rc == 0, f"exit code {rc}\nstdout:\n{out}\nstderr:\n{err}"
        assert sorted(r["local_rank"] for r in ranks) == [0, 1], out
        local.append(ranks)
    all_out = "".join(out for _, out, _ in results)
    _check_job(0, all_out, "", world=4, threads=1)
    return local


@pytest.mark.exhaustive  # about 20 s; the c10d two-node case runs in the default suite
def test_two_nodes_static_rendezvous():
    port = str(_free_port())
    nodes = _two_nodes([["--node-rank", str(k), "--master-addr", "127.0.0.1",
                         "--master-port", port] for k in (0, 1)])
    # static rendezvous: node k holds global ranks 2k, 2k+1
    for k, ranks in enumerate(nodes):
        assert sorted(r["rank"] for r in ranks) == [2 * k, 2 * k + 1]


def test_two_nodes_c10d_rendezvous():
    port = _free_port()
    common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"sbpflow-test-{port}"]
    _two_nodes([common, common])


# --------------------------------------------------------------------------- in process


def test_cli_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "launch" in capsys.readouterr().out


def test_cli_rejects_unknown_or_missing_command(capsys):
    for argv in (["nope"], []):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_launch_help_shows_torchrun_options_and_ours(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sbpflow launch")
    for opt in ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend",
                "--rdzv-endpoint", "--master-addr", "--master-port", "--standalone",
                "--threads-per-rank"):
        assert opt in out


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_threads_per_rank_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--threads-per-rank", value, "--nproc-per-node", "2", SCRIPT])
    assert e.value.code == 2
    assert "--threads-per-rank" in capsys.readouterr().err


def test_threads_per_rank_rule():
    rule = launch._threads_per_rank
    assert rule(None, 4, {}) == 1  # several ranks per node: one thread each
    assert rule(None, 1, {}) is None  # one rank: torch's default
    assert rule(None, 4, {"OMP_NUM_THREADS": "3"}) is None  # the user's setting stands
    assert rule(2, 4, {"OMP_NUM_THREADS": "3"}) == 2  # the flag wins
    assert rule(2, 1, {}) == 2


def test_zero_ranks_per_node_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["--nproc-per-node", "0", "script.py"])
    assert info.value.code == 2
    assert "need at least 1 rank per node" in capsys.readouterr().err


def test_missing_script_or_module_is_one_line_before_any_rank(capsys, tmp_path):
    """A fresh user's typo: one line naming the path, exit 2, no rank started (torchrun
    printed a 25-line failure report per rank)."""
    for argv, want in ((["--nproc-per-node", "2", str(tmp_path / "nope.py")], "no such file"),
                       (["--nproc-per-node", "2", "-m", "no_such_module_xyz"],
                        "no module named 'no_such_module_xyz'")):
        with pytest.raises(SystemExit) as info:
            launch.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and want in err and len(err.strip().splitlines()) == 1, err


# SBPFLOW_TIMEOUT values torch cannot use: NaN and inf (timedelta raises without naming the
# variable), 1e-9 (a timeout of 0 ms), zero and negative, too large, not a number
_BAD_TIMEOUTS = ["nan", "inf", "-inf", "1e-9", "0.0004", "0", "-5", "1e12", "ten"]


@pytest.mark.parametrize("value", _BAD_TIMEOUTS)
def test_bad_sbpflow_timeout_names_the_variable_value_and_fix(value, monkeypatch):
    from sbpflow.distributed import _state

    monkeypatch.setattr(_state._state, "initialized", False)  # a fresh process's state
    monkeypatch.setattr(_state._state, "config", _state._Config())
    for k in _LEAKY:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SBPFLOW_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"SBPFLOW_TIMEOUT='{re.escape(value)}'.*"
                                         rf"SBPFLOW_TIMEOUT=600 \(the default\)") as e:
        _state.init()
    if value != "ten":
        assert "0.001 (1 ms" in str(e.value)
    with pytest.raises(ValueError, match=r"timeout=nan: .*0\.001 \(1 ms"):
        _state.init(timeout=float("nan"))
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "0.001")  # the smallest accepted
    _state.init()
    assert _state._state.config.timeout_s == 0.001


def test_bad_sbpflow_timeout_fails_in_the_launcher_before_any_rank(monkeypatch, capsys):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "inf")
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc-per-node", "2", SCRIPT])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "SBPFLOW_TIMEOUT='inf'" in err and "SBPFLOW_TIMEOUT=600" in err, err


def test_uncaught_collective_error_exits_1_not_an_abort():
    script = str(REPO / "tests" / "mismatch_script.py")
    # (the teardown abort this guards against came in most runs)
    rc, out, err = _run([*_sbpflow(), "launch", "--nproc-per-node", "4", script],
                        env=_env(SBPFLOW_DEBUG="1", SBPFLOW_TIMEOUT="10"))
    assert rc == 1, f"exit code {rc}\nstderr:\n{err[-3000:]}"
    assert "CollectiveMismatchError" in err and "terminate called" not in err, err[-3000:]
