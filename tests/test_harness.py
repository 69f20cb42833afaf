"""Tests of the multi-rank harness itself (tests/_pool.py), with real rank processes."""

from __future__ import annotations

import os
import time

import pytest
from _pool import RankPool, run_isolated


def _whoami():
    import torch

    import sbpflow.distributed as sd

    return (sd.get_rank(), sd.get_world_size(), int(os.environ["LOCAL_RANK"]),
            torch.get_num_threads(), sd.check_mode())


def _sum_over_world(n):
    import torch

    import sbpflow.distributed as sd
    from sbpflow.distributed import _comm

    world = tuple(range(sd.get_world_size()))
    sd.ensure_groups([world])
    out = _comm.all_reduce(torch.full((n,), float(sd.get_rank() + 1)), world)
    return out.tolist()


def _pid():
    return os.getpid()


def _raise_on_rank_1():
    import sbpflow.distributed as sd

    if sd.get_rank() == 1:
        raise ValueError("boom from the body")
    return "fine"


def _sleep_on_rank_1(seconds):
    import sbpflow.distributed as sd

    if sd.get_rank() == 1:
        time.sleep(seconds)
    return "awake"


def _exit_on_rank_1():
    import sbpflow.distributed as sd

    if sd.get_rank() == 1:
        os._exit(7)
    return "alive"


class Point:
    """A return value whose class lives in this test module."""

    def __init__(self, x):
        self.x = x


def _make_point(x):
    import sbpflow.distributed as sd

    return Point(x + sd.get_rank())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_values_come_back_per_rank(dist_run, world):
    results = dist_run(world, _whoami)
    assert results == [(r, world, r, 1, "fast") for r in range(world)]


def test_collectives_run_across_ranks(dist_run):
    assert dist_run(4, _sum_over_world, 3) == [[10.0] * 3] * 4


def test_pool_is_reused(dist_run):
    first = dist_run(2, _pid)
    second = dist_run(2, _pid)
    assert first == second == dist_run.pool(2).pids()
    assert len(set(first)) == 2 and os.getpid() not in first


def test_values_of_test_module_classes_come_back(dist_run):
    points = dist_run(2, _make_point, 10)
    assert [type(p) for p in points] == [Point, Point]
    assert [p.x for p in points] == [10, 11]


def test_exception_names_the_rank(dist_run):
    pool = dist_run.pool(2)
    pids = pool.pids()
    with pytest.raises(AssertionError) as info:
        dist_run(2, _raise_on_rank_1)
    msg = str(info.value)
    assert "rank(s) [1] raised" in msg
    assert "--- rank 1 raised" in msg and "ValueError: boom from the body" in msg
    assert "--- rank 0 returned 'fine'" in msg
    # The pool was restarted: fresh processes that work.
    assert dist_run(2, _pid) != pids
    assert dist_run(2, _sleep_on_rank_1, 0) == ["awake", "awake"]


def test_hang_names_the_rank_and_pool_recovers(dist_run):
    dist_run(2, _pid)  # make sure the pool is up so the timeout measures the body only
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        dist_run(2, _sleep_on_rank_1, 60, timeout=2)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 15, elapsed
    assert "rank(s) [1] did not answer" in msg
    assert "--- rank 1: did not answer within the timeout of 2s" in msg
    assert "_sleep_on_rank_1" in msg  # rank 1's stack dump shows where it hung
    assert "--- rank 0 returned 'awake'" in msg
    assert dist_run(2, _sleep_on_rank_1, 0, timeout=60) == ["awake", "awake"]


def test_rank_exit_names_the_rank_and_pool_recovers(dist_run):
    with pytest.raises(AssertionError) as info:
        dist_run(2, _exit_on_rank_1)
    msg = str(info.value)
    assert "rank(s) [1] exited" in msg and "exited with code 7" in msg
    assert dist_run(2, _sleep_on_rank_1, 0) == ["awake"] * 2


def test_lambdas_are_refused(dist_run):
    with pytest.raises(TypeError, match="module-level function"):
        dist_run(1, lambda: 0)


def test_run_isolated_reports_each_rank():
    outcomes = run_isolated(2, _raise_on_rank_1, timeout=30)
    assert [o.rank for o in outcomes] == [0, 1]
    assert outcomes[0].status == "ok" and outcomes[0].value == "fine"
    assert outcomes[1].status == "raised" and outcomes[1].exc_type == "ValueError"
    assert isinstance(outcomes[1].exception, ValueError)
    assert "boom from the body" in outcomes[1].error
    assert all(o.exitcode == 0 for o in outcomes)


def test_close_leaves_no_processes():
    pool = RankPool(2)
    pids = pool.pids()
    assert pool.run(_sleep_on_rank_1, 0) == ["awake", "awake"]
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
