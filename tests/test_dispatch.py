"""The one dispatch path and the generated API (issue 9).

* every registered op, global algorithms and in-place forms included, is reached from the
  public API (Tensor methods, ``sbpflow.<fn>``, ``sbpflow.nn.functional``) and runs through
  :func:`sbpflow.ops.dispatch.dispatch` / ``dispatch_inplace`` on global tensors (counted
  with :func:`sbpflow.ops.observe`), on 1 and 2 ranks;
* the methods and functions are generated from the families' declarations: a duplicate
  declaration raises, every in-place method has an in-place record, torch's functions
  route by identity.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow.nn.functional as F
from sbpflow.ops import REGISTRY, api, observe
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def _calls(pl, nd):
    """(what, fn) pairs covering the public API on global tensors laid out ``nd``."""

    def g(*shape, dtype=torch.float32, low=0.1, high=0.9, sbp=None):
        gen = torch.Generator().manual_seed(sum(shape) + 7)
        t = torch.rand(*shape, generator=gen) * (high - low) + low
        return sbpflow.tensor(t.to(dtype), placement=pl, sbp=sbp or nd)

    def ints(*shape, high=4, sbp=None):
        gen = torch.Generator().manual_seed(sum(shape))
        return sbpflow.tensor(torch.randint(0, high, shape, generator=gen), placement=pl,
                              sbp=sbp or (B,) * pl.ndim)

    x, y = g(4, 6), g(4, 6)
    calls = []
    # every zero-argument method, every binary method with a tensor and with a number
    for name, entry in sorted(api.METHODS.items()):
        if isinstance(entry.fn, property) or name.startswith("__") or name.endswith("_"):
            continue
        for args in ((), (y,), (0.5,)):
            calls.append((f"x.{name}{tuple(type(a).__name__ for a in args)}",
                          lambda name=name, args=args: getattr(g(4, 6), name)(*args)))
    # in-place forms: unary, with a tensor, with a number
    for name in sorted(n for n in api.METHODS if n.endswith("_") and not n.startswith("_")):
        for args in ((), (y,), (0.5,)):
            calls.append((f"x.{name}", lambda name=name, args=args: getattr(g(4, 6), name)(*args)))
    b = g(4, 6, dtype=torch.bool)
    v = sbpflow.tensor(2.0, placement=pl, sbp=(B,) * pl.ndim)  # a 0-d value
    i4 = ints(4, 6)
    idx = ints(2, high=4)
    manual = [
        # reductions, scans, order
        lambda: x.sum(1), lambda: x.mean(0), lambda: x.amax(1), lambda: x.amin(0),
        lambda: x.max(1), lambda: x.min(0), lambda: x.argmax(), lambda: x.argmin(1),
        lambda: x.prod(1), lambda: x.cumsum(1), lambda: x.cumprod(0), lambda: x.cummax(1),
        lambda: x.cummin(0), lambda: x.logcumsumexp(1), lambda: x.logsumexp(1),
        lambda: x.norm(), lambda: x.norm(float("inf")), lambda: x.topk(2, 1),
        lambda: x.sort(1), lambda: x.median(1), lambda: x.median(), lambda: x.kthvalue(2, 1),
        lambda: x.mode(1), lambda: x.quantile(0.5, 1), lambda: x.var(1), lambda: x.std(0),
        lambda: x.all(), lambda: x.any(1), lambda: i4.max(), lambda: x.softmax(1),
        lambda: x.log_softmax(0), lambda: sbpflow.searchsorted(g(5).sort().values, x),
        # shapes
        lambda: x.reshape(6, 4), lambda: x.permute(1, 0), lambda: x.unsqueeze(0).squeeze(),
        lambda: x.expand(2, 4, 6), lambda: x.repeat(2, 1), lambda: x[1:3, ::2],
        lambda: x.flip(0), lambda: x.roll(1, 0), lambda: x.tril(), lambda: x.triu(1),
        lambda: x.clone(), lambda: x.contiguous(), lambda: x.diagonal(),
        lambda: x.diag_embed(), lambda: x.reshape(-1)[:4].diag(),
        lambda: x.repeat_interleave(2, 0),
        # indexing
        lambda: x.gather(1, ints(4, 2)), lambda: x.index_select(0, idx),
        lambda: x.take_along_dim(ints(4, 2), 1), lambda: x.scatter(1, ints(4, 2), y[:, :2]),
        lambda: x.scatter(1, ints(4, 2), 1.0), lambda: x.scatter_add(1, ints(4, 2), y[:, :2]),
        lambda: x.index_add(0, idx, g(2, 6)), lambda: x.index_copy(0, ints(1), g(1, 6)),
        lambda: x.index_fill(1, idx, 0.0), lambda: F.one_hot(ints(4)),
        lambda: x.masked_fill(b, 1.0), lambda: x.masked_fill(b, v),
        # joining
        lambda: sbpflow.cat([x, y]), lambda: sbpflow.stack([x, y]),
        lambda: sbpflow.where(b, x, y), lambda: sbpflow.where(b, x, 0.0),
        lambda: sbpflow.where(b, 0.0, y), lambda: sbpflow.where(b, 1.0, 0.0),
        # matmul family
        lambda: x @ y.t(), lambda: sbpflow.einsum("ij,kj->ik", x, y),
        lambda: g(4, 3).cross(g(4, 3)), lambda: sbpflow.cdist(x, y),
        lambda: F.linear(x, g(3, 6), g(3)),
        # pointwise
        lambda: x.clamp(0.2, 0.5), lambda: x.clamp(y, None), lambda: x.clamp(None, y),
        lambda: x.clamp(y, y), lambda: x.lerp(y, 0.5), lambda: x.lerp(y, y),
        lambda: x.addcmul(y, y), lambda: x.addcdiv(y, y),
        lambda: x.div(y, rounding_mode="floor"), lambda: x.div(2.0, rounding_mode="trunc"),
        lambda: 2.0 - x, lambda: 2.0 / x, lambda: 2.0 ** x, lambda: 2.0 // x, lambda: 2.0 % x,
        lambda: sbpflow.xlogy(2.0, x), lambda: sbpflow.float_power(2.0, x),
        lambda: x.logit(1e-3), lambda: x.nan_to_num(), lambda: x.isclose(y),
        lambda: x.to(torch.float64), lambda: ~b, lambda: b & b, lambda: b | True,
        lambda: b ^ b, lambda: b ^ True, lambda: i4 & 1, lambda: b.logical_and(b),
        lambda: b.logical_or(b), lambda: x.maximum(y), lambda: x.max(y),
        lambda: x.clamp(min=0.5), lambda: sbpflow.maximum(x, y),
        # in place
        lambda: x.clone().clamp_(y, y), lambda: x.clone().clamp_min_(y),
        lambda: x.clone().clamp_max_(y), lambda: x.clone().lerp_(y, y),
        lambda: x.clone().masked_fill_(b, v),
        lambda: x.clone().masked_fill_(b, 2.0),
        lambda: x.clone().fill_(v), lambda: x.clone().copy_(y),
        lambda: x.clone().div_(y, rounding_mode="floor"), lambda: x.clone().cumsum_(1),
        # nn.functional
        lambda: F.softmax(x, 1), lambda: F.log_softmax(x, 0), lambda: F.gelu(x),
        lambda: F.silu(x), lambda: F.softplus(x), lambda: F.relu(x),
        lambda: F.embedding(ints(3, high=4), g(4, 6)),
        lambda: F.cross_entropy(x, ints(4, high=6)), lambda: F.nll_loss(x, ints(4, high=6)),
        lambda: F.mse_loss(x, y), lambda: F.l1_loss(x, y),
        lambda: F.binary_cross_entropy_with_logits(x, y),
        lambda: F.binary_cross_entropy(x, y), lambda: F.kl_div(x, y),
        lambda: F.smooth_l1_loss(x, y), lambda: F.huber_loss(x, y),
        lambda: F.margin_ranking_loss(x, y, y), lambda: F.glu(x, 1),
        lambda: F.prelu(x, g(1)), lambda: F.layer_norm(x, (6,)), lambda: F.rms_norm(x, (6,)),
        lambda: F.group_norm(g(2, 4, 3), 2), lambda: F.instance_norm(g(2, 4, 3)),
        lambda: F.pad(x, (1, 1)), lambda: F.interpolate(g(1, 2, 4), scale_factor=2),
        lambda: F.scaled_dot_product_attention(g(1, 2, 3, 4), g(1, 2, 3, 4), g(1, 2, 3, 4)),
        lambda: F.conv1d(g(2, 3, 5), g(4, 3, 2)), lambda: F.conv2d(g(1, 2, 4, 4), g(3, 2, 2, 2)),
        lambda: F.conv_transpose1d(g(2, 3, 5), g(3, 4, 2)),
        lambda: F.conv_transpose2d(g(1, 2, 4, 4), g(2, 3, 2, 2)),
        lambda: F.max_pool1d(g(2, 3, 6), 2),
        lambda: F.max_pool2d(g(1, 2, 4, 4), 2, return_indices=True),
        lambda: F.avg_pool1d(g(2, 3, 6), 2), lambda: F.avg_pool2d(g(1, 2, 4, 4), 2),
        lambda: F.adaptive_avg_pool1d(g(2, 3, 6), 2),
        lambda: F.adaptive_avg_pool2d(g(1, 2, 4, 4), 2),
        lambda: F.adaptive_max_pool2d(g(1, 2, 4, 4), 2, return_indices=True),
        lambda: F.pixel_shuffle(g(1, 4, 2, 2), 2), lambda: F.pixel_unshuffle(g(1, 1, 4, 4), 2),
        lambda: F.threshold(x, 0.5, 0.0),
    ] + [lambda n=n: getattr(F, n)(x) for n in (
        "celu", "elu", "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu",
        "logsigmoid", "mish", "relu6", "selu", "softshrink", "softsign", "tanhshrink")]
    calls += [(f"manual call {k}", fn) for k, fn in enumerate(manual)]
    return calls


def _coverage(mesh, layout):
    """Run every call; return (registered ops never dispatched, calls that ran on global
    tensors without a single dispatch, in-place methods without an in-place record)."""
    pl = sbpflow.placement("cpu", mesh)
    nd = (layout,) * pl.ndim
    seen, silent, not_inplace, crashes = set(), [], [], []
    for what, fn in _calls(pl, nd):
        with observe() as records:
            try:
                fn()
            except (TypeError, ValueError, RuntimeError, IndexError, NotImplementedError) as e:
                if what.startswith("manual"):  # these calls are valid: they must run
                    crashes.append(f"{what}: {type(e).__name__}: {e}")
                continue  # a method that needs other arguments: not this call's job
            except Exception as e:  # noqa: BLE001 - bad arguments must give a clear error
                crashes.append(f"{what}: {type(e).__name__}: {e}")
                continue
        if not records:
            silent.append(what)
        seen.update(r.op for r in records)
        if what.startswith("x.") and what.endswith("_") and not any(r.inplace for r in records):
            not_inplace.append(what)
    return sorted(set(REGISTRY) - seen), silent, sorted(set(not_inplace)), crashes


def test_every_registered_op_dispatches_on_one_rank():
    missing, silent, not_inplace, crashes = _coverage([0], split(0))
    assert crashes == [], "\n".join(crashes)
    assert missing == [], f"registered ops no public call dispatched: {missing}"
    assert not_inplace == [], f"in-place methods without an in-place dispatch: {not_inplace}"


def _coverage_2():
    return _coverage([0, 1], split(1))


def test_every_registered_op_dispatches_on_two_ranks(dist_run):
    for missing, _silent, not_inplace, crashes in dist_run(2, _coverage_2):
        assert crashes == [], "\n".join(crashes)
        assert missing == [], f"registered ops no public call dispatched: {missing}"
        assert not_inplace == []


def test_dispatch_records_the_chosen_signature():
    pl = sbpflow.placement("cpu", [0])
    x = sbpflow.ones(4, 3, placement=pl, sbp=split(0))
    with observe() as records:
        x.sum(0)
        x.cumsum(0)
        x.exp_()
    assert [r.op for r in records] == ["sum", "cumsum", "exp"]
    assert records[0].signature == (((split(0),),), (P,))
    assert records[1].signature[1] == (split(0),)  # the global algorithm keeps the split
    assert records[2].inplace and records[2].signature[0][0] == (split(0),)


def test_declarations_are_unique_and_generated():
    with pytest.raises(ValueError, match="Tensor.clamp is declared twice"):
        api.method("clamp")(lambda self: self)
    with pytest.raises(ValueError, match="sbpflow.where is declared twice"):
        api.function("where")(lambda c, x, y: x)
    for name, entry in api.METHODS.items():  # one generated attribute per declaration
        attr = sbpflow.Tensor.__dict__[name]
        assert attr is entry.fn or entry.view, name
    assert sbpflow.where is api.FUNCTIONS["where"]
    assert np.allclose(sbpflow.exp(sbpflow.ones(2)).to_torch(), np.e)  # generated from x.exp


def test_torch_functions_route_by_identity():
    x = sbpflow.ones(2, 3)
    assert torch.allclose(torch.exp(x).to_torch(), torch.full((2, 3), np.e))
    assert isinstance(torch.nn.functional.softmax(x, -1), sbpflow.Tensor)
    assert isinstance(torch.ones(2, 3) + x, sbpflow.Tensor)  # torch.Tensor.__add__
    assert isinstance(torch.zeros_like(x), sbpflow.Tensor)
    with pytest.raises(TypeError, match="sbpflow has no op for it"):
        torch.fft.fft(x)
