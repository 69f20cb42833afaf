"""``sbpflow._C`` (OneFlow's functional namespace, as LiBai calls it) against plain torch
references written from OneFlow's definitions (its functors, kernels and tests; see
``sbpflow/_C.py``): every case in local mode, then on 2 ranks with global inputs on the
layouts LiBai uses (batch split, B, tensor-parallel splits, class-split logits), values and
gradients through ``_oracle.run_case``; the layouts the tensor-parallel cases produce and
the collectives they run; errors."""

from __future__ import annotations

import math

import _oracle as oracle
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from _oracle import Input

import sbpflow
import sbpflow as oneflow  # the way a OneFlow user imports it
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1, S2, S3 = split(0), split(1), split(2), split(3)
C = oneflow._C


def _either(ours, ref):
    """A case function: ``ours`` on sbpflow tensors, the torch reference ``ref`` otherwise."""
    def fn(*xs):
        return ours(*xs) if isinstance(xs[0], sbpflow.Tensor) else ref(*xs)
    return fn


def _ints(shape, high, low=0):
    return Input(lambda g: torch.randint(low, high, shape, generator=g), grad=False)


def _bools(shape, p_true=0.7):
    return Input(lambda g: torch.rand(shape, generator=g) < p_true, grad=False)


# ------------------------------------------------------------------ torch references
# Written from OneFlow's definitions, not from sbpflow's code.
def _mm(a, b, ta=False, tb=False, alpha=1.0):  # broadcast_matmul with transposes, alpha
    return alpha * torch.matmul(a.transpose(-2, -1) if ta else a, b.transpose(-2, -1) if tb else b)


def _ln(x, begin, eps):  # layer_norm op, center and scale off: biased variance
    dims = tuple(range(begin, x.ndim))
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _rms(x, w, ns, eps):  # rms_norm kernel: x * rsqrt(mean(x^2) + eps) * weight
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y if w is None else y * w


def _sparse_ce(logits, label):  # sparse_softmax_cross_entropy's out: -log(prob[label])
    return -torch.log_softmax(logits, -1).gather(-1, label.unsqueeze(-1)).squeeze(-1)


def _tf_gather(x, idx, axis):  # gather op: x.shape[:axis] + idx.shape + x.shape[axis+1:]
    return x[(slice(None),) * axis + (idx,)]


def _bias(a, b, axis):  # bias_add along axis
    shape = [1] * a.ndim
    shape[axis] = b.shape[0]
    return a + b.reshape(shape)


def _tril_softmax(x, p, diagonal, scale, fill):  # the fused kernel, then torch's dropout
    rows, cols = x.shape[-2:]
    keep = torch.ones(rows, cols, dtype=torch.bool).tril(diagonal)
    soft = torch.softmax(torch.where(keep, x * scale, torch.tensor(fill)), -1)
    return TF.dropout(soft, p), soft


def _mask_softmax(x, mask, fill, scale, p):  # OneFlow's test: x*mask*scale + fill*(1-mask)
    m = mask.to(x.dtype)
    soft = torch.softmax(x * m * scale + fill * (1.0 - m), -1)
    return TF.dropout(soft, p), soft


def _self_attention(h, head_size, alpha):  # test_fused_self_attention.py's reference
    seq, batch, _ = h.shape
    r = h.reshape(seq, batch, -1, 3 * head_size)
    q, k, v = (r[..., i * head_size:(i + 1) * head_size].permute(1, 2, 0, 3) for i in range(3))
    return alpha * torch.matmul(q, k.transpose(2, 3)), v


def _seeded(fn):
    """``fn`` after seeding torch (the same dropout mask in the reference and on every
    rank: sbpflow's dropout equals torch's for the same seed, whatever the layout)."""
    def run(*xs):
        torch.manual_seed(1234)
        return fn(*xs)
    return run


