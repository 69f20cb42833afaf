"""Dispatch and the chooser across op families (issue 9: one dispatch path).

* every registered op, global algorithms and in-place forms included, is reached from the
  public API (Tensor methods, ``sbpflow.<fn>``, ``sbpflow.nn.functional``) and runs through
  :func:`sbpflow.ops.dispatch.dispatch` / ``dispatch_inplace`` on global tensors (counted
  with :func:`sbpflow.ops.observe`), on 1 and 2 ranks;
* the methods and functions are generated from the families' declarations: a duplicate
  declaration raises, every in-place method has an in-place record, torch's functions
  route by identity;
* tables of the signatures chosen (and the collectives that run) for cases of the family
  files, written from the math; errors of mixed and invalid inputs; eager dispatch of
  local tensors."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch
from _oracle import S0, S1, S2

import sbpflow
import sbpflow.nn.functional as F
from sbpflow.distributed import CommRecorder
from sbpflow.ops import REGISTRY, api, observe
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split


def _all_cases():
    """The cases the tables below name, from their family files."""
    return oracle.all_cases("pointwise", "matmul", "reduce", "view", "index", "scan", "sort")


# (case, input nd-SBPs) -> (output SBP, collectives that may run). Written from the
# math, not from the rules: a local signature exists for each, so nothing may be gathered.
SIGNATURE_TABLE = [
    ("matmul", (S0, B), S0, []),
    ("matmul", (B, S1), S1, []),
    ("matmul", (S1, S0), P, []),
    ("add", (S0, S0), S0, []),
    ("add", (S1, S1), S1, []),
    ("add", (P, P), P, []),
    ("add_broadcast", (S0, B), S0, []),
    ("mul", (P, B), P, []),
    ("relu_tanh", (S1,), S1, []),
    ("relu_tanh", (B,), B, []),
    ("sum_dim", (S0,), S0, []),
    ("sum_dim", (S1,), P, []),
    ("sum_keepdim", (S1,), S1, []),
    ("scalars", (S0,), S0, []),
    ("mean_dim", (S0,), P, []),
    ("mean_dim", (S1,), S0, []),
    ("permute", (S0,), S1, []),
    ("transpose_t", (S0, S1), P, []),  # a.T is S(1), b.t() is S(0): contracted k
    ("reshape_merge_tail", (S0,), S0, []),
    ("reshape_heads", (S2,), S1, []),  # C = 4 heads x 2 split over heads, then transposed
    ("reshape_merge_lead", (S0,), S0, []),  # 4 x 6 rows merged: shards line up
    ("cat_dim1", (S0, S0), S0, []),
    ("stack", (S1, S1), S1, []),  # stacked on dim 1, then summed over it
]


def _signature_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want, want_comms in SIGNATURE_TABLE:
        fn, shapes = _all_cases()[name][:2]
        xs = [sbpflow.ones(*s, placement=pl, sbp=sb) for s, sb in zip(shapes, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want}")
    return problems


def test_signature_table(dist_run):
    results = dist_run(2, _signature_table)
    assert results[0] == [], "\n".join(results[0])


def test_local_ops_and_errors():
    x = sbpflow.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    y = (x @ x + 2 * x - 1).relu().sum()
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    u = (t @ t + 2 * t - 1).relu().sum()
    y.backward()
    u.backward()
    assert y.item() == u.item() and torch.equal(x.grad.to_torch(), t.grad)
    g = sbpflow.ones(2, 2, placement=sbpflow.placement("cpu", [0]), sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        x + g
    with pytest.raises(TypeError, match="expected an sbpflow.Tensor"):
        sbpflow.ops.dispatch("add", x, torch.ones(2))


# ------------------------------------------------------------------ errors (issue 3 item 7)
def _error_messages():
    pl = sbpflow.placement.all("cpu")
    sub = sbpflow.placement("cpu", [0])
    x = sbpflow.ones(7, 5, placement=pl, sbp=S0)
    with pytest.raises(ValueError, match="different placements"):
        x + sbpflow.ones(7, 5, placement=sub, sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        x * sbpflow.ones(7, 5)
    with pytest.raises(ValueError, match=r"S\(2\) splits dim 2, but the tensor has 2 dims"):
        sbpflow.ones(7, 5).to_global(pl, split(2))
    with pytest.raises(ValueError, match=r"S\(-3\) splits dim -3"):
        sbpflow.tensor(np.ones((7, 5)), placement=pl, sbp=split(-3))
    with pytest.raises(ValueError, match=r"add: invalid inputs of global shapes \(7, 5\), "
                                         r"\(3,\) laid out \(S\(0\),\), \(B,\)"):
        x + sbpflow.ones(3, placement=pl, sbp=B)
    with pytest.raises(ValueError, match=r"matmul: invalid inputs of global shapes"):
        x @ sbpflow.ones(3, 2, placement=pl, sbp=B)
    with pytest.raises(ValueError, match="clamp: at least one"):
        x.clamp()
    with pytest.raises(ValueError, match="rounding_mode"):
        x.div(2, rounding_mode="round")
    with pytest.raises(ValueError, match="0-dimensional value tensor"):
        x.masked_fill(x > 0, sbpflow.ones(2, placement=pl, sbp=B))
    with pytest.raises(ValueError, match="to_global"):
        x.to("cuda")
    assert x.to("cpu") is x and x.to(torch.float32) is x
    return "ok"


def test_error_messages(dist_run):
    dist_run(2, _error_messages)


# ------------------------------------------------------------------ signature table
def _ones_f32(shape, sbp, pl):
    return sbpflow.ones(*shape, placement=pl, sbp=sbp)


# ------------------------------------------------------------------ errors
def _elementwise_global_errors():
    pl = sbpflow.placement.all("cpu")
    x = _ones_f32((4, 3), P, pl) * 1
    x.expm1_()  # no signature keeps P: the logical value, written back as P
    assert x.sbp == (P,) and np.allclose(x.numpy(), np.full((4, 3), np.expm1(1.0), np.float32))
    with pytest.raises(TypeError, match="global but an argument is local"):
        _ones_f32((4, 3), S0, pl).atan2_(sbpflow.ones(4, 3))
    return "ok"


def test_global_errors(dist_run):
    assert dist_run(2, _elementwise_global_errors) == ["ok", "ok"]


# (case, input nd-SBPs, output SBP). Written from the math: each has a local signature,
# so no collective may run.
NO_COLLECTIVE_TABLE = [
    ("ri_heads", (S1,), S1),  # GQA: each rank repeats its own heads
    ("ri_heads", (S0,), S0),
    ("ri_int_dim1", (S0,), S0),
    ("index_add_0", (S1, B, S1), S1),
    ("index_add_0", (P, S0, S0), P),  # each rank adds its part of the source
    ("index_add_0", (P, B, P), P),
    ("index_fill_1", (S0, B), S0),
    ("cumprod_0", (S1,), S1),
    ("diagonal_batch", (S0,), S0),
    ("diag_embed", (S0,), S0),
    ("cdist", (S0, B), S0),
    ("cdist", (B, S0), S1),
    ("bucketize", (S1, B), S1),
    ("addmm", (P, S1, S0), P),  # a contracted split: P plus a P input
]


def _no_collective_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want in NO_COLLECTIVE_TABLE:
        fn, inputs = _all_cases()[name][:2]
        values, _ = oracle._values(name, inputs)
        xs = [sbpflow.tensor(v, placement=pl, sbp=s) for v, s in zip(values, ins)]
        with CommRecorder() as rec:
            out = oracle._first(fn(*xs))
        if out.sbp != (want,) or rec.kinds() != []:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want}")
    # GQA shapes: (batch, kv heads, seq, head size) with the heads split over the ranks.
    k = sbpflow.randn(2, 4, 6, 8, placement=pl, sbp=S1, requires_grad=True)
    with CommRecorder() as rec:
        out = k.repeat_interleave(2, dim=1)
        out.backward(sbpflow.ones(*out.shape, placement=pl, sbp=S1))
    if out.sbp != (S1,) or rec.kinds() != []:
        problems.append(f"GQA repeat: {out.sbp} with {rec.kinds()}")
    return problems


def test_no_collective_table(dist_run):
    results = dist_run(2, _no_collective_table)
    assert results[0] == [], "\n".join(results[0])


def _where_sbpflow():
    return sbpflow.__file__


def test_ranks_import_this_worktree(dist_run):
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert all(f.startswith(here) for f in dist_run(2, _where_sbpflow))


# (case, input nd-SBPs on 2 ranks) -> (output SBP, collectives that may run), from the
# math: each has a signature that needs no gather of the input.
SHAPE_INDEX_TABLE = [
    ("getitem_cols", (S0,), S0, []),             # x[:, 1:] on S(0): a local slice
    ("getitem_keep_split", (S0,), S0, []),
    # x[1:, ::2] slices the split dim: gathered once (the chooser never pads a shard into
    # a P summand, whose all-reduce downstream would cost more).
    ("getitem_slices", (S1,), B, ["all_gather"]),
    ("getitem_tensor", (S1, B), S1, []),
    ("getitem_tensor", (B, S0), S0, []),         # a split index splits the output
    ("squeeze_dim", (S2,), S1, []),               # renumbered
    ("unsqueeze", (S1,), S2, []),                 # a.unsqueeze(1) + ...: S(1) -> S(2)
    ("expand", (S0,), S1, []),
    ("repeat", (S0,), S1, []),
    ("flip", (S1,), S1, []),
    ("tril_triu", (S0,), S0, []),
    ("gather", (S0, S0), S0, []),
    ("index_select", (B, S0), S0, []),
    ("index_select", (S1, B), S1, []),
    ("scatter", (S0, S0, S0), S0, []),
    ("contiguous_clone", (S0,), S1, []),
    ("one_hot", (S1,), S1, []),
]


def _shape_index_table():
    pl = sbpflow.placement.all("cpu")
    problems = []
    for name, ins, want, want_comms in SHAPE_INDEX_TABLE:
        fn, inputs = _all_cases()[name][:2]
        values, _ = oracle._values(name, inputs)
        xs = [sbpflow.tensor(v, placement=pl, sbp=sb) for v, sb in zip(values, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds() != want_comms:
            problems.append(f"{name}{ins}: got {out.sbp} with {rec.kinds()}, want {want} "
                            f"with {want_comms}")
    # scatter_add with the index and source split along dim: P, no communication.
    x = sbpflow.zeros(5, 7, placement=pl, sbp=B)
    i = sbpflow.tensor(torch.randint(0, 7, (5, 6)), placement=pl, sbp=S1)
    s = sbpflow.ones(5, 6, placement=pl, sbp=S1)
    with CommRecorder() as rec:
        out = x.scatter_add(1, i, s)
    if out.sbp != (P,) or rec.kinds():
        problems.append(f"scatter_add split dim: {out.sbp} with {rec.kinds()}")
    return problems


def test_shape_index_table(dist_run):
    results = dist_run(2, _shape_index_table)
    assert results[0] == [], "\n".join(results[0])


# ------------------------------------------------------------------ the one dispatch path
def _calls(pl, nd):
    """(what, fn) pairs covering the public API on global tensors laid out ``nd``."""

    def fit(shape, sbp):  # the layout, B on axes that split a dim the shape lacks
        return tuple(s if not s.is_split() or s.dim < len(shape) else B for s in sbp)

    def g(*shape, dtype=torch.float32, low=0.1, high=0.9, sbp=None):
        gen = torch.Generator().manual_seed(sum(shape) + 7)
        t = torch.rand(*shape, generator=gen) * (high - low) + low
        return sbpflow.tensor(t.to(dtype), placement=pl, sbp=fit(shape, sbp or nd))

    def ints(*shape, high=4, sbp=None):
        gen = torch.Generator().manual_seed(sum(shape))
        return sbpflow.tensor(torch.randint(0, high, shape, generator=gen), placement=pl,
                              sbp=fit(shape, sbp or (B,) * pl.ndim))

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
        lambda: F.threshold(x, 0.5, 0.0), lambda: F.dropout(x, 0.5),
        # structured nn ops (issue 21)
        lambda: F.conv3d(g(1, 2, 3, 3, 3), g(3, 2, 2, 2, 2)),
        lambda: F.conv_transpose3d(g(1, 2, 3, 3, 3), g(2, 3, 2, 2, 2)),
        lambda: F.conv_tbc(g(5, 2, 3), g(2, 3, 4), g(4)),
        lambda: F.max_pool3d(g(1, 2, 4, 4, 4), 2), lambda: F.avg_pool3d(g(1, 2, 4, 4, 4), 2),
        lambda: F.adaptive_avg_pool3d(g(1, 2, 4, 4, 4), 2),
        lambda: F.adaptive_max_pool1d(g(2, 3, 6), 2),
        lambda: F.adaptive_max_pool3d(g(1, 2, 4, 4, 4), 2),
        lambda: F.max_unpool1d(*F.max_pool1d(g(2, 3, 6), 2, return_indices=True), 2),
        lambda: F.max_unpool2d(*F.max_pool2d(g(1, 2, 4, 4), 2, return_indices=True), 2),
        lambda: F.max_unpool3d(*F.max_pool3d(g(1, 2, 4, 4, 4), 2, return_indices=True), 2),
        lambda: F.fractional_max_pool2d(g(1, 2, 5, 5), 2, output_size=2),
        lambda: F.fractional_max_pool3d(g(1, 2, 5, 5, 5), 2, output_size=2),
        lambda: F.fold(F.unfold(g(1, 2, 4, 4), 2), (4, 4), 2),
        lambda: F.local_response_norm(g(1, 4, 3, 3), 2), lambda: F.channel_shuffle(g(1, 4, 2), 2),
        lambda: sbpflow.nn.CrossMapLRN2d(3)(g(1, 4, 2, 2)),
        lambda: F.grid_sample(g(1, 2, 3, 3), F.affine_grid(g(1, 2, 3), [1, 2, 4, 4], False),
                              align_corners=False),
        lambda: F.pdist(x),
        lambda: ints(6, sbp=nd).reshape(-1).bincount(), lambda: x.histc(4),
        # torch's other Tensor names and functions (issue 21)
        lambda: x.add(y, alpha=2), lambda: x.subtract(y, alpha=0.5),
        lambda: g(6).dot(g(6)), lambda: x.mv(g(6)), lambda: i4.gcd(i4 + 1), lambda: i4.lcm(i4 + 1),
        lambda: i4.bitwise_left_shift(i4), lambda: i4.bitwise_left_shift(1),
        lambda: i4.bitwise_right_shift(i4), lambda: i4.bitwise_right_shift(1),
        lambda: (x + 1).mvlgamma(2), lambda: x.polygamma(1), lambda: x.unfold(1, 2, 1),
        lambda: x.renorm(2, 0, 1.0), lambda: x.put(idx, g(2)), lambda: x.masked_scatter(b, y),
        lambda: x.scatter_reduce(1, ints(4, 2), y[:, :2], "amax"),
        lambda: x.index_reduce(0, idx, g(2, 6), "amax"),
        lambda: x.cov(fweights=ints(6, high=3) + 1, aweights=g(6)),
        lambda: sbpflow.isin(i4, ints(3)),
    ] + [lambda spd=spd, name=name: getattr(spd(), name)() for name in (
        "det", "logdet", "slogdet", "inverse", "matrix_exp", "cholesky", "geqrf")
         for spd in [lambda: _spd(g)]] + [
        lambda: _spd(g).matrix_power(2), lambda: _spd(g).cholesky().cholesky_inverse(),
        lambda: g(4, 2).cholesky_solve(_spd(g).cholesky()),
        lambda: g(4, 2).lu_solve(*_spd(g).lu()), lambda: g(4, 2).triangular_solve(_spd(g)),
        lambda: _spd(g).geqrf()[0].orgqr(_spd(g).geqrf()[1]),
        lambda: _spd(g).geqrf()[0].ormqr(_spd(g).geqrf()[1], g(4, 4)),
    ] + [lambda n=n: getattr(F, n)(x) for n in (
        "celu", "elu", "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu",
        "logsigmoid", "mish", "relu6", "selu", "softshrink", "softsign", "tanhshrink")]
    manual += [  # issue 21's losses and grouped GEMM
        lambda: F.poisson_nll_loss(x, y), lambda: F.hinge_embedding_loss(x, y),
        lambda: F.soft_margin_loss(x, y), lambda: F.gaussian_nll_loss(x, y, y),
        lambda: F.multi_margin_loss(x, ints(4, high=6)),
        lambda: F.multilabel_margin_loss(x, ints(4, 6, high=6)),
        lambda: F.ctc_loss(g(5, 4, 6).log_softmax(2), ints(4, 2, high=6), ints(4, high=1) + 5,
                           ints(4, high=3)),
        lambda: F.grouped_mm(g(2, 4, 8), g(2, 8, 4)),
        # a column-split table's bags (the registered nn.embedding_bag)
        lambda: F.embedding_bag(ints(4, 3, high=5), g(5, 3, sbp=(split(1),) * pl.ndim))]
    calls += [(f"manual call {k}", fn) for k, fn in enumerate(manual)]
    return calls


# In-place methods that run no op: views that change only the tensor's metadata (its
# shape and layout), and identities of real tensors.
_METADATA_INPLACE = {"t_", "transpose_", "swapaxes_", "swapdims_", "squeeze_", "unsqueeze_",
                     "as_strided_", "conj_physical_"}


def _spd(g):
    """A symmetric positive definite 4 x 4 (the factorizations' input)."""
    m = g(4, 4)
    return m @ m.t() + (g(4) * 0 + 4).diag()


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
        if what.startswith("x.") and what.endswith("_") and what[2:] not in _METADATA_INPLACE \
                and not any(r.inplace for r in records):
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
    with pytest.raises(TypeError, match="sbpflow has no op of that name"):
        torch.fft.fft(x)


def test_tensor_stub_is_up_to_date():
    """sbpflow/tensor.pyi (IDE completion of the generated methods) matches the live class;
    regenerate with python3 scripts/gen_tensor_stub.py."""
    import subprocess
    import sys
    from pathlib import Path

    from _procs import command_env  # this checkout first on the path, installed or not

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "gen_tensor_stub.py"),
                          "--check"], capture_output=True, text=True, timeout=120,
                         env=command_env())
    assert out.returncode == 0, out.stdout + out.stderr
