"""Ops whose output shape depends on the data (sbpflow/ops/data_dependent): masked_select,
nonzero, argwhere, unique, bincount, histc, repeat_interleave with tensor repeats.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import torch
from _oracle import S0, S1, Input, _nograd, _with_zeros, ints, lib

import sbpflow
from sbpflow.sbp import broadcast as B


def _bools(shape, layouts):
    return Input(lambda g: torch.rand(shape, generator=g) < 0.5, grad=False, layouts=layouts)


def _ri_tensor(a):
    return a.repeat_interleave(torch.tensor([1, 0, 2, 1, 3]), dim=1)


CASES = {
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "ri_tensor": (_ri_tensor, [(7, 5)]),
        "masked_select": (lambda a, m: a.masked_select(m), [(7, 5), _bools((7, 5), (S0, S1, B))]),
        "masked_select_bcast": (lambda a, m: lib(a).masked_select(a, m),
                                [(7, 5), _bools((5,), (B,))]),
        "nonzero": (lambda a: a.nonzero(), [_with_zeros((7, 5))]),
        "nonzero_tuple": (lambda a: lib(a).nonzero(a, as_tuple=True), [_with_zeros((7, 5))]),
        "argwhere": (lambda a: a.argwhere(), [_with_zeros((7, 5))]),
        "unique": (lambda a: a.unique(return_inverse=True, return_counts=True), [ints((7, 5), 4)]),
        "unique_dim": (lambda a: lib(a).unique(a, dim=0, return_counts=True), [ints((7, 3), 2)]),
        "bincount": (lambda a: a.bincount(minlength=3), [ints((13,), 6)]),
        "bincount_w": (lambda a, w: a.bincount(w), [ints((13,), 6), _nograd((13,))]),
        "histc": (lambda a: a.histc(6), [_nograd((7, 5))]),
        "histc_range": (lambda a: lib(a).histc(a, 4, -1, 1), [_nograd((7, 5))]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def _b_results():
    pl = sbpflow.placement.all("cpu")
    v = torch.randn(9, 4, generator=torch.Generator().manual_seed(2)) * \
        (torch.rand(9, 4, generator=torch.Generator().manual_seed(3)) > 0.4)
    x = sbpflow.tensor(v, placement=pl, sbp=S0)
    outs = {"nonzero": x.nonzero(), "masked": x.masked_select(x > 0),
            "unique": x.unique(), "bincount": (x != 0).long().sum(1).bincount(),
            "histc": x.histc(5), "tril": sbpflow.tril_indices(5, 4, -1, placement=pl, sbp=S1),
            "triu": sbpflow.triu_indices(4, 6, 1, placement=pl, sbp=B)}
    return {k: (o.sbp == (B,) * (k != "tril") or o.sbp == (S1,), o.numpy())
            for k, o in outs.items()}


def test_data_dependent_results_are_broadcast(dist_run):
    v = torch.randn(9, 4, generator=torch.Generator().manual_seed(2)) * \
        (torch.rand(9, 4, generator=torch.Generator().manual_seed(3)) > 0.4)
    ref = {"nonzero": v.nonzero(), "masked": v.masked_select(v > 0), "unique": v.unique(),
           "bincount": (v != 0).long().sum(1).bincount(), "histc": v.histc(5),
           "tril": torch.tril_indices(5, 4, -1), "triu": torch.triu_indices(4, 6, 1)}
    for r in dist_run(4, _b_results):
        for k, want in ref.items():
            ok, got = r[k]
            assert ok, k
            np.testing.assert_allclose(got, want.numpy(), err_msg=k)
