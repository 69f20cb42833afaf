"""The rest of torch's Tensor names (sbpflow/ops/compat): other names of ops, in-place
comparisons, new pointwise ops, shape helpers, the matmul family's linear algebra,
factorizations and replicated ops through the op oracle (every layout); metadata, in-place
views and in-place random fills against torch directly.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import warnings

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, Input, ints, uniform

import sbpflow
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def _aliases(a, b):
    return (a.absolute() + a.negative() * 2 + a.multiply(b) + a.subtract(b, alpha=2)
            + a.greater(b) * 1.0 + a.greater_equal(b) * 2.0 + a.less(b) * 3.0
            + a.less_equal(b) + a.not_equal(b) + a.positive() + a.true_divide(2.0))


def _inplace_compare(a, b):
    y = a * 1
    y.gt_(b)
    z = a * 1
    z.less_equal_(b)
    w = a > 0
    w.logical_and_(b > 0)
    v = a * 1
    v.subtract_(b, alpha=0.5)
    return a + y + z * 2 + w * 3.0 + v


def _pointwise(a, b):
    big = a.exp() * 1e38  # inf where a > 0.0 about (not a / 0: P summands would sum to nan)
    return (a.fmax(b) + a.fmin(b) * 2 + a.ldexp(b.round()) + a.hardshrink(0.3)
            + a.signbit() * 1.0 + big.isposinf() * 2.0 + (-big).isneginf() * 3.0
            + a.isreal() * 1.0)


def _special(a, b):
    # torch differentiates igamma/igammac in their second argument only
    return a.igamma(b) + a.igammac(b) * 2 + (b + 1).mvlgamma(2) + b.polygamma(1) * 0.1


def _integers(a, b):
    return a.gcd(b) + a.lcm(b) + a.bitwise_left_shift(b) + a.bitwise_right_shift(1)


def _shapes(a):
    return (a.fliplr() + a.flipud() * 2 + a.rot90().mT * 3 + a.rot90(2) + a.rot90(3).mT
            + a.ravel().reshape(7, 5) + a.adjoint().mT + a.rot90(-1, (1, 0)).mT)


def _splits(a):
    parts = [*a.tensor_split(3, dim=1), *a.hsplit([1, 3]), *a.vsplit([2, 6]),
             *a.tensor_split([1, -2], dim=0), *a.split_with_sizes([2, 5], 0),
             *a.unsafe_chunk(2, 1)]
    return sum((p * (i + 1)).sum() for i, p in enumerate(parts))


def _reshapes(a, idx):
    return (a.sum_to_size(1, 5) + a.msort()[:1] + a[:, 0].diagflat()[:1, :5]
            + a.take(idx)[:1, :1])


def _vectors(a, v, w):
    return (a.mv(v) + w.dot(w) + a.inner(a).sum(1) + a.addr(w, v, beta=0.5, alpha=2).sum(1)
            + w.ger(w).sum(0) + w.vdot(w) + (a * 1).addr_(w, v).sum(1))


def _spd(g, shape):
    m = torch.randn(shape, generator=g)
    return m @ m.mT + 4 * torch.eye(shape[-1])


def _factorizations(m):
    with warnings.catch_warnings():  # torch.cholesky and torch.qr are deprecated
        warnings.simplefilter("ignore", UserWarning)
        return _factorized(m)


def _factorized(m):
    return (m.det() + m.logdet() + m.slogdet()[1] + m.inverse().sum((-2, -1))
            + m.cholesky().sum((-2, -1)) + m.matrix_exp().sum((-2, -1)) * 1e-3
            + m.matrix_power(2).sum((-2, -1)) * 1e-2 + m.pinverse().sum((-2, -1))
            + m.cholesky_solve(m.cholesky()).sum((-2, -1)) + m.svd()[1].sum(-1)
            + m.qr()[1].abs().sum((-2, -1)))


def _replicated(a, b):
    return (a.kron(b).sum(1) + a.cov().sum(1) + a.corrcoef().sum(1) * 2
            + a.renorm(2, 0, 1.0).sum(1), a.histogram(5)[0])


def _scatter_reduce(a, i, src):
    return (a.scatter_reduce(0, i, src, "sum") + a.scatter_reduce(0, i, src, "amax",
                                                                 include_self=False))


def _index_reduce(a, i, src):
    with warnings.catch_warnings():  # torch: "index_reduce() is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return a.index_reduce(0, i, src, "amax") + a.index_reduce(0, i, src, "mean") * 2


def _scatters(a, b, c):
    return (a.slice_scatter(b, 1, 1, 3) + a.slice_scatter(b, 1, 0, 5, 3) * 2
            + a.select_scatter(c, 0, -1) + a.diagonal_scatter(c[:4], 1)
            + a.diagonal_scatter(c, -2) + (a * 1).fill_diagonal_(2.0, wrap=True),
            a.unfold(0, 3, 2))


def _masked(a, m, src):
    return (a.masked_scatter(m, src) + a.prelu(src[0]), (a > 0).nonzero_static(size=40))


# These ops are compositions of (or new names for) ops swept densely in their own families:
# the default suite samples 6 1-D and one 2x2 combination per case; the exhaustive suite
# (CI runs it) every 1-D combination, and every 2x2 one up to 36 (else a covering set).
CASES = {
    **oracle.policy({
        "aliases": (_aliases, [(7, 5), (5,)]),
        "inplace_compare_logical": (_inplace_compare, [(7, 5), (5,)]),
        "pointwise_new": (_pointwise, [(7, 5), (5,)]),
        "special_functions": (_special, [uniform((7, 5), 0.5, 2.0, grad=False),
                                          uniform((5,), 0.5, 2.0)]),
        "integer_functions": (_integers, [ints((7, 5), 30, 1), ints((5,), 4, 1)]),
        "shape_helpers": (_shapes, [(7, 5)]),
        "splits": (_splits, [(7, 5)]),
        "reshapes_take": (_reshapes, [(7, 5), ints((2, 3), 35, -35)]),
        "vectors": (_vectors, [(7, 5), (5,), (7,)]),
        "factorizations": (_factorizations, [Input(lambda g: _spd(g, (4, 4)))],
                           {"rtol": 1e-4, "atol": 1e-4}),
        "factorizations_batched": (_factorizations,
                                   [Input(lambda g: _spd(g, (2, 4, 4)), layouts=(S0, B))],
                                   {"rtol": 1e-4, "atol": 1e-4}),
        "replicated": (_replicated, [(7, 5), (3,)], {"rtol": 1e-4, "atol": 1e-5}),
        "scatter_reduce": (_scatter_reduce, [(7, 5), ints((3, 5), 7), (3, 5)]),
        "index_reduce": (_index_reduce, [(7, 5), Input(lambda g: torch.tensor([0, 2, 2, 5]),
                                                       grad=False), (4, 5)]),
        "slice_select_diagonal_scatter": (_scatters, [(7, 5), (7, 2), (5,)]),
        "masked_scatter_prelu": (_masked, [(7, 5), Input(lambda g: torch.rand(
            (7, 5), generator=g) > 0.5, grad=False), (7, 5)]),
    }, local="close", sample_1d={2: 6}, sample_2x2=1, full_2x2_max=36),
}


(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


# ------------------------------------------------------------------ not through the oracle
def _index_put():
    pl = sbpflow.placement.all("cpu")
    v = torch.arange(35.0).reshape(7, 5)
    rows, cols = torch.tensor([0, 1, 0, 6]), torch.tensor([2, 3, 2, 4])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = []
    for sbp in (split(0), split(1), B):
        x = sbpflow.tensor(v, placement=pl, sbp=sbp)
        idx = tuple(sbpflow.tensor(t, placement=pl, sbp=B) for t in (rows, cols))
        val = sbpflow.tensor(vals, placement=pl, sbp=B)
        for acc in (False, True):
            want = v.index_put((rows, cols), vals, accumulate=acc)
            got = x.index_put(idx, val, acc)
            y = x.clone()
            y.index_put_(idx, val, accumulate=acc)
            out.append((str(sbp), acc, bool(np.array_equal(got.numpy(), want.numpy())),
                        bool(np.array_equal(y.numpy(), want.numpy())), y.sbp == x.sbp))
    return out


def test_index_put_on_every_layout(dist_run):
    for rows in dist_run(2, _index_put):
        for sbp, acc, ok, ok_inplace, kept in rows:
            assert ok and ok_inplace and kept, (sbp, acc, ok, ok_inplace, kept)


def _post_accumulate_hooks():
    pl = sbpflow.placement.all("cpu")
    w0 = torch.arange(12.0).reshape(4, 3) / 10
    x = torch.arange(8.0).reshape(2, 4) / 7
    tw = w0.clone().requires_grad_()
    (x @ tw).square().sum().backward()
    out = []
    for name, sbp, grad_sbp, xsbp in (("dp", B, None, split(0)), ("tp", split(1), None, B),
                                      ("zero", B, split(0), split(0))):
        w = sbpflow.nn.Parameter(sbpflow.tensor(w0, placement=pl, sbp=sbp))
        if grad_sbp is not None:
            w.set_grad_sbp(grad_sbp)
        seen = []
        handle = w.register_post_accumulate_grad_hook(
            lambda p, seen=seen: seen.append((p.grad.numpy().copy(), p.grad.sbp)))
        xs = sbpflow.tensor(x, placement=pl, sbp=xsbp)
        (xs @ w).square().sum().backward()
        handle.remove()
        (xs @ w).square().sum().backward()
        ok = len(seen) == 1 and np.allclose(seen[0][0], tw.grad.numpy(), rtol=1e-6)
        out.append((name, ok, len(seen), seen[0][1] if seen else None,
                    seen[0][0] if seen else None, tw.grad.numpy()))
    return out


def test_post_accumulate_grad_hooks_see_the_reduced_gradient(dist_run):
    """The hook runs once per backward, after the gradient is in its gradient layout
    (data parallel: after the bucket all-reduce; ZeRO: the reduce-scattered shard)."""
    for rows in dist_run(2, _post_accumulate_hooks):
        for name, ok, n, sbp, got, want in rows:
            assert ok, (name, n, sbp, got, want)



def _metadata():
    pl = sbpflow.placement.all("cpu")
    v = torch.randn(6, 4)
    out = []
    for sbp in (split(0), split(1), B, P):
        x = sbpflow.tensor(v, placement=pl, sbp=sbp)
        xt = x.t()
        got = (x.is_floating_point(), x.is_complex(), x.is_signed(), x.stride(), xt.stride(),
               x.is_contiguous(), x.nbytes, x.itemsize, x.element_size(), x.layout, x.is_cpu,
               x.is_cuda, x.get_device(), x.dim_order(), xt.dim_order(), x.ndimension(),
               x.nelement(), tuple(x.mT.shape), x.is_same_size(xt.t()), x.is_distributed(),
               x.is_conj(), x.is_neg(), x.name)
        want = (v.is_floating_point(), v.is_complex(), v.is_signed(), v.stride(),
                v.t().stride(), v.is_contiguous(), v.nbytes, v.itemsize, v.element_size(),
                v.layout, v.is_cpu, v.is_cuda, v.get_device(), v.dim_order(),
                v.t().dim_order(), v.ndimension(), v.nelement(), tuple(v.mT.shape),
                v.is_same_size(v), True, v.is_conj(), v.is_neg(), v.name)
        out.append((str(sbp), got == want, got, want))
    one = sbpflow.tensor(torch.tensor([2.0]), placement=pl, sbp=split(0))
    out.append(("is_nonzero", one.is_nonzero(), True, True))
    return out


def test_metadata_of_global_tensors_is_the_logical_tensors(dist_run):
    for rows in dist_run(2, _metadata):
        for name, ok, got, want in rows:
            assert ok, (name, got, want)


def test_metadata_of_local_tensors_is_torchs():
    v = torch.randn(6, 4)
    x = sbpflow.tensor(v)
    assert x.stride() == v.stride() and x.t().stride() == v.t().stride()
    assert x.stride(1) == 1 and x.nbytes == v.nbytes and x.dim_order() == v.dim_order()
    assert x.byte().dtype == torch.uint8 and x.char().dtype == torch.int8
    assert x.short().dtype == torch.int16 and x.cfloat().dtype == torch.complex64
    with pytest.raises(RuntimeError, match="more than one value"):
        x.is_nonzero()
    with pytest.raises(RuntimeError, match="1D tensors expected"):
        x.dot(x)
    with pytest.raises(RuntimeError, match="imag is not implemented"):
        x.imag  # noqa: B018
    assert x.real is x and x.conj() is x and x.positive() is x


def _inplace_views():
    pl = sbpflow.placement.all("cpu")
    out = []
    v = torch.arange(24.0).reshape(4, 1, 6)
    for sbp in (split(0), split(2), B):
        x = sbpflow.tensor(v, placement=pl, sbp=sbp)
        x.squeeze_(1)
        x.t_()
        x.unsqueeze_(0)
        x.transpose_(0, 2)
        want = v.squeeze(1).t().unsqueeze(0).transpose(0, 2)
        out.append((str(sbp), tuple(x.shape) == tuple(want.shape) and
                    bool(np.array_equal(x.numpy(), want.numpy()))))
    w = sbpflow.tensor(v, placement=pl, sbp=split(0)).requires_grad_()
    try:
        w.t_() if w.ndim == 2 else w.squeeze_(1)
        out.append(("leaf", False))
    except RuntimeError as e:
        out.append(("leaf", "leaf Variable" in str(e)))
    return out


def test_inplace_view_ops_change_a_global_tensors_layout(dist_run):
    for rows in dist_run(2, _inplace_views):
        for name, ok in rows:
            assert ok, name


_FILLS = [("uniform_", (-2.0, 3.0)), ("normal_", (1.0, 0.5)), ("cauchy_", (0.0, 1.0)),
          ("exponential_", (2.0,)), ("geometric_", (0.3,)), ("log_normal_", (0.0, 0.5)),
          ("random_", (0, 10)), ("bernoulli_", (0.3,))]


def _random_fills():
    pl = sbpflow.placement.all("cpu")
    out = []
    for name, args in _FILLS:
        for sbp in (split(0), split(1), B, P):
            x = sbpflow.zeros(5, 6, placement=pl, sbp=sbp)
            torch.manual_seed(11)
            getattr(x, name)(*args)
            torch.manual_seed(11)
            want = getattr(torch.zeros(5, 6), name)(*args)
            out.append((name, str(sbp), bool(np.array_equal(x.numpy(), want.numpy()))))
    return out


def test_inplace_random_fills_equal_torchs_on_every_layout(dist_run):
    """Layout invariance: with one seed the global tensor equals torch's on one process."""
    for rows in dist_run(2, _random_fills):
        bad = [r for r in rows if not r[2]]
        assert not bad, bad


def test_inplace_random_fill_of_a_local_tensor_is_torchs():
    for name, args in _FILLS:
        torch.manual_seed(3)
        x = getattr(sbpflow.zeros(4, 3), name)(*args)
        torch.manual_seed(3)
        assert torch.equal(x.to_torch(), getattr(torch.zeros(4, 3), name)(*args)), name
    w = sbpflow.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        w.uniform_()
