"""Random ops on global tensors: dropout bit for bit with one-process torch under every
layout. (Sampling and random creation: test_creation.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import S0, S1

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


def _dropout_bit_exact(world_layouts):
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(7, 5)
    for layout in world_layouts:
        sbpflow.manual_seed(11)
        x = sbpflow.tensor(xv, placement=pl, sbp=layout, requires_grad=True)
        y = sbpflow.ops.dropout(x, p=0.3)
        y.backward(sbpflow.ones(7, 5, placement=pl, sbp=y.sbp))
        xr = xv.clone().requires_grad_(True)
        torch.manual_seed(11)
        yr = torch.nn.functional.dropout(xr, 0.3, True)
        yr.sum().backward()
        assert y.sbp == (layout,)
        assert np.array_equal(y.numpy(), yr.detach().numpy()), layout  # bit for bit
        assert np.array_equal(x.grad.numpy(), xr.grad.numpy()), layout
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dropout_layout_invariant_bit_exact(dist_run, world):
    dist_run(world, _dropout_bit_exact, [S0, S1, B, P])


def test_dropout_local_and_errors():
    torch.manual_seed(2)
    a = sbpflow.ops.dropout(sbpflow.ones(4, 4), 0.5).to_torch()
    torch.manual_seed(2)
    assert torch.equal(a, torch.nn.functional.dropout(torch.ones(4, 4), 0.5, True))
    x = sbpflow.ones(3)
    assert sbpflow.ops.dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match="between 0 and 1"):
        sbpflow.ops.dropout(x, 1.5)
