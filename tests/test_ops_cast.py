"""Casts (sbpflow/ops/cast): to, float/double/half/long..., type, type_as.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import pytest
import torch
from _oracle import ints

import sbpflow


def _cast_to(a, i):
    return (a * 4).to(i) + i + (a * 4).type_as(i) + (a * 4).to(torch.int32).long()


CASES = {
    # Local mode bit for bit.
    **oracle.policy({
        "cast_double": (lambda a: a.double() * a.to(torch.float64) + a.type(torch.float64)
                        + a.to(dtype=torch.float64, copy=True), [(7, 5)]),
        "cast_half": (lambda a: a.half().float() + a.bfloat16().float() * 2 + a.float(), [(7, 5)],
                      {"rtol": 1e-2, "atol": 3e-2}),
        "cast_int": (lambda a: (a * 4).long() + (a > 0).int() + (a * 2).int() + a.bool().long()
                     + (a * 3).type("torch.LongTensor"), [(7, 5)]),
        "cast_to_other": (_cast_to, [(7, 5), ints((5,), 9)]),
    }, local="exact"),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def test_cast_local_and_to():
    x = sbpflow.tensor([[1.5, -2.5]])
    assert x.to(torch.float32) is x and x.to("cpu") is x
    assert x.to(torch.float64).dtype == torch.float64
    assert x.to("cpu", torch.int64).dtype == torch.int64
    assert x.to(sbpflow.ones(1, dtype=torch.int32)).dtype == torch.int32
    assert x.type() == "torch.FloatTensor" and x.type("torch.DoubleTensor").dtype == torch.float64
    assert x.to(torch.float32, copy=True) is not x
    with pytest.raises(TypeError, match="unexpected argument"):
        x.to([1])
