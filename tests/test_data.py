"""sbpflow.utils.data: batches as sbpflow tensors; with placement=, each rank loads only
its part and the global batch equals what one process loads (same seed), uneven too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split
from sbpflow.utils import data


def _dataset():
    x = torch.arange(23 * 3, dtype=torch.float32).reshape(23, 3)
    return data.TensorDataset(x, torch.arange(23))


def _one_process_batches(batch_size, drop_last):
    torch.manual_seed(4)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=batch_size, shuffle=True,
                                         drop_last=drop_last)
    return [(x.numpy(), y.numpy()) for x, y in loader]


def _global_batches(mesh, sbp, batch_size, drop_last):
    pl = sbpflow.placement("cpu", mesh)
    sbpflow.manual_seed(4)
    loader = data.DataLoader(_dataset(), batch_size=batch_size, shuffle=True,
                             drop_last=drop_last, placement=pl, sbp=sbp)
    out = []
    for x, y in loader:
        assert x.is_global and x.sbp == tuple(sbp if isinstance(sbp, tuple) else (sbp,))
        out.append((x.numpy(), y.numpy(), tuple(x.to_local().shape)))
    return out, len(loader)


@pytest.mark.parametrize("world,mesh,sbp", [(2, [0, 1], split(0)), (4, [0, 1, 2, 3], split(0)),
                                            (4, [[0, 1], [2, 3]], (split(0), B))])
@pytest.mark.parametrize("drop_last", [False, True])
def test_global_batch_equals_one_process(dist_run, world, mesh, sbp, drop_last):
    want = _one_process_batches(6, drop_last)
    results = dist_run(world, _global_batches, mesh, sbp, 6, drop_last)
    for got, n in results:
        assert n == len(want) == len(got)
        for (gx, gy, _), (wx, wy) in zip(got, want):
            assert np.array_equal(gx, wx) and np.array_equal(gy, wy)
    # Each rank loaded only its part (6 over 2 data-parallel groups: 3 each).
    parts = [r[0][0][2][0] for r in results]
    n_dp = 2 if isinstance(sbp, tuple) else world
    assert sum(parts) == 6 * world // n_dp


def test_local_loader_yields_sbpflow_tensors():
    loader = data.DataLoader(_dataset(), batch_size=5)
    x, y = next(iter(loader))
    assert isinstance(x, sbpflow.Tensor) and x.is_local and tuple(x.shape) == (5, 3)
    assert len(loader) == 5


def _errors():
    pl = sbpflow.placement.all("cpu")
    with pytest.raises(ValueError, match="batch_sampler"):
        data.DataLoader(_dataset(), batch_sampler=[[0]], placement=pl)
    with pytest.raises(ValueError, match="partial"):
        data.DataLoader(_dataset(), batch_size=2, placement=pl, sbp=sbpflow.sbp.partial_sum)
    return "ok"


def test_errors(dist_run):
    dist_run(2, _errors)
