"""Sorting ops (sbpflow/ops/sort): sort, argsort, topk, median, kthvalue, mode, quantile,
searchsorted, bucketize.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import torch
from _oracle import S0, S1, S2, Input, _nan_at, _nograd, lib

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B


def _sorted(shape, layouts):
    return Input(lambda g: torch.randn(shape, generator=g).sort(-1).values, grad=False,
                 layouts=layouts)


def _float_ints(shape, high=3):
    """Floats with many ties (mode), differentiable."""
    return Input(lambda g: torch.randint(0, high, shape, generator=g).float())


CASES = {
    "topk_dim1": (lambda a: a.topk(3, dim=1), [(5, 7)]),
    "topk_dim0_smallest": (lambda a: a.topk(4, dim=0, largest=False), [(7, 5)]),
    "sort": (lambda a: a.sort(dim=0, descending=True), [(7, 5)]),
    "sort_last": (lambda a: a.sort(), [(5, 7)]),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "median_all": (lambda a: a.median(), [(7, 5)]),
        "median_dim0": (lambda a: a.median(0), [(7, 5)]),
        "median_keep": (lambda a: lib(a).median(a, 1, keepdim=True), [(7, 5)]),
        "nanmedian": (lambda a: a.nanmedian(0), [_nan_at((7, 5))]),
        "nanmedian_all": (lambda a: a.nanmedian(), [_nan_at((7, 5))]),
        "kthvalue": (lambda a: a.kthvalue(3, 0), [(7, 5)]),
        "mode": (lambda a: a.mode(1), [_float_ints((7, 5))]),
        "quantile_dim": (lambda a: a.quantile(0.3, dim=1), [(7, 5)]),
        "quantile_qs": (lambda a, q: a.quantile(q, dim=0, keepdim=True),
                        [(7, 5), Input(lambda g: torch.tensor([0.1, 0.5, 0.9]), grad=False,
                                       layouts=(B,))]),
        "quantile_all": (lambda a: lib(a).quantile(a, 0.75, interpolation="midpoint"), [(7, 5)]),
        "nanquantile": (lambda a: a.nanquantile(0.4, dim=0, interpolation="nearest"),
                        [_nan_at((7, 5))]),
        "searchsorted": (lambda s, v: lib(v).searchsorted(s, v), [_sorted((6,), (B, S0)),
                                                                 _nograd((7, 5), (S0, S1, B))]),
        "searchsorted_nd": (lambda s, v: lib(v).searchsorted(s, v, right=True),
                            [_sorted((7, 4), (S0, S1, B)), _nograd((7, 3), (S0, S1, B))]),
        "bucketize": (lambda v, b: lib(v).bucketize(v, b, right=True),
                      [_nograd((7, 5), (S0, S1, B)), _sorted((6,), (B,))]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def _topk_split_dim_moves_only_candidates():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(4, 1000)
    x = sbpflow.tensor(xv, placement=pl, sbp=S1, requires_grad=True)
    with CommRecorder() as rec:
        v, i = x.topk(3, dim=1)
    # Values and indices of 3 candidates per row per shard; never the (4, 1000) input.
    assert rec.kinds() == ["all_gather", "all_gather"], rec.kinds()
    assert rec.total_bytes() == 4 * 3 * (4 + 8), rec.total_bytes()
    assert v.sbp == (B,) and i.sbp == (B,)
    rv, ri = xv.topk(3, dim=1)
    assert torch.equal(torch.from_numpy(v.numpy()), rv)
    assert torch.equal(torch.from_numpy(i.numpy()), ri)
    with CommRecorder() as rec:
        k = x.topk(2, dim=0)
    assert rec.kinds() == [] and k.values.sbp == (S1,)
    # Unsqueeze keeps the split, renumbered, without communication.
    with CommRecorder() as rec:
        u = x.unsqueeze(0)
    assert u.sbp == (S2,) and rec.kinds() == []
    return "ok"


def test_topk_split_dim_gathers_candidates_only(dist_run):
    dist_run(2, _topk_split_dim_moves_only_candidates)
    dist_run(4, _topk_split_dim_moves_only_candidates)
