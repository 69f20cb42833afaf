"""The autograd surface on global and local tensors: retain_grad, hooks, autograd.grad."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import S0, S1

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


# ------------------------------------------------------------------ autograd surface
def _retain_grad_and_hooks():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv, wv = torch.randn(6, 4), torch.randn(4, 3)
    x = sbpflow.tensor(xv, placement=pl, sbp=S0, requires_grad=True)
    w = sbpflow.tensor(wv, placement=pl, sbp=B, requires_grad=True)
    h = x @ w  # S0
    hb = h.to_global(sbp=B)  # B non-leaf: its gradient arrives P
    hp = (x @ w).sum(dim=0)  # B after P? keep: sum over the split dim gives P
    assert hp.sbp == (P,)
    for t in (h, hb, hp):
        t.retain_grad()
        assert t.retains_grad and not t.is_leaf and t.grad_fn is not None
    seen = {}

    def record(name):
        def hook(g):
            seen[name] = (g.sbp, g.numpy())
        return hook

    hb.register_hook(record("hb"))
    w.register_hook(record("w"))
    doubled = hp.register_hook(lambda g: g * 2)  # replace: doubles hp's gradient
    loss = (hb * hb).sum() + hp.sum()
    loss.backward()
    # torch reference
    xr, wr = xv.clone().requires_grad_(True), wv.clone().requires_grad_(True)
    hr = xr @ wr
    hr.retain_grad()
    hpr = (xr @ wr).sum(dim=0)
    hpr.retain_grad()
    hpr.register_hook(lambda g: g * 2)
    ((hr * hr).sum() + hpr.sum()).backward()
    assert hb.grad.sbp == (B,) and h.grad.sbp == (S0,) and hp.grad.sbp == (P,)
    assert np.allclose(hb.grad.numpy(), hr.grad.numpy(), atol=1e-5)
    assert np.allclose(h.grad.numpy(), hr.grad.numpy(), atol=1e-5)
    assert np.allclose(hp.grad.numpy(), hpr.grad.numpy(), atol=1e-5)  # after the hook
    assert seen["hb"][0] == (P,) and np.allclose(seen["hb"][1], hr.grad.numpy(), atol=1e-5)
    # w's gradient is reduced in the backward's buckets after its hook runs: P (summands).
    assert seen["w"][0] == (P,) and np.allclose(seen["w"][1], wr.grad.numpy(), atol=1e-5)
    assert np.allclose(w.grad.numpy(), wr.grad.numpy(), atol=1e-5)
    assert np.allclose(x.grad.numpy(), xr.grad.numpy(), atol=1e-5)
    doubled.remove()
    hb.grad = None
    assert hb.grad is None
    return "ok"


def test_retain_grad_and_hooks_global(dist_run):
    dist_run(2, _retain_grad_and_hooks)


def _autograd_grad_global():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(1)
    xv, wv, gv = torch.randn(6, 4), torch.randn(4, 3), torch.randn(6, 3)
    x = sbpflow.tensor(xv, placement=pl, sbp=S1, requires_grad=True)
    w = sbpflow.tensor(wv, placement=pl, sbp=B, requires_grad=True)
    u = sbpflow.tensor(wv, placement=pl, sbp=S0, requires_grad=True)  # unused
    y = (x @ w).tanh()
    g_out = sbpflow.tensor(gv, placement=pl, sbp=S0)
    gx, gw, gu = sbpflow.autograd.grad(y, [x, w, u], grad_outputs=g_out, retain_graph=True,
                                       allow_unused=True)
    xr, wr = xv.clone().requires_grad_(True), wv.clone().requires_grad_(True)
    gxr, gwr = torch.autograd.grad((xr @ wr).tanh(), [xr, wr], gv)
    assert gu is None and x.grad is None and w.grad is None  # returned, not accumulated
    assert gx.sbp == (S1,) and gw.sbp == (B,)
    assert np.allclose(gx.numpy(), gxr.numpy(), atol=1e-5)
    assert np.allclose(gw.numpy(), gwr.numpy(), atol=1e-5)
    # a non-leaf input, and a B scalar output seeded like backward()
    loss = y.sum().to_global(sbp=B)
    (gy,) = sbpflow.autograd.grad(loss, y, retain_graph=True)
    assert gy.sbp == y.sbp and np.allclose(gy.numpy(), np.ones((6, 3)))
    with pytest.raises(RuntimeError, match="not have been used|does not require grad|unused"):
        sbpflow.autograd.grad(loss, [u], retain_graph=True)
    with pytest.raises(NotImplementedError, match="local tensors only"):
        sbpflow.autograd.grad(loss, [w], create_graph=True)
    # backward of several roots, with and without gradients
    sbpflow.autograd.backward([loss, y], [None, g_out])
    wr2 = wv.clone().requires_grad_(True)
    yr = (xv @ wr2).tanh()
    torch.autograd.backward([yr.sum(), yr], [None, gv])
    assert w.grad.sbp == (B,) and np.allclose(w.grad.numpy(), wr2.grad.numpy(), atol=1e-5)
    # a leaf with a ZeRO gradient layout gets its gradient in that layout
    z = sbpflow.tensor(wv, placement=pl, sbp=B).set_grad_sbp(S0)
    (gz,) = sbpflow.autograd.grad((x @ z).sum(), z)
    assert gz.sbp == (S0,) and np.allclose(gz.numpy(), xv.sum(0)[:, None].expand(4, 3).numpy())
    return "ok"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.exhaustive)])
def test_autograd_grad_global(dist_run, world):
    dist_run(world, _autograd_grad_global)


def test_autograd_local():
    xv = torch.randn(5)
    x = sbpflow.tensor(xv, requires_grad=True)
    y = x.sin() * x
    (g,) = sbpflow.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = sbpflow.autograd.grad(g.sum(), x)
    xr = xv.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad((xr.sin() * xr).sum(), xr, create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), xr)
    assert torch.allclose(g.to_torch(), gr) and torch.allclose(gg.to_torch(), ggr)
    # grad_outputs, allow_unused, hooks that replace, retain_grad
    u = sbpflow.ones(2, requires_grad=True)
    h = x * 2
    h.retain_grad()
    h.register_hook(lambda t: t * 3)
    seen = []
    x.register_hook(lambda t: seen.append(t.to_torch().clone()))
    gx, gu = sbpflow.autograd.grad(h, [x, u], grad_outputs=sbpflow.ones(5), allow_unused=True,
                                   retain_graph=True)
    assert gu is None and torch.equal(gx.to_torch(), torch.full((5,), 6.0))
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((5,), 6.0))
    sbpflow.autograd.backward([h.sum()])
    # retained in both passes (torch: retain_grad also sees autograd.grad's gradient)
    assert h.retains_grad and torch.equal(h.grad.to_torch(), torch.full((5,), 6.0))
    assert torch.equal(x.grad.to_torch(), torch.full((5,), 6.0))
    with pytest.raises(TypeError, match="callable"):
        x.register_hook(3)
    with pytest.raises(TypeError, match="sequence of them"):
        sbpflow.autograd.grad(h.sum(), torch.ones(2))
    with pytest.raises(ValueError, match="2 gradients for 1 outputs"):
        sbpflow.autograd.backward(h, [None, None])
    assert sbpflow.autograd.no_grad is torch.no_grad
