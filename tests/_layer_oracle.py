"""The layer oracle shared by the layer test files: build a layer in torch.nn and in
sbpflow.nn from the same seed, check the parameters are torch's bit for bit, run both on
the same inputs (sbpflow: local, or data parallel with the batch split and the layer B)
and compare outputs, parameter gradients, optionally input gradients, and buffers."""

from __future__ import annotations

import zlib

import numpy as np
import torch

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split


def same_init_pair(name: str, build):
    """``(torch module, sbpflow module, torch's named parameters)`` built by ``build(nn)``
    from seed 0 on each side; asserts the parameter names and values are torch's."""
    torch.manual_seed(0)
    tm = build(torch.nn)
    sbpflow.manual_seed(0)
    sm = build(sbpflow.nn)
    t_params = dict(tm.named_parameters())
    assert list(dict(sm.named_parameters())) == list(t_params), name
    for n, p in sm.named_parameters():  # same initialisation as torch, bit for bit
        assert np.array_equal(p.numpy(), t_params[n].detach().numpy()), (name, n)
    return tm, sm, t_params


def check_layer(name: str, build, makers, mode: str, *, bdim: int = 0,
                input_grads: bool = False) -> str:
    """``build(nn) -> module``; ``makers``: ``generator -> torch.Tensor`` per input;
    ``mode``: ``"local"`` or ``"dp"`` (inputs split on ``bdim`` over every rank, the
    output must stay split there). Returns ``"ok"`` or raises AssertionError."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    inputs = [m(g) for m in makers]
    tm, sm, t_params = same_init_pair(name, build)
    grad = [input_grads and v.is_floating_point() for v in inputs]
    if mode == "local":
        xs = [sbpflow.tensor(v, requires_grad=r) for v, r in zip(inputs, grad)]
    else:
        pl = sbpflow.placement.all("cpu")
        sm.to_global(pl, B)
        xs = [sbpflow.tensor(v, placement=pl, sbp=split(bdim), requires_grad=r)
              for v, r in zip(inputs, grad)]
    tx = [v.clone().requires_grad_(True) if r else v for v, r in zip(inputs, grad)]
    torch.manual_seed(1)
    ref = tm(*tx)
    sbpflow.manual_seed(1)
    out = sm(*xs)
    if mode != "local" and ref.ndim > bdim:
        assert out.sbp == (split(bdim),), (name, out.sbp)  # the batch split passes through
    assert tuple(out.shape) == tuple(ref.shape), name
    assert np.allclose(out.numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-5), name
    if not ref.requires_grad:  # no parameters and no input gradients (Dropout): values only
        return "ok"
    w = torch.randn(ref.shape, generator=g)
    (ref * w).sum().backward()
    gw = sbpflow.tensor(w) if mode == "local" else sbpflow.tensor(w, placement=out.placement,
                                                                  sbp=out.sbp)
    (out * gw).sum().backward()
    for n, p in sm.named_parameters():
        tg = t_params[n].grad
        assert p.grad is not None and np.allclose(p.grad.numpy(), tg.numpy(), rtol=1e-4,
                                                  atol=1e-5), (name, n)
    for x, t, r in zip(xs, tx, grad):
        if r:
            assert np.allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5), (name, "x")
    for (n, b), (_, tb) in zip(sm.named_buffers(), tm.named_buffers()):
        assert np.allclose(b.numpy(), tb.numpy(), rtol=1e-5, atol=1e-6), (name, n)
    return "ok"


def run_layers(module: str, names, mode: str = "dp") -> list:
    """Rank body: ``module.run(name, mode)`` for each of ``names`` (a layer test file's
    ``run``, by module name)."""
    import importlib

    run = importlib.import_module(module).run
    return [run(n, mode) for n in names]
