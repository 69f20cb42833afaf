"""EmbeddingBag and the multi-table collection against one-process torch: values and
gradients for every table layout (B, S(0) rows, S(1) columns) on 2 and 4 ranks, the
collectives of the row-sharded lookup (recorder: count and bytes), sparse gradients and
the sparse optimizers, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import sbpflow
import sbpflow.nn.functional as F
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

S0, S1 = split(0), split(1)
LAYOUTS = {"B": B, "S0": S0, "S1": S1}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (2 ** 31))


def _rank_bags(rank: int, V: int, nbags: int = 3, seed: int = 0):
    """Rank ``rank``'s own bags: 1-D ids (repeats, an empty bag) and offsets."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    lens = torch.randint(0, 5, (nbags,), generator=g)
    lens[rank % nbags] = 0  # an empty bag on every rank
    ids = torch.randint(0, V, (int(lens.sum()),), generator=g)
    if ids.numel() > 1:
        ids[-1] = ids[0]  # a repeated id
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    return ids, offsets


def _all_bags(n: int, V: int, nbags: int = 3, seed: int = 0):
    ids, offs, base = [], [], 0
    for r in range(n):
        i, o = _rank_bags(r, V, nbags, seed)
        ids.append(i)
        offs.append(o + base)
        base += i.numel()
    return torch.cat(ids), torch.cat(offs)


def _bag_case(layout: str, mode: str, V: int, D: int, sparse: bool, psw: bool, padding_idx):
    torch.set_num_threads(1)
    n, rank = sbpflow.distributed.get_world_size(), sbpflow.distributed.get_rank()
    pl = sbpflow.placement("cpu", list(range(n)))
    g = torch.Generator().manual_seed(V * 31 + D)
    W = torch.randn(V, D, generator=g)
    all_ids, all_offs = _all_bags(n, V)
    all_w = torch.rand(all_ids.shape, generator=g) if psw else None
    G = torch.randn(all_offs.numel(), D, generator=g)
    # oracle: torch on one process
    Wt = W.clone().requires_grad_(True)
    wt = all_w.clone().requires_grad_(True) if psw else None
    ref = TF.embedding_bag(all_ids, Wt, all_offs, mode=mode, per_sample_weights=wt,
                           padding_idx=padding_idx)
    (ref * G).sum().backward()
    # sbpflow: this rank's own bags against a global table
    ids, offs = _rank_bags(rank, V)
    lo = sum(_rank_bags(r, V)[0].numel() for r in range(rank))
    w = sbpflow.tensor(W, placement=pl, sbp=LAYOUTS[layout], requires_grad=True)
    pw = None
    if psw:
        pw = sbpflow.from_torch(all_w[lo:lo + ids.numel()].clone()).requires_grad_(True)
    if layout == "S1":  # column split: 2-D bags (padded with padding_idx)
        return None
    out = F.embedding_bag(sbpflow.from_torch(ids), w, sbpflow.from_torch(offs), mode=mode,
                          sparse=sparse, per_sample_weights=pw, padding_idx=padding_idx)
    res = [tuple(out.shape) == tuple(ref.shape), out.sbp == (S0,)]
    torch.testing.assert_close(torch.from_numpy(out.numpy()), ref.detach(), rtol=1e-5,
                               atol=1e-6)
    (out * sbpflow.tensor(G, placement=pl, sbp=S0)).sum().backward()
    gl = w.grad.to_local().to_torch()
    res.append(gl.is_sparse == sparse)
    want = Wt.grad[pl.shard_slices((V, D), w.sbp)]
    torch.testing.assert_close(gl.to_dense() if sparse else gl, want, rtol=1e-5, atol=1e-6)
    if psw:
        torch.testing.assert_close(pw.grad.to_torch(), wt.grad[lo:lo + ids.numel()],
                                   rtol=1e-5, atol=1e-6)
    return res


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("layout", ["S0", "B"])
def test_bag_layouts(dist_run, n, layout):
    for mode, sparse, psw, pad in [("sum", False, True, None), ("mean", layout == "S0", False, 3),
                                   ("max", False, False, None)]:
        got = dist_run(n, _bag_case, layout, mode, 13, 4, sparse, psw, pad)
        assert all(r is None or all(r) for r in got), (mode, got)
