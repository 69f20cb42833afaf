"""Scans (sbpflow/ops/scan): cumsum, cumprod, cummax, cummin, logcumsumexp, diff.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import torch
from _oracle import S0, Input, _floats, _ints_p, _with_zeros, lib

from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


def _bools(shape, p=0.5):
    return Input(lambda g: torch.rand(shape, generator=g) < p, grad=False)


CASES = {
    "cumsum_0": (lambda a: a.cumsum(0), [(7, 5)]),
    "cumsum_1": (lambda a: a.cumsum(dim=1), [(7, 5)]),
    "cumsum_3d": (lambda a: lib(a).cumsum(a, -2) * 2, [(3, 7, 5)]),
    "cumsum_dtype": (lambda a: a.cumsum(0, dtype=torch.float64), [(7, 5)]),
    "cumsum_int": (lambda a: a.cumsum(0), [_ints_p((7, 5), 10, -10)]),
    "cumsum_bool": (lambda a: a.cumsum(1), [_bools((7, 5))]),
    # Local mode: every output's values. Exhaustive 2x2: all combinations up to
    # 36, else a covering set.
    **oracle.policy({
        "cumsum_inplace": (lambda a: (a * 1).cumsum_(0), [(7, 5)]),
        "cumprod_0": (lambda a: a.cumprod(0), [_with_zeros((7, 5))]),
        "cumprod_1": (lambda a: a.cumprod(dim=-1), [_with_zeros((7, 5), 0.2)]),
        "cummax_0": (lambda a: a.cummax(0), [(7, 5)]),
        "cummin_1": (lambda a: lib(a).cummin(a, 1), [(7, 5)]),
        "logcumsumexp_0": (lambda a: a.logcumsumexp(0), [(7, 5)]),
        "diff_prepend": (lambda a, p: a.diff(2, 0, prepend=p), [(7, 5), _floats((2, 5), (B, P))]),
        "diff_append": (lambda a, q: lib(a).diff(a, dim=1, append=q),
                        [(7, 5), _floats((7, 1), (S0, B))]),
    }, full_2x2_max=36, local="values"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


# Both mesh axes splitting the reduced dim, or each axis another reduced dim.
HIERARCHICAL = [
    "cumsum_0", "cumsum_int",
]


def test_2x2_hierarchical_splits(dist_run):
    results = dist_run(4, oracle.run_sweep, __name__, "2x2_hierarchical", HIERARCHICAL)
    assert results[0] == [], "\n".join(results[0])
