"""Boxing on real gloo ranks: values and gradients against a one-process oracle,
the collectives that ran (recorder), and every rank's shard shape.

The oracle is plain torch: the global value is a seeded tensor every rank builds the
same way; a layout change must leave it unchanged, and the gradient of the source
tensor under ``y.backward(W)`` must be ``W``.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1 = split(0), split(1)
SBPS_1D = [S0, S1, B, P]
SBPS_2D = list(itertools.product(SBPS_1D, SBPS_1D))

# ARCHITECTURE "Boxing": the one collective each 1-D transition runs (None: no comm).
EXPECTED_1D = {
    ("P", "B"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "B"): "all_gather",
    ("S", "S"): "all_to_all",
    ("B", "S"): None,
    ("B", "P"): None,
    ("S", "P"): None,
}


def _k(s) -> str:
    return "S" if s.is_split() else "B" if s.is_broadcast() else "P"


def _seeded(shape, dtype, *key) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype, key)).encode()))
    value = (torch.randn(shape, generator=g) * 10).to(dtype)
    weight = torch.randn(shape, generator=g)
    return value, weight


def _check_pair(pl, src, dst, shape, dtype) -> list[str]:
    """Box a seeded tensor src -> dst on ``pl``; check value, shard shape and gradient."""
    full, weight = _seeded(shape, dtype, src, dst)
    floating = dtype.is_floating_point
    x = sbpflow.tensor(full, placement=pl, sbp=src, requires_grad=floating)
    with CommRecorder() as rec:
        y = x.to_global(sbp=dst)
    local = y.to_local().to_torch()
    want_shape = pl.shard_shape(shape, y.sbp)
    assert tuple(local.shape) == want_shape, (
        f"{src}->{dst}: rank {sbpflow.distributed.get_rank()} holds {tuple(local.shape)}, "
        f"shard function says {want_shape}")
    if all(not s.is_partial() for s in y.sbp):
        # No partial axis: the shard is exactly the oracle's slice.
        torch.testing.assert_close(local, full[pl.shard_slices(shape, y.sbp)], rtol=0, atol=0)
    np.testing.assert_allclose(y.numpy(), full.numpy(), rtol=1e-6, atol=1e-5,
                               err_msg=f"{src}->{dst} value")
    if floating:
        y.backward(sbpflow.tensor(weight, placement=pl, sbp=dst))
        assert x.grad.sbp == x.sbp
        assert tuple(x.grad.to_local().shape) == pl.shard_shape(shape, x.sbp)
        np.testing.assert_allclose(x.grad.numpy(), weight.numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=f"{src}->{dst} gradient")
    return rec.kinds()


def _sweep_1d(shapes, dtypes):
    pl = sbpflow.placement.all("cpu")
    n = pl.size
    for src, dst in itertools.product(SBPS_1D, SBPS_1D):
        for shape, dtype in itertools.product(shapes, dtypes):
            kinds = _check_pair(pl, (src,), (dst,), shape, dtype)
            want = [] if src == dst else [EXPECTED_1D[(_k(src), _k(dst))]]
            want = [k for k in want if k is not None]
            assert kinds == (want if n > 1 else []), f"{src}->{dst} on {n} ranks ran {kinds}"
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_1d_pair_values_grads_and_collectives(dist_run, world):
    dist_run(world, _sweep_1d, [(8, 4), (7, 5)], [torch.float32, torch.int64])


def _sweep_2d(shapes, dtypes, srcs):
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    for src, dst, shape, dtype in itertools.product(srcs, SBPS_2D, shapes, dtypes):
        _check_pair(pl, src, dst, shape, dtype)
    return "ok"


@pytest.mark.parametrize("src", SBPS_2D, ids=lambda s: f"{s[0]!r}{s[1]!r}")
def test_every_2d_pair_uneven(dist_run, src):
    dist_run(4, _sweep_2d, [(7, 5)], [torch.float32], [src])


@pytest.mark.exhaustive
@pytest.mark.parametrize("src", SBPS_2D, ids=lambda s: f"{s[0]!r}{s[1]!r}")
def test_every_2d_pair_exhaustive(dist_run, src):
    dist_run(4, _sweep_2d, [(8, 4), (7, 5), (3, 2)], [torch.float32, torch.int64], [src])


def _single_axis_changes_run_one_collective():
    # On a 2x2 mesh, changing one axis (when no inner axis splits the same dim) runs
    # exactly that axis's 1-D collective, over that axis's groups.
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    me = sbpflow.distributed.get_rank()
    cases = [((P, S1), (B, S1), 0, "all_reduce"), ((S1, P), (S1, B), 1, "all_reduce"),
             ((S0, B), (B, B), 0, "all_gather"), ((B, S1), (B, S0), 1, "all_to_all"),
             ((P, B), (S1, B), 0, "reduce_scatter")]
    for src, dst, axis, kind in cases:
        kinds = _check_pair(pl, src, dst, (6, 5), torch.float32)
        assert kinds == [kind], (src, dst, kinds)
        x = sbpflow.zeros(6, 5, placement=pl, sbp=src)
        with CommRecorder() as rec:
            x.to_global(sbp=dst)
        (r,) = rec.records
        assert r.axis == axis and me in r.ranks and len(r.ranks) == 2
        assert set(r.ranks) == set(pl.axis_ranks(axis, pl.coord()))
    return "ok"


def test_2d_single_axis_changes(dist_run):
    dist_run(4, _single_axis_changes_run_one_collective)


def _bytes_recorded():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.ones(8, 6, placement=pl, sbp=P)
    with CommRecorder() as rec:
        x.to_global(sbp=B)
        x.to_global(sbp=S0)
        sbpflow.ones(8, 6, placement=pl, sbp=S0).to_global(sbp=B)
    ar, rs, ag = rec.records
    assert (ar.kind, ar.bytes, ar.dtype) == ("all_reduce", 8 * 6 * 4, torch.float32)
    assert (rs.kind, rs.bytes) == ("reduce_scatter", 8 * 6 * 4)
    assert (ag.kind, ag.bytes) == ("all_gather", 4 * 6 * 4)
    assert ar.ranks == (0, 1) and ar.axis == 0
    return "ok"


def test_recorder_logs_kind_axis_group_bytes(dist_run):
    dist_run(2, _bytes_recorded)


def _permuted_placement():
    # Mesh coordinate order differs from rank order: shards follow coordinates.
    pl = sbpflow.placement("cpu", [3, 1, 0, 2])
    for src, dst in itertools.product(SBPS_1D, SBPS_1D):
        _check_pair(pl, (src,), (dst,), (7, 5), torch.float32)
    x = sbpflow.tensor(torch.arange(8.0), placement=pl, sbp=S0)
    want = {3: [0.0, 1.0], 1: [2.0, 3.0], 0: [4.0, 5.0], 2: [6.0, 7.0]}
    assert x.to_local().to_torch().tolist() == want[sbpflow.distributed.get_rank()]
    return "ok"


def test_permuted_placement(dist_run):
    dist_run(4, _permuted_placement)


def _cross_placement(case):
    a = sbpflow.placement("cpu", [0, 1])
    b = sbpflow.placement("cpu", [2, 3])
    everyone = sbpflow.placement.all("cpu")
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    three = sbpflow.placement("cpu", [3, 1, 2])
    pairs = {"disjoint": (a, b), "disjoint-back": (b, a), "superset": (a, everyone),
             "subset": (everyone, a), "to-mesh": (a, mesh), "mesh-to-3": (mesh, three),
             "3-to-pair": (three, a), "same-ranks-reordered": (a, sbpflow.placement("cpu", [1, 0]))}
    p1, p2 = pairs[case]
    for s1, s2 in itertools.product(SBPS_1D, SBPS_1D):
        full, weight = _seeded((7, 5), torch.float32, case, s1, s2)
        x = sbpflow.tensor(full, placement=p1, sbp=[s1] * p1.ndim, requires_grad=True)
        y = x.to_global(p2, [s2] * p2.ndim)
        assert y.placement == p2
        assert tuple(y.to_local().shape) == p2.shard_shape((7, 5), y.sbp)
        np.testing.assert_allclose(y.numpy(), full.numpy(), rtol=1e-6, atol=1e-6)
        y.backward(sbpflow.tensor(weight, placement=p2, sbp=[s2] * p2.ndim))
        assert tuple(x.grad.to_local().shape) == p1.shard_shape((7, 5), x.sbp)
        np.testing.assert_allclose(x.grad.numpy(), weight.numpy(), rtol=1e-6, atol=1e-6)
    return "ok"


@pytest.mark.parametrize("case", ["disjoint", "disjoint-back", "superset", "subset", "to-mesh",
                                  "mesh-to-3", "3-to-pair", "same-ranks-reordered"])
def test_change_of_placement(dist_run, case):
    dist_run(4, _cross_placement, case)


def _disjoint_same_layout_is_point_to_point():
    a = sbpflow.placement("cpu", [0, 1])
    b = sbpflow.placement("cpu", [2, 3])
    x = sbpflow.ones(6, 4, placement=a, sbp=S0)
    with CommRecorder() as rec:
        x.to_global(b, S0)
    me = sbpflow.distributed.get_rank()
    # Rank i of the source sends its shard straight to rank i of the destination.
    assert rec.kinds() == ["send_recv"]
    assert rec.records[0].ranks == ((me + 2) % 4,)
    assert rec.records[0].bytes == (3 * 4 * 4 if me < 2 else 0)
    return "ok"


def test_disjoint_same_layout_is_point_to_point(dist_run):
    dist_run(4, _disjoint_same_layout_is_point_to_point)


def test_plans_are_cached_and_costed():
    from sbpflow.boxing import plan_boxing

    pl = sbpflow.placement("cpu", [0])
    p1 = plan_boxing((8, 4), torch.float32, pl, (P,), pl, (B,))
    assert plan_boxing((8, 4), torch.float32, pl, (P,), pl, (B,)) is p1
    assert [s.collective for s in p1.steps] == ["all_reduce"]
    assert p1.bytes == 0  # one rank: nothing moves


def test_nested_split_plans_route_through_valid_layouts():
    # Planning needs no ranks: a 2x2 mesh of a fake world is enough for the planner.
    from sbpflow.boxing.plan import _plan_same_placement

    class FakeMesh:
        shape = (2, 2)

    steps = _plan_same_placement((8, 8), 4, FakeMesh(), (S0, S1), (S1, S0), "gloo")
    assert len(steps) >= 2
    # No step may touch a dim that an inner mesh axis still splits.
    for st in steps:
        dims = {s.dim for s in (st.in_sbp[st.axis], st.out_sbp[st.axis]) if s.is_split()}
        assert not any(s.is_split() and s.dim in dims for s in st.in_sbp[st.axis + 1:])
    assert steps[0].in_sbp == (S0, S1) and steps[-1].out_sbp == (S1, S0)
    nccl = _plan_same_placement((8, 8), 4, FakeMesh(), (P, B), (S0, B), "nccl")
    assert [s.collective for s in nccl] == ["reduce_scatter"]


def test_device_type_change_is_a_local_move():
    # cpu -> cuda on the same ranks: box on the source, then each rank moves its own
    # shard (self pairs, no send/recv). Planned only: CI has no GPU.
    from sbpflow.boxing import plan_boxing

    cpu, gpu = sbpflow.placement("cpu", [0]), sbpflow.placement("cuda", [0])
    plan = plan_boxing((4, 4), torch.float32, cpu, (S0,), gpu, (B,), "nccl")
    assert [s.kind for s in plan.steps] == ["axis", "transfer"]
    assert plan.steps[-1].pairs == ((0, 0),) and plan.steps[-1].bytes == 0
    assert plan.steps[-1].dst_placement == gpu
