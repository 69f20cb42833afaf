"""DistributedDataParallel over local tensors: parameters broadcast from rank 0, gradients
averaged in bucketed async all-reduces, no_sync accumulation; equals torch on the whole
batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.distributed import CommRecorder


class _Net(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(sbpflow.tensor(torch.randn(6, 8, generator=g)))
        self.w2 = nn.Parameter(sbpflow.tensor(torch.randn(8, 3, generator=g)))

    def forward(self, x):
        return ((x @ self.w1).tanh() @ self.w2).square().mean()


def _ddp(steps, accumulate):
    rank, world = sbpflow.distributed.get_rank(), sbpflow.distributed.get_world_size()
    model = nn.parallel.DistributedDataParallel(_Net(seed=rank))  # rank 0's weights win
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.1)
    ref = _Net(seed=0)
    ropt = sbpflow.optim.SGD(ref.parameters(), lr=0.1)
    data = torch.randn(steps, accumulate, world * 4, 6, generator=torch.Generator().manual_seed(9))
    counts = []
    for s in range(steps):
        opt.zero_grad()
        ropt.zero_grad()
        for a in range(accumulate):
            x = sbpflow.tensor(data[s, a, rank * 4:(rank + 1) * 4])
            with CommRecorder() as rec:
                if a < accumulate - 1:
                    with model.no_sync():
                        model(x).backward()
                else:
                    model(x).backward()
            counts.append(rec.count("all_reduce"))
            ref(sbpflow.tensor(data[s, a])).backward()  # the whole batch on one process
        opt.step()
        ropt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)
    return counts


@pytest.mark.parametrize("world,accumulate", [(2, 1), (4, 3)])
def test_ddp_matches_one_process(dist_run, world, accumulate):
    counts = dist_run(world, _ddp, 3, accumulate)[0]
    # One bucket all-reduce per optimizer step, none inside no_sync.
    assert counts == ([0] * (accumulate - 1) + [1]) * 3, counts


def _ddp_rejects_global():
    pl = sbpflow.placement.all("cpu")
    net = _Net(0).to_global(pl)
    with pytest.raises(ValueError, match="wraps local parameters"):
        nn.parallel.DistributedDataParallel(net)
    return "ok"


def test_ddp_rejects_global(dist_run):
    dist_run(2, _ddp_rejects_global)