# ------------------------------------------------------------------ the cases
# name -> (fn, inputs, {"layouts": per-input 1-D SBPs tried on 2 ranks, oracle options}).
CASES = {
    # LiBai's Linear / lm head: x (batch, seq, in) @ w (out, in)^T; column-parallel w S(0),
    # row-parallel x S(2) with w S(1) (P output), data parallel x S(0).
    "matmul_linear": (
        _either(lambda x, w: C.matmul(x, w, transpose_b=True, alpha=0.5),
                lambda x, w: _mm(x, w, tb=True, alpha=0.5)),
        [(4, 3, 6), (5, 6)],
        {"layouts": [(S0, B), (B, S0), (S2, S1), (P, B)]}),
    # Batched, transpose_a (attention-like): split batch, contracted split (P), split n.
    "matmul_batched": (
        _either(lambda a, b: C.matmul(a, b, transpose_a=True),
                lambda a, b: _mm(a, b, ta=True)),
        [(4, 6, 3), (4, 6, 5)],
        {"layouts": [(S0, S0), (S1, S1), (B, S2)]}),
    # LiBai's ParallelCrossEntropyLoss: (batch, seq, vocab) logits, vocab split (P loss).
    "sparse_softmax_cross_entropy": (
        _either(C.sparse_softmax_cross_entropy, _sparse_ce),
        [(4, 3, 10), _ints((4, 3), 10)],
        {"layouts": [(S0, S0), (S2, B), (S2, S1), (B, B)]}),
    # BERT's sop loss: cross_entropy(logits, labels, ignore_index=-1, reduction='none').mean()
    "cross_entropy": (
        _either(lambda x, t: C.cross_entropy(x, t, None, -1, "none").mean(),
                lambda x, t: TF.cross_entropy(x, t, ignore_index=-1, reduction="none").mean()),
        [(6, 5), _ints((6,), 5, low=-1)],
        {"layouts": [(S0, S0), (S1, B), (B, B)]}),
    # Word embedding: gather(weight, ids, axis=0); vocabulary-parallel weight S(0) gives P.
    "gather_embedding": (
        _either(lambda w, i: C.gather(w, i, axis=0), lambda w, i: _tf_gather(w, i, 0)),
        [(10, 4), _ints((3, 5), 10)],
        {"layouts": [(S0, B), (B, S0), (S1, S1)]}),
    "gather_axis1": (
        _either(lambda x, i: C.gather(x, i, 1), lambda x, i: _tf_gather(x, i, 1)),
        [(3, 7, 2), _ints((2, 2), 7)],
        {"layouts": [(S0, B), (B, S0), (S2, B)]}),
    "layer_norms": (
        _either(lambda x, g, b: C.layer_norm_affine(x, g, b, begin_norm_axis=-1,
                                                    begin_params_axis=2, epsilon=1e-5)
                + 0.5 * C.layer_norm(x, 1, 1, 1e-5),
                lambda x, g, b: _ln(x, 2, 1e-5) * g + b + 0.5 * _ln(x, 1, 1e-5)),
        [(4, 3, 6), (6,), (6,)],
        {"layouts": [(S0, B, B), (S1, B, B), (S2, B, B)], "rtol": 1e-4, "atol": 1e-5}),
    "rms_norms": (
        _either(lambda x, w: C.rms_norm(x, w, w.shape, 1e-6)
                + C.rms_norm(x, normalized_shape=(3, 6), epsilon=1e-5),
                lambda x, w: _rms(x, w, (6,), 1e-6) + _rms(x, None, (3, 6), 1e-5)),
        [(4, 3, 6), (6,)],
        {"layouts": [(S0, B), (S1, B), (B, B)], "rtol": 1e-4, "atol": 1e-5}),
    # Activations, the amp marks, both transpose forms.
    "activations_transpose": (
        _either(lambda x: C.gelu(x) + 2 * C.quick_gelu(x) + 3 * C.relu(x)
                + C.amp_white_identity(x) - C.amp_black_identity(x)
                + C.transpose(C.transpose(x, [1, 0]), 0, 1) * 0.5,
                lambda x: TF.gelu(x) + 2 * x * torch.sigmoid(1.702 * x) + 3 * torch.relu(x)
                + x * 0.5),
        [(5, 6)],
        {"layouts": [(S0,), (S1,), (P,)]}),
    # Column-parallel MLP: output S(last) with bias S(0); data parallel; other axis.
    "fused_bias_add_gelu": (
        _either(lambda a, b, c: C.fused_bias_add_gelu(a, b, axis=2)
                + C.fused_bias_add_gelu(a, c, axis=1),
                lambda a, b, c: TF.gelu(_bias(a, b, 2)) + TF.gelu(_bias(a, c, 1))),
        [(4, 3, 6), (6,), (3,)],
        {"layouts": [(S0, B, B), (S2, S0, B), (S1, B, S0)]}),
    "fused_bias_add_dropout": (
        _seeded(_either(lambda a, b: C.fused_bias_add_dropout(a, b, p=0.3, axis=-1)
                        + C.fused_bias_add_dropout(a, b, p=0.0, axis=2),
                        lambda a, b: TF.dropout(_bias(a, b, 2), 0.3) + _bias(a, b, 2))),
        [(4, 3, 6), (6,)],
        {"layouts": [(S0, B), (S2, S0), (P, B)]}),
    # Attention scores (batch, heads, tgt, src): splits of each dim (src: softmax's global
    # algorithm); returns (y, softmax_y).
    "fused_scale_tril_softmax_mask_scale": (
        _seeded(_either(lambda x: C.fused_scale_tril_softmax_mask_scale(
                            x, p=0.3, diagonal=1, tril_scale_value=0.5, tril_fill_value=-1e4),
                        lambda x: _tril_softmax(x, 0.3, 1, 0.5, -1e4))),
        [(2, 2, 5, 6)],
        {"layouts": [(S0,), (S1,), (S2,), (S3,), (P,)]}),
    "fused_scale_mask_softmax_dropout": (
        _seeded(_either(lambda x, m: C.fused_scale_mask_softmax_dropout(
                            x, m, fill_value=-1e4, scale=0.5, p=0.2),
                        lambda x, m: _mask_softmax(x, m, -1e4, 0.5, 0.2))),
        [(2, 2, 5, 6), _bools((2, 1, 5, 6))],
        {"layouts": [(S0, S0), (S1, B), (S3, S3), (P, B)]}),
    # (seq, batch, heads * 3 * head_size): batch split -> S(0), heads split -> S(1).
    "fused_self_attention": (
        _either(lambda h: (lambda qk, v: (qk @ v, qk, v))(
                    *C.fused_self_attention(h, head_size=3, alpha=0.7)),
                lambda h: (lambda qk, v: (qk @ v, qk, v))(*_self_attention(h, 3, 0.7))),
        [(5, 2, 18)],
        {"layouts": [(S1,), (S2,), (S0,)]}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_matches_torch(name):
    fails = oracle.check_local(name, CASES[name])
    assert fails == [], fails


def _run_cases():
    pl = sbpflow.placement.all("cpu")
    failures = []
    for name, case in sorted(CASES.items()):
        layouts = [tuple((s,) for s in combo) for combo in case[2]["layouts"]]
        failures += oracle.run_case(name, case, pl, layouts)
    return failures


def test_global_layouts_match_torch(dist_run):
    for failures in dist_run(2, _run_cases):
        assert failures == [], "\n".join(failures)


# ------------------------------------------------------------------ layouts and collectives
def _tensor_parallel_layouts():
    """(what, output sbp(s), collectives in forward) for the tensor-parallel uses."""
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)

    def glob(t, sbp):
        return sbpflow.tensor(t, placement=pl, sbp=sbp)

    out = []
    x, w = glob(torch.randn(4, 3, 6, generator=g), B), glob(torch.randn(8, 6, generator=g), S0)
    bias = glob(torch.randn(8, generator=g), S0)
    with CommRecorder() as rec:
        h = C.matmul(x, w, transpose_b=True)              # column-parallel linear
        y = C.fused_bias_add_gelu(h, bias, axis=h.ndim - 1)
    out.append(("column linear + bias gelu", (h.sbp, y.sbp), rec.count()))
    logits = glob(torch.randn(6, 10, generator=g), S1)
    label = glob(torch.randint(0, 10, (6,), generator=g), B)
    with CommRecorder() as rec:
        loss = C.sparse_softmax_cross_entropy(logits, label)
    out.append(("vocab-parallel loss", loss.sbp, rec.kinds()))
    table = glob(torch.randn(10, 4, generator=g), S0)
    ids = glob(torch.randint(0, 10, (3, 5), generator=g), B)
    with CommRecorder() as rec:
        emb = C.gather(table, ids, axis=0)
    out.append(("vocab-parallel gather", emb.sbp, rec.count()))
    hs = torch.randn(5, 2, 24, generator=g)  # 4 heads of size 2
    for what, sbp in (("self attention by heads", S2), ("self attention by batch", S1)):
        h = glob(hs, sbp)
        with CommRecorder() as rec:
            qk, v = C.fused_self_attention(h, head_size=2)
        out.append((what, (qk.sbp, v.sbp), rec.count()))
    ar = C.global_arange(1, 8, 2, placement=pl, sbp=S0)
    af = C.global_arange(end=5, placement=pl, sbp=[B], dtype=torch.float32)
    out.append(("global_arange", (ar.sbp, ar.dtype, ar.numpy().tolist(),
                                  tuple(ar.to_local().shape)),
                (af.sbp, af.dtype, af.numpy().tolist())))
    return out


def test_tensor_parallel_layouts_and_collectives(dist_run):
    for rows in dist_run(2, _tensor_parallel_layouts):
        got = {row[0]: row[1:] for row in rows}
        assert got["column linear + bias gelu"] == (((S2,), (S2,)), 0)
        sbp, kinds = got["vocab-parallel loss"]
        assert sbp == (P,) and "all_gather" not in kinds, kinds  # the logits stay split
        assert got["vocab-parallel gather"] == ((P,), 0)
        assert got["self attention by heads"] == (((S1,), (S1,)), 0)  # OneFlow's signatures
        assert got["self attention by batch"] == (((S0,), (S0,)), 0)
        (ar, af) = got["global_arange"]
        assert ar[:3] == ((S0,), torch.int64, [1, 3, 5, 7]) and ar[3] == (2,)
        assert af == ((B,), torch.float32, [0.0, 1.0, 2.0, 3.0, 4.0])


# ------------------------------------------------------------------ one process
def test_namespace_and_signatures():
    import inspect

    assert oneflow._C is sbpflow._C and "_C" in sbpflow.__all__
    for name in C.__all__:
        assert callable(getattr(C, name)), name
    sig = inspect.signature(C.fused_bias_add_dropout)
    assert sig.parameters["p"].default == 0.5 and \
        sig.parameters["axis"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(C.rms_norm).parameters["epsilon"].default == 1e-6
    assert inspect.signature(C.fused_self_attention).parameters["head_size"].default == 8


def test_transpose_forms_and_local_arange():
    x = sbpflow.randn(2, 3, 4)
    t = x.to_torch()
    for got, want in [(C.transpose(x, [2, 0, 1]), t.permute(2, 0, 1)),
                      (C.transpose(x, perm=(-1, 1, 0)), t.permute(2, 1, 0)),
                      (C.transpose(x, 0, 2), t.transpose(0, 2)),
                      (C.transpose(x, dim0=1, dim1=2), t.transpose(1, 2))]:
        assert torch.equal(got.to_torch(), want)
    pl = sbpflow.placement("cpu", [0])
    r = C.global_arange(start=0, end=1.0, step=0.25, placement=pl, sbp=B)
    assert r.is_global and r.dtype == torch.float32 and r.numpy().tolist() == [0, .25, .5, .75]


def test_fused_dropout_probabilities_and_eval():
    x = sbpflow.randn(4, 8)
    m = sbpflow.from_torch(torch.ones(4, 8, dtype=torch.bool))
    y, soft = C.fused_scale_mask_softmax_dropout(x, m, p=0.9, training=False)
    assert torch.equal(y.to_torch(), soft.to_torch())  # training=False: no dropout
    y, soft = C.fused_scale_tril_softmax_mask_scale(x, p=1.0, diagonal=0, tril_scale_value=1.0)
    assert not y.to_torch().any() and torch.allclose(soft.to_torch().sum(-1), torch.ones(4))
    b = sbpflow.zeros(8)
    assert not C.fused_bias_add_dropout(x, b, p=1.0, axis=1).to_torch().any()


@pytest.mark.parametrize("call,err,match", [
    (lambda x: C.matmul(x[0], x, transpose_a=True), ValueError, "1-D"),
    (lambda x: C.layer_norm(x, 1, 0, 1e-5), ValueError, "begin_norm_axis must equal"),
    (lambda x: C.layer_norm_affine(x, x[0], x[0, :2], 1, 1, 1e-5), ValueError, "beta"),
    (lambda x: C.rms_norm(x, x[0]), TypeError, "normalized_shape is required"),
    (lambda x: C.rms_norm(x, x[0, :2], (4,)), ValueError, "weight must have"),
    (lambda x: C.sparse_softmax_cross_entropy(x, x[:, 0]), TypeError, "integer"),
    (lambda x: C.sparse_softmax_cross_entropy(x, x[0].long()), ValueError, "label must"),
    (lambda x: C.gather(x, x, 0), TypeError, "integers"),
    (lambda x: C.transpose(x, [0, 0]), ValueError, "permutation"),
    (lambda x: C.transpose(x, 0), TypeError, "perm"),
    (lambda x: C.fused_bias_add_gelu(x, x[:, 0], axis=1), ValueError, "1-D of a's size"),
    (lambda x: C.fused_bias_add_dropout(x, x[0], p=1.5, axis=1), ValueError, r"\[0, 1\]"),
    (lambda x: C.fused_bias_add_dropout(x, x[0], axis=1, generator=torch.Generator()),
     NotImplementedError, "manual_seed"),
    (lambda x: C.fused_scale_mask_softmax_dropout(x, x), TypeError, "bool"),
    (lambda x: C.fused_self_attention(x, head_size=2), ValueError, "seq, batch"),
    (lambda x: C.fused_self_attention(x.reshape(3, 1, 4), head_size=3), ValueError,
     "multiple"),
    (lambda x: C.gelu(x.to_torch()), TypeError, "sbpflow.Tensor"),
    (lambda x: C.global_arange(placement=None, sbp=B), TypeError, "give end"),
    (lambda x: C.global_arange(3, placement=None, sbp=B), TypeError, "placement and sbp"),
])
def test_errors(call, err, match):
    with pytest.raises(err, match=match):
        call(sbpflow.randn(3, 4))


def test_reference_formulas_agree_with_torch_modules():
    # The references above, checked against torch where torch has the op: they are the
    # oracle, so they must be right.
    x = torch.randn(4, 3, 6)
    assert torch.allclose(_ln(x, 2, 1e-5), TF.layer_norm(x, (6,), eps=1e-5), atol=1e-5)
    assert torch.allclose(_rms(x, None, (3, 6), 1e-6), TF.rms_norm(x, (3, 6), eps=1e-6),
                          atol=1e-5)
    idx = torch.tensor([[0, 2], [1, 1]])
    assert torch.equal(_tf_gather(x, idx, 1),
                       x.index_select(1, idx.flatten()).reshape(4, 2, 2, 6))
    h = torch.randn(5, 2, 18)
    qk, v = _self_attention(h, 3, 1.0)
    assert qk.shape == (2, 2, 5, 5) and v.shape == (2, 2, 5, 3)
    assert math.isclose(float(_sparse_ce(x[0], torch.tensor([1, 0, 5])).sum()),
                        float(TF.cross_entropy(x[0], torch.tensor([1, 0, 5]), reduction="sum")),
                        rel_tol=1e-5)
    assert np.allclose(_mask_softmax(x, torch.ones(6, dtype=torch.bool), 0.0, 1.0, 0.0)[1],
                       torch.softmax(x, -1))
