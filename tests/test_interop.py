"""What a PyTorch user runs into: Python number protocols, numpy/torch operands,
torch functions called on sbpflow tensors (``__torch_function__``), in-place writes through
slices that are copies (they raise instead of silently not reaching the original), and
more of torch's API (its op compositions are cases of the family files)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split


def test_number_protocols_local():
    x = sbpflow.tensor([1.0, 2.0])
    assert bool(x.sum() > 0) and float(x.sum()) == 3.0 and int(x.sum()) == 3
    assert f"{x.sum():.2f}" == "3.00" and list(range(sbpflow.tensor(3))) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(x)
    with pytest.raises(TypeError, match="integer tensors"):
        range(x.sum())


def test_numpy_and_torch_operands_local():
    x = sbpflow.tensor([1.0, 2.0])
    for got, want in [(np.ones(2, np.float32) + x, torch.ones(2) + torch.tensor([1.0, 2.0])),
                      (x * torch.ones(2), torch.tensor([1.0, 2.0])),
                      (torch.ones(2) - x, torch.tensor([0.0, -1.0])),
                      (np.ones(2) // x, torch.tensor([1.0, 0.0], dtype=torch.float64))]:
        assert isinstance(got, sbpflow.Tensor) and torch.equal(got.to_torch(), want)


def test_torch_functions_route_to_sbpflow():
    xt = torch.randn(3, 4)
    x = sbpflow.tensor(xt)
    assert torch.allclose(torch.exp(x).to_torch(), xt.exp())
    assert torch.allclose(torch.nn.functional.softmax(x, -1).to_torch(), xt.softmax(-1))
    assert torch.allclose(torch.cat([x, torch.ones(1, 4)]).to_torch(),
                          torch.cat([xt, torch.ones(1, 4)]))
    with pytest.raises(TypeError, match="sbpflow has no op of that name"):
        torch.linalg.svd(x)


def _global_interop():
    pl = sbpflow.placement.all("cpu")
    a = torch.arange(20.0).reshape(4, 5)
    x = sbpflow.tensor(a, placement=pl, sbp=split(1))
    assert bool(x.sum() > 0) and float(x.sum()) == float(a.sum())  # collective
    with pytest.raises(TypeError, match="layout is unknown"):
        x + np.ones((4, 5))
    # A slice along the split dim is a copy: writing into it raises.
    with pytest.raises(ValueError, match="copy, not a view"):
        x[:, 1].add_(100)
    with pytest.raises(ValueError, match="copy, not a view"):
        x.view(20)[3] = -1
    y = x[:, 1].clone()
    y.add_(1)  # an explicit copy is fine
    # Where the slice is a real view, writes reach x as in torch.
    z = sbpflow.tensor(a, placement=pl, sbp=split(0))
    z[:, 1].add_(100)
    t = a.clone()
    t[:, 1].add_(100)
    assert np.array_equal(z.numpy(), t.numpy())
    x[:, 1] = 7.0  # setitem on the original works for every layout
    t = a.clone()
    t[:, 1] = 7.0
    assert np.array_equal(x.numpy(), t.numpy())
    return "ok"


def test_global_interop_and_view_copies(dist_run):
    dist_run(2, _global_interop)


def test_misc_api():
    x = sbpflow.randn(3, 4)
    assert sbpflow.allclose(x, x) and sbpflow.equal(x, x) and sbpflow.is_tensor(x)
    assert not sbpflow.equal(x, x + 1)
    a = np.arange(3.0)
    assert torch.equal(sbpflow.from_numpy(a).to_torch(), torch.from_numpy(a))
    assert tuple(sbpflow.vstack([sbpflow.ones(3), sbpflow.ones(3)]).shape) == (2, 3)
    assert tuple(x.new_zeros(2).shape) == (2,) and x.new_ones(1).dtype == x.dtype
    assert tuple(x.argsort(1).shape) == (3, 4) and x.isfinite().all().item()
    with pytest.raises(ValueError, match="explicitly"):
        sbpflow.einsum("ij,jk", x, x)


def _global_new():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.ones(4, 2, placement=pl, sbp=split(0))
    z = x.new_zeros(3, 3)
    assert z.is_global and z.sbp == (B,) and z.placement == pl
    return "ok"


def test_new_on_global(dist_run):
    dist_run(2, _global_new)
