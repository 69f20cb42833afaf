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


# ------------------------------------------------------------------ coalesced broadcasts
def _broadcast_coalesced():
    from sbpflow.distributed import broadcast_coalesced

    r = sbpflow.distributed.get_rank()
    world = tuple(range(sbpflow.distributed.get_world_size()))
    # float32 tensors of 12, 8, 16 bytes around an int64 one; a 24-byte cap cuts the
    # float32 group into [a, b] and [c]; the int64 group is one bucket.
    ts = [torch.full((3,), r + 0.5), torch.full((2,), float(r)), torch.arange(2) + 10 * r,
          torch.full((2, 2), -r - 1.0)]
    want = [t.clone() if r == 0 else None for t in ts]
    with CommRecorder() as rec:
        n = broadcast_coalesced(ts, world, 0, bucket_bytes=24)
    assert n == 3 and rec.kinds() == ["broadcast"] * 3, rec
    assert [(x.bytes, x.dtype) for x in rec.records] == [
        (20, torch.float32), (16, torch.float32), (16, torch.int64)], rec
    assert ts[0].tolist() == [0.5] * 3 and ts[1].tolist() == [0.0] * 2
    assert ts[2].tolist() == [0, 1] and ts[3].tolist() == [[-1.0, -1.0]] * 2
    if r == 0:
        assert all(torch.equal(t, w) for t, w in zip(ts, want))
    with CommRecorder() as rec:  # the default cap: one broadcast per dtype
        assert broadcast_coalesced(ts, world, len(world) - 1) == 2
    assert rec.kinds() == ["broadcast"] * 2
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        broadcast_coalesced(ts, world, 0, bucket_bytes=0)
    return "ok"


def test_broadcast_coalesced_buckets_by_dtype_and_size(dist_run):
    dist_run(2, _broadcast_coalesced)


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn1 = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 4)
        self.bn2 = nn.BatchNorm1d(4, momentum=0.3)

    def forward(self, x):
        return self.bn2(self.lin(self.bn1(x))).square().mean()


def _ddp_buffers():
    """DDP's buffer broadcast before each training forward: rank 0's running statistics
    win, in 2 broadcasts (float statistics, int64 counts) for the 6 buffers."""
    rank = sbpflow.distributed.get_rank()
    sbpflow.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_BNNet())
    torch.manual_seed(0)
    ref = torch.nn.Module()  # rank 0's run on its own data, in plain torch
    ref.bn1, ref.lin, ref.bn2 = (torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 4),
                                 torch.nn.BatchNorm1d(4, momentum=0.3))
    ref.lin.load_state_dict({k: v.to_local().to_torch() for k, v in
                             model.module.lin.state_dict().items()})
    data = torch.randn(3, 2, 4, 3, generator=torch.Generator().manual_seed(1))
    counts = []
    for s in range(3):
        with CommRecorder() as rec:
            model(sbpflow.tensor(data[s, rank])).backward()
        counts.append((rec.count("broadcast"), rec.count("all_reduce")))
        ref.bn2(ref.lin(ref.bn1(data[s, 0])))
    # the buffers after the last forward are this rank's own: sync once more, as the
    # next forward would, then every rank holds rank 0's
    model._sync_buffers()
    for name, b in model.module.named_buffers():
        np.testing.assert_allclose(b.to_local().to_torch().numpy(),
                                   dict(ref.named_buffers())[name].numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    return counts


def test_ddp_broadcasts_buffers_coalesced(dist_run):
    counts = dist_run(2, _ddp_buffers)[0]
    assert counts == [(2, 1)] * 3, counts
