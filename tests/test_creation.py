"""Deterministic creation ops (sbpflow.ops.creation: arange, linspace, eye, full_like,
empty...) against plain torch on one process: shard-only (no collective) and the same bits
under every 1-D layout on 1, 2 and 4 ranks and a sample of 2x2 layouts (uneven sizes); empty
shapes; gradients of requires_grad leaves; errors of the creation and random API. Random
ops: test_random.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_random import _inputs  # the tensor inputs of the sampling ops

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2 = split(0), split(1), split(2)

# The 2x2 layouts tried by default (the same sample as test_random.py's).
SAMPLE_2X2 = [(S0, S0), (S0, S1), (S1, S0), (B, S1), (S1, B), (B, B), (S0, P), (P, B)]


def _mesh(world):
    return list(range(world))


# ---------------------------------------------------------------------- deterministic

# name -> (sbpflow(**layout) -> tensor, torch() -> tensor, exact bits vs torch)
DET_CASES = {
    "arange_n": (lambda **kw: sbpflow.arange(11, **kw), lambda: torch.arange(11), True),
    "arange_int_step": (lambda **kw: sbpflow.arange(-4, 17, 3, **kw),
                        lambda: torch.arange(-4, 17, 3), True),
    "arange_neg_step": (lambda **kw: sbpflow.arange(10, -3, -2, **kw),
                        lambda: torch.arange(10, -3, -2), True),
    "arange_float": (lambda **kw: sbpflow.arange(-1.3, 4.1, 0.3, **kw),
                     lambda: torch.arange(-1.3, 4.1, 0.3), False),
    "arange_f64": (lambda **kw: sbpflow.arange(0, 2.2, 0.1, dtype=torch.float64, **kw),
                   lambda: torch.arange(0, 2.2, 0.1, dtype=torch.float64), False),
    "arange_int_as_float": (lambda **kw: sbpflow.arange(3, 40, 2, dtype=torch.float32, **kw),
                            lambda: torch.arange(3, 40, 2, dtype=torch.float32), True),
    "linspace": (lambda **kw: sbpflow.linspace(-3.3, 7.1, 23, **kw),
                 lambda: torch.linspace(-3.3, 7.1, 23), False),
    "linspace_f64": (lambda **kw: sbpflow.linspace(0.1, 0.7, 9, dtype=torch.float64, **kw),
                     lambda: torch.linspace(0.1, 0.7, 9, dtype=torch.float64), False),
    "linspace_int": (lambda **kw: sbpflow.linspace(0, 20, 11, dtype=torch.int64, **kw),
                     lambda: torch.linspace(0, 20, 11, dtype=torch.int64), True),
    "linspace_one": (lambda **kw: sbpflow.linspace(2.5, 9.0, 1, **kw),
                     lambda: torch.linspace(2.5, 9.0, 1), True),
    "eye_rect": (lambda **kw: sbpflow.eye(7, 5, **kw), lambda: torch.eye(7, 5), True),
    "eye_wide": (lambda **kw: sbpflow.eye(3, 6, dtype=torch.int64, **kw),
                 lambda: torch.eye(3, 6, dtype=torch.int64), True),
    "eye_square": (lambda **kw: sbpflow.eye(6, **kw), lambda: torch.eye(6), True),
    "full_like": (lambda **kw: sbpflow.full_like(sbpflow.zeros(7, 5, **kw), 2.5),
                  lambda: torch.full_like(torch.zeros(7, 5), 2.5), True),
    "full_like_int": (lambda **kw: sbpflow.full_like(sbpflow.zeros(7, 5, **kw), 3,
                                                     dtype=torch.int32),
                      lambda: torch.full((7, 5), 3, dtype=torch.int32), True),
}


def _check_deterministic(mesh, every_1d):
    pl = sbpflow.placement("cpu", mesh)
    failures = []
    for name, (make, ref_fn, exact) in sorted(DET_CASES.items()):
        ref = ref_fn()
        one = [split(d) for d in range(ref.ndim)] + [B, P]
        layouts = ([(s,) for s in one] if pl.ndim == 1 else
                   [nd for nd in SAMPLE_2X2 if all(not s.is_split() or s.dim < ref.ndim
                                                   for s in nd)])
        first = None
        for nd in layouts:
            with CommRecorder() as rec:
                out = make(placement=pl, sbp=nd)
            got = torch.from_numpy(out.numpy())
            problems = []
            if rec.kinds():
                problems.append(f"ran {rec.kinds()}")
            if out.sbp != nd:
                problems.append(f"sbp {out.sbp}")
            if tuple(out.to_local().shape) != pl.shard_shape(tuple(ref.shape), nd):
                problems.append(f"local shape {tuple(out.to_local().shape)}")
            if got.dtype != ref.dtype or got.shape != ref.shape:
                problems.append(f"{got.dtype} {tuple(got.shape)}")
            elif exact and not torch.equal(got, ref):
                problems.append("value (exact)")
            elif not np.allclose(got.numpy(), ref.numpy(), rtol=1e-6, atol=1e-6):
                problems.append("value")
            if first is not None and not torch.equal(got, first):
                problems.append("differs from the first layout's bits")
            first = got if first is None else first
            if problems:
                failures.append(f"{name} {nd}: {', '.join(problems)}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 4])
def test_deterministic_creation_shard_only_every_1d_layout(dist_run, world):
    results = dist_run(world, _check_deterministic, _mesh(world), True)
    assert results[0] == [], "\n".join(results[0])


def test_deterministic_creation_2x2(dist_run):
    results = dist_run(4, _check_deterministic, [[0, 1], [2, 3]], False)
    assert results[0] == [], "\n".join(results[0])


def _empty_layouts():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.empty(7, 5, dtype=torch.float64, placement=pl, sbp=S1)
    y = sbpflow.empty_like(x)
    z = sbpflow.empty_like(x, dtype=torch.int32, sbp=S0)
    assert (x.shape, x.dtype, x.sbp) == (torch.Size([7, 5]), torch.float64, (S1,))
    assert (y.shape, y.dtype, y.sbp) == (x.shape, x.dtype, x.sbp)
    assert (z.dtype, z.sbp) == (torch.int32, (S0,))
    return tuple(x.to_local().shape), tuple(z.to_local().shape)


def test_empty_shapes(dist_run):
    assert dist_run(2, _empty_layouts) == [((7, 3), (4, 5)), ((7, 2), (3, 5))]


# ---------------------------------------------------------------------- gradients

GRAD_LEAVES = {
    "randn": lambda pl, nd: sbpflow.randn(7, 5, requires_grad=True, placement=pl, sbp=nd),
    "rand": lambda pl, nd: sbpflow.rand(7, 5, requires_grad=True, placement=pl, sbp=nd),
    "normal": lambda pl, nd: sbpflow.normal(1.0, 3.0, (7, 5), requires_grad=True,
                                            placement=pl, sbp=nd),
    "rand_like": lambda pl, nd: sbpflow.rand_like(sbpflow.zeros(7, 5, placement=pl, sbp=nd),
                                                  requires_grad=True),
    "empty": lambda pl, nd: sbpflow.empty(7, 5, requires_grad=True, placement=pl, sbp=nd),
    "full_like": lambda pl, nd: sbpflow.full_like(sbpflow.zeros(7, 5, placement=pl, sbp=nd),
                                                  0.5, requires_grad=True),
    "eye": lambda pl, nd: sbpflow.eye(7, 5, requires_grad=True, placement=pl, sbp=nd),
    "arange": lambda pl, nd: sbpflow.arange(0.0, 7.0, requires_grad=True, placement=pl,
                                            sbp=nd[:1] if nd[0] != S1 else (B,)),
    "linspace": lambda pl, nd: sbpflow.linspace(0, 1, 7, requires_grad=True, placement=pl,
                                                sbp=nd[:1] if nd[0] != S1 else (B,)),
}


def _leaf_grads():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, make in sorted(GRAD_LEAVES.items()):
        for nd in [(S0,), (S1,), (B,)]:
            x = make(pl, nd)
            w = sbpflow.tensor(torch.arange(x.numel(), dtype=torch.float32).reshape(x.shape),
                               placement=pl, sbp=B)
            (x * w).sum().backward()
            if not (x.is_leaf and x.requires_grad) or x.grad is None:
                problems.append(f"{name} {nd}: no grad")
            elif x.grad.sbp != x.sbp or not np.array_equal(x.grad.numpy(), w.numpy()):
                problems.append(f"{name} {nd}: grad {x.grad.sbp}")
    # Sampling from tensors: torch's gradient (zeros: no reparameterisation).
    for nd in [(S0,), (B,), (P,)]:
        mean = sbpflow.tensor(_inputs()["mean"], placement=pl, sbp=nd, requires_grad=True)
        p = sbpflow.tensor(_inputs()["p"], placement=pl, sbp=nd, requires_grad=True)
        y = sbpflow.normal(mean, 1.0) + sbpflow.bernoulli(p)
        y.backward(sbpflow.ones(7, 5, placement=pl, sbp=B))
        mt = _inputs()["mean"].requires_grad_(True)
        pt = _inputs()["p"].requires_grad_(True)
        (torch.normal(mt, 1.0) + torch.bernoulli(pt)).sum().backward()
        for a, b in [(mean, mt), (p, pt)]:
            if a.grad is None or not np.array_equal(a.grad.numpy(), b.grad.numpy()):
                problems.append(f"sampling {nd}: grad")
    return problems


def test_requires_grad_leaves_get_gradients(dist_run):
    results = dist_run(2, _leaf_grads)
    assert results[0] == [], "\n".join(results[0])


# ---------------------------------------------------------------------- errors


def test_errors():
    pl = sbpflow.placement("cpu", [0])
    p_ = dict(placement=pl, sbp=P)
    for make in [lambda: sbpflow.rand(3, **p_), lambda: sbpflow.randn(3, **p_),
                 lambda: sbpflow.randint(0, 3, (3,), **p_), lambda: sbpflow.randperm(3, **p_),
                 lambda: sbpflow.normal(0.0, 1.0, (3,), **p_),
                 lambda: sbpflow.rand_like(sbpflow.zeros(3), **p_),
                 lambda: sbpflow.bernoulli(sbpflow.ones(3, placement=pl, sbp=B), sbp=P),
                 lambda: sbpflow.normal(sbpflow.ones(3, placement=pl, sbp=B), sbp=P),
                 lambda: sbpflow.multinomial(sbpflow.ones(3, placement=pl, sbp=B), 2, sbp=P)]:
        with pytest.raises(ValueError, match="partial_sum"):
            make()
    with pytest.raises(ValueError, match="non-negative ints"):
        sbpflow.empty(3, -1)
    with pytest.raises(ValueError, match="non-negative ints"):
        sbpflow.rand(2.5)
    with pytest.raises(ValueError, match="non-negative int"):
        sbpflow.randperm(-2)
    with pytest.raises(ValueError, match="non-negative int"):
        sbpflow.eye(3, -1)
    with pytest.raises(ValueError, match="step must be nonzero"):
        sbpflow.arange(0, 5, 0)
    with pytest.raises(ValueError, match="goes away from end"):
        sbpflow.arange(0, 5, -1)
    with pytest.raises(TypeError, match="must be a number"):
        sbpflow.arange("5")
    with pytest.raises(ValueError, match="steps must be non-negative"):
        sbpflow.linspace(0, 1, -3)
    with pytest.raises(TypeError, match="steps must be an int"):
        sbpflow.linspace(0, 1, 2.0)
    probs = sbpflow.ones(2, 4)
    with pytest.raises(ValueError, match="num_samples must be positive, got -1"):
        probs.multinomial(-1)
    with pytest.raises(ValueError, match="num_samples must be positive, got 0"):
        probs.multinomial(0)
    with pytest.raises(TypeError, match="num_samples must be an int"):
        probs.multinomial(2.0)
    with pytest.raises(ValueError, match="cannot draw 5 samples without replacement from 4"):
        probs.multinomial(5)
    assert probs.multinomial(5, replacement=True).shape == (2, 5)
    with pytest.raises(ValueError, match=r"1-D \(k,\) or 2-D"):
        sbpflow.multinomial(sbpflow.ones(2, 2, 2), 1)
    with pytest.raises(ValueError, match="std must be >= 0"):
        sbpflow.normal(0.0, -1.0, (2,))
    with pytest.raises(ValueError, match="std must be >= 0"):
        sbpflow.normal(sbpflow.zeros(2), -1.0)
    with pytest.raises(TypeError, match="needs size="):
        sbpflow.normal(0.0, 1.0)
    with pytest.raises(TypeError, match="size= applies to float"):
        sbpflow.normal(sbpflow.zeros(2), 1.0, (2,))
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        sbpflow.ones(2).bernoulli(1.5)
    with pytest.raises(TypeError, match="takes an sbpflow.Tensor"):
        sbpflow.bernoulli(torch.ones(2))
    g = sbpflow.ones(2, placement=pl, sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        sbpflow.normal(g, sbpflow.ones(2))
    with pytest.raises(ValueError, match="placement= given without sbp="):
        sbpflow.arange(4, placement=pl)
    with pytest.raises(ValueError, match="sbp= applies to global inputs"):
        sbpflow.bernoulli(sbpflow.ones(2), sbp=B)
