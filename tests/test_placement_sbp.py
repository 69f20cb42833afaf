"""Placement, SBP values and the shard function, in one process."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.placement import shard_shape, shard_slices, split_sizes
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import dual, normalize_nd_sbp, split
from sbpflow.sbp import partial_sum as P

S0, S1 = split(0), split(1)


def test_sbp_values_and_reprs():
    assert repr(S0) == "S(0)" and repr(B) == "B" and repr(P) == "P"
    assert split(1) == S1 and hash(split(1)) == hash(S1) and S0 != S1
    assert sbpflow.sbp.broadcast is B and sbpflow.sbp.partial_sum is P
    assert dual(S1) == S1 and dual(B) == P and dual(P) == B
    with pytest.raises(TypeError, match="int"):
        split(1.0)
    with pytest.raises(AttributeError):
        S0.dim = 1  # frozen


def test_normalize_nd_sbp_errors_name_values():
    assert normalize_nd_sbp(split(-1), 1, 3) == (split(2),)
    with pytest.raises(ValueError, match=r"S\(2\) splits dim 2, but the tensor has 2 dims"):
        normalize_nd_sbp(split(2), 1, 2)
    with pytest.raises(ValueError, match="has 1 entries but the placement's mesh has 2 axes"):
        normalize_nd_sbp(S0, 2, 2)
    with pytest.raises(TypeError, match="sbpflow.sbp values"):
        normalize_nd_sbp(["S0"], 1, 2)


@pytest.mark.parametrize("size,n,want", [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]),
                                         (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0])])
def test_split_sizes(size, n, want):
    assert split_sizes(size, n) == want


# (global shape, mesh shape, nd-SBP) -> each coordinate's slices, written out by hand.
SHARD_TABLE = [
    ((10,), (4,), (S0,), {(0,): [(0, 3)], (1,): [(3, 6)], (2,): [(6, 8)], (3,): [(8, 10)]}),
    ((7, 5), (2,), (S1,), {(0,): [(0, 7), (0, 3)], (1,): [(0, 7), (3, 5)]}),
    ((7, 5), (2,), (B,), {(0,): [(0, 7), (0, 5)], (1,): [(0, 7), (0, 5)]}),
    ((7, 5), (2,), (P,), {(0,): [(0, 7), (0, 5)], (1,): [(0, 7), (0, 5)]}),
    # ARCHITECTURE's example: dim 6 under (S(0), S(0)) on 2x2 -> 2, 1, 2, 1.
    ((6,), (2, 2), (S0, S0), {(0, 0): [(0, 2)], (0, 1): [(2, 3)], (1, 0): [(3, 5)],
                              (1, 1): [(5, 6)]}),
    ((7, 5), (2, 2), (S0, S1), {(0, 0): [(0, 4), (0, 3)], (0, 1): [(0, 4), (3, 5)],
                                (1, 0): [(4, 7), (0, 3)], (1, 1): [(4, 7), (3, 5)]}),
    ((7, 5), (2, 2), (B, S0), {(0, 0): [(0, 4), (0, 5)], (1, 1): [(4, 7), (0, 5)]}),
]


@pytest.mark.parametrize("shape,mesh,nd,table", SHARD_TABLE)
def test_shard_slices_table(shape, mesh, nd, table):
    for coord, ranges in table.items():
        got = [(s.start, s.stop) for s in shard_slices(shape, mesh, nd, coord)]
        assert got == ranges, (coord, got)
        assert shard_shape(shape, mesh, nd, coord) == tuple(b - a for a, b in ranges)


def test_shards_tile_the_tensor_exactly_once():
    full = torch.arange(7 * 5).reshape(7, 5)
    for nd in [(S0, S1), (S1, S0), (S0, S0), (S1, S1)]:
        seen = torch.zeros_like(full)
        for coord in np.ndindex(2, 2):
            seen[shard_slices((7, 5), (2, 2), nd, coord)] += 1
        assert torch.equal(seen, torch.ones_like(full)), nd


def test_outside_rank_holds_empty_shard():
    assert shard_shape((7, 5), (2,), (S0,), None) == (0, 0)
    assert shard_shape((), (2,), (B,), None) == (0,)


def test_placement_value_semantics():
    a = sbpflow.placement("cpu", [0])
    assert a == sbpflow.placement("cpu", [0]) and hash(a) == hash(sbpflow.placement("cpu", 0))
    assert a != sbpflow.placement("cuda", [0])
    assert repr(a) == "placement(type='cpu', ranks=[0])"
    assert a.shape == (1,) and a.type == "cpu" and a.ranks.tolist() == [0]
    assert sbpflow.placement.all("cpu") == a
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.foo = 1
    with pytest.raises(ValueError):
        a.ranks[0] = 3  # the ranks array is read-only


def test_placement_errors_name_the_problem():
    with pytest.raises(ValueError, match="outside the world of 1"):
        sbpflow.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match="repeat rank"):
        sbpflow.placement("cpu", [0, 0])
    with pytest.raises(ValueError, match="ragged"):
        sbpflow.placement("cpu", [[0, 1], [2]])
    with pytest.raises(ValueError, match="type must be one of"):
        sbpflow.placement("tpu", [0])
    with pytest.raises(TypeError, match="ints"):
        sbpflow.placement("cpu", ["0"])
    with pytest.raises(ValueError, match="empty"):
        sbpflow.placement("cpu", [])


def test_mesh_axes():
    # Pure mesh arithmetic on a placement-like array (no world needed).
    pl = object.__new__(sbpflow.placement)
    arr = np.array([[0, 1], [2, 3]])
    object.__setattr__(pl, "_type", "cpu")
    object.__setattr__(pl, "_ranks", arr)
    object.__setattr__(pl, "_key", ("cpu", (2, 2), (0, 1, 2, 3)))
    assert pl.axis_groups(0) == [(0, 2), (1, 3)]
    assert pl.axis_groups(1) == [(0, 1), (2, 3)]
    assert pl.axis_ranks(0, (0, 1)) == (1, 3) and pl.coord(2) == (1, 0)
