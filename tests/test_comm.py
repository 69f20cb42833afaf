"""sbpflow.comm: explicit collectives on local tensors, against values computed by hand."""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow import comm
from sbpflow.distributed import CommRecorder
from sbpflow.placement import split_sizes


def _collectives():
    r, n = sbpflow.distributed.get_rank(), sbpflow.distributed.get_world_size()
    x = torch.full((2, 3), float(r + 1))
    with CommRecorder() as rec:
        s = comm.all_reduce(x)
    assert rec.kinds() == ["all_reduce"] and torch.equal(x, torch.full((2, 3), float(r + 1)))
    assert s.to_torch().eq(n * (n + 1) / 2).all()
    g = comm.all_gather(torch.full((r + 1, 2), float(r)), dim=0)  # uneven rows
    assert g.to_torch()[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    rs = comm.reduce_scatter(torch.arange(7.0), dim=0)
    sizes = split_sizes(7, n)
    start = sum(sizes[:r])
    assert rs.to_torch().tolist() == [n * v for v in range(start, start + sizes[r])]
    # along dim 1: row-major results (a transposed view would carry its strides into the
    # ops after it: a matmul of two transposed operands ran 16x slower here)
    g1 = comm.all_gather(torch.full((3, 2), float(r)), dim=1).to_torch()
    assert g1.is_contiguous() and g1[0].tolist() == [float(k) for k in range(n) for _ in range(2)]
    rs1 = comm.reduce_scatter(torch.arange(3.0 * 2 * n).view(3, 2 * n), dim=1).to_torch()
    assert rs1.is_contiguous()
    assert torch.equal(rs1, n * torch.arange(3.0 * 2 * n).view(3, 2 * n)[:, 2 * r:2 * r + 2])
    b = comm.broadcast(torch.full((3,), float(r)), src=n - 1)
    assert b.to_torch().tolist() == [float(n - 1)] * 3
    a = comm.all_to_all(torch.arange(float(n)) + 10 * r)  # element k goes to rank k
    assert a.to_torch().tolist() == [10.0 * k + r for k in range(n)]
    peer = (r + 1) % n
    (got,) = comm.send_recv([(torch.full((2,), float(r)), peer)], [(torch.empty(2), (r - 1) % n)])
    assert got.to_torch().tolist() == [float((r - 1) % n)] * 2
    sub = comm.all_reduce(torch.ones(1), ranks=[0, 1])  # a subgroup; others get input back
    assert sub.item() == (2.0 if r < 2 else 1.0)
    with pytest.raises(TypeError, match="local tensors"):
        comm.all_reduce(sbpflow.ones(2, placement=sbpflow.placement.all("cpu"),
                                     sbp=sbpflow.sbp.broadcast))
    with pytest.raises(ValueError, match="distinct ranks"):
        comm.all_reduce(torch.ones(1), ranks=[0, 0])
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_comm_collectives(dist_run, world):
    dist_run(world, _collectives)


def _finished_works_are_freed_on_the_main_thread():
    # Regression: a gloo worker thread that dropped the last reference to a finished work
    # freed its tensors under the GIL while the interpreter was finalizing: SIGABRT
    # ("terminate called without an active exception") after a successful run.
    from sbpflow.distributed import _comm

    _comm.release_works(settle_s=0.0)
    for _ in range(12):
        comm.all_reduce(torch.ones(3))
    kept = list(_comm._recent_works)
    assert len(kept) == _comm._recent_works.maxlen and all(w.is_completed() for w in kept)
    _comm.release_works()
    assert not _comm._recent_works
    return "ok"


def test_finished_works_are_kept_until_released(dist_run):
    dist_run(2, _finished_works_are_freed_on_the_main_thread)


def _gloo_threads():
    import os

    import torch.distributed as dist

    from sbpflow.distributed import _state

    _state.ensure_groups([(0, 1)])
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    return world, os.environ.get("SBPFLOW_GLOO_THREADS")


def test_gloo_groups_run_one_worker_thread_unless_asked():
    """Issue 20: two gloo worker threads running one group's collectives at once corrupt
    the heap now and then in torch 2.13; sbpflow's groups run one (SBPFLOW_GLOO_THREADS
    asks for more)."""
    from _pool import run_isolated

    for env, want in (({}, 1), ({"SBPFLOW_GLOO_THREADS": "2"}, 2)):
        for o in run_isolated(2, _gloo_threads, env=env):
            assert o.status == "ok", o.describe()
            assert o.value[0] == want, (env, o.value)


def test_bad_gloo_threads_setting_names_the_variable(monkeypatch):
    from sbpflow.distributed import _state

    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("SBPFLOW_GLOO_THREADS", bad)
        with pytest.raises(ValueError, match="SBPFLOW_GLOO_THREADS"):
            _state._gloo_threads_setting()
    monkeypatch.delenv("SBPFLOW_GLOO_THREADS")
    assert _state._gloo_threads_setting() == 1
