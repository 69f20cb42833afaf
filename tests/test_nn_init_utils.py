"""nn.init (layout-invariant: bit-equal to torch.nn.init on one process under every SBP)
and gradient clipping over local, split, replicated and ZeRO-laid-out gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

INITS = [
    ("uniform_", dict(a=-0.5, b=2.0)), ("normal_", dict(std=0.3)), ("trunc_normal_", {}),
    ("constant_", dict(val=0.7)), ("xavier_uniform_", {}), ("xavier_normal_", dict(gain=2.0)),
    ("kaiming_uniform_", dict(a=5 ** 0.5)), ("kaiming_normal_", dict(mode="fan_out")),
    ("orthogonal_", {}), ("eye_", {}), ("zeros_", {}), ("ones_", {}),
]


def _init_matches(layouts):
    pl = sbpflow.placement.all("cpu")
    for name, kw in INITS:
        for sbp in layouts:
            t = sbpflow.zeros(7, 5, placement=pl, sbp=sbp)
            sbpflow.manual_seed(3)
            getattr(nn.init, name)(t, **kw)
            torch.manual_seed(3)
            ref = getattr(torch.nn.init, name)(torch.empty(7, 5), **kw)
            assert np.array_equal(t.numpy(), ref.numpy()), (name, sbp)
            # The generator advanced as on one process.
            assert torch.rand(1).item() == (torch.manual_seed(3), getattr(
                torch.nn.init, name)(torch.empty(7, 5), **kw), torch.rand(1))[2].item()
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_init_layout_invariant(dist_run, world):
    dist_run(world, _init_matches, [split(0), split(1), B, P])


def test_init_local():
    t = sbpflow.zeros(3, 4)
    torch.manual_seed(0)
    nn.init.kaiming_uniform_(t, a=1.0)
    torch.manual_seed(0)
    assert torch.equal(t.to_torch(), torch.nn.init.kaiming_uniform_(torch.empty(3, 4), a=1.0))
    with pytest.raises(TypeError, match="sbpflow Tensor"):
        nn.init.zeros_([1, 2])


def _grads_case(norm_type, layouts, zero):
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g),
              torch.randn(3, 3, generator=g)]
    grads = [torch.randn(v.shape, generator=g) * 3 for v in values]
    ps = []
    for v, gr, sbp in zip(values, grads, layouts):
        p = nn.Parameter(sbpflow.tensor(v, placement=pl, sbp=sbp))
        if zero and sbp == B:
            p.set_grad_sbp(split(0))
        # The gradient arrives through autograd as it would in training.
        (p * sbpflow.tensor(gr, placement=pl, sbp=B)).sum().backward()
        ps.append(p)
    ts = [torch.nn.Parameter(v.clone()) for v in values]
    for t, gr in zip(ts, grads):
        t.grad = gr.clone()
    want = torch.nn.utils.clip_grad_norm_(ts, 1.5, norm_type)
    got = nn.utils.clip_grad_norm_((p for p in ps), 1.5, norm_type)
    assert np.allclose(got.item(), want.item(), rtol=1e-5), (got, want)
    for p, t in zip(ps, ts):
        assert np.allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)
    nn.utils.clip_grad_value_(ps, 0.1)
    torch.nn.utils.clip_grad_value_(ts, 0.1)
    for p, t in zip(ps, ts):
        assert np.allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)
    return "ok"


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("layouts,zero", [((B, B, B), False), ((split(0), split(0), B), False),
                                          ((B, split(0), split(1)), True)])
def test_clip_grad_norm_global(dist_run, norm_type, layouts, zero):
    dist_run(2, _grads_case, norm_type, layouts, zero)


def test_clip_grad_norm_local_and_nonfinite():
    p = nn.Parameter(sbpflow.ones(3))
    (p * 4).sum().backward()
    total = nn.utils.clip_grad_norm_(p, 1.0)
    assert np.isclose(total.item(), 4 * 3 ** 0.5)
    assert np.allclose(p.grad.numpy(), 4 / (4 * 3 ** 0.5 + 1e-6))
    p.grad = sbpflow.tensor([float("nan"), 1.0, 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
