"""nn.functional ops (sbpflow/ops/nn): softmax/log_softmax, cross entropy and the losses,
conv, pools, norms, attention, embedding, padding, interpolation, activations.

The cases (``CASES``) run through ``_oracle.sweep_tests``."""

from __future__ import annotations

import _oracle as oracle
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from _oracle import S0, S1, S2, S3, Input, nnf, some_of, uniform

import sbpflow
import sbpflow.nn.functional as SF
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P


def nn_of(x):
    """``torch.nn.functional`` for torch tensors, ``sbpflow.nn.functional`` for ours."""
    return SF if isinstance(x, sbpflow.Tensor) else TF


def signs(shape) -> Input:
    """A float input of +1/-1 (ranking and embedding targets; not differentiated)."""
    return Input(lambda g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1, grad=False)


def _activations(a):
    F = nn_of(a)
    return (F.hardswish(a * 3) + F.hardsigmoid(a * 3) + F.mish(a) + F.logsigmoid(a)
            + F.softsign(a) + F.relu6(a * 4) + F.hardtanh(a, -0.5, 0.7) + F.selu(a)
            + F.celu(a, 0.7) + F.elu(a, 0.5) + F.leaky_relu(a, 0.2) + F.threshold(a, 0.1, -2.0)
            + F.tanhshrink(a) + F.softshrink(a, 0.3) + F.hardshrink(a, 0.4) + F.leaky_relu(a))


def _activations_inplace(a):
    F = nn_of(a)
    y = _activations(a) * 0.1 + F.softmin(a, 1) + F.softmin(a, dim=0)
    y = y + a * 2
    F.hardswish(y, inplace=True)
    z = a * 1
    F.leaky_relu(z, 0.3, inplace=True)
    w = a * 1
    F.threshold(w, 0.2, 5.0, inplace=True)
    return y + z + w


def _kl_div(x, t):
    F = nn_of(x)
    logt = t.log()
    return (F.kl_div(x, t, reduction="batchmean") + F.kl_div(x, t, reduction="sum") * 0.1
            + F.kl_div(x, logt, reduction="mean", log_target=True))


def _regression_losses(a, b):
    F = nn_of(a)
    return (F.smooth_l1_loss(a, b, beta=0.5) + F.smooth_l1_loss(a, b, reduction="sum") * 0.1
            + F.huber_loss(a, b, delta=0.7) + F.huber_loss(a, b, reduction="sum") * 0.2
            + F.smooth_l1_loss(a, b, beta=0.0))


def _bce(p, t, w):
    F = nn_of(p)
    return (F.binary_cross_entropy(p, t, weight=w) + F.binary_cross_entropy(p, t, reduction="sum")
            * 0.1)


def w(shape, layouts):
    """A differentiable float input tried only in ``layouts``."""
    return Input(lambda g, s=tuple(shape): torch.randn(s, generator=g), layouts=layouts)


def _targets(n, c, ignore=()):
    def make(g):
        t = torch.randint(0, c, n, generator=g)
        for i in ignore:
            t.view(-1)[i] = -100
        return t

    return Input(make, grad=False)


def _positive(shape):
    return Input(lambda g: torch.rand(shape, generator=g) + 0.5, grad=False)


def _probs(shape):
    return Input(lambda g: torch.softmax(torch.randn(shape, generator=g), 1), grad=False)


def _act(a):
    f = nnf(a)
    return (f.relu(a) + f.gelu(a) * f.gelu(a, approximate="tanh") + f.silu(a)
            + f.softplus(a, beta=2.0, threshold=1.0) * f.sigmoid(a) - f.tanh(a))

W4 = (S0, S1, B, P)

X4D = (S0, S1, S2, B, P)


def _pos(*s):
    return oracle.Input(lambda g: torch.rand(s, generator=g) * 0.9 + 0.05)


# ---------------------------------------------------------------- structured ops (issue 21)
# Several ops per case (the shapes chain), so that the sweeps stay short: every op meets
# the layouts its predecessor produces (conv3d's S(0), S(1), P...) as well as the inputs'.
def _conv3d_pools3d(x, w_, b):
    f = nnf(x)
    y = f.conv3d(x, w_, b, padding=1)  # (2, 4, 5, 6, 5)
    return (f.max_pool3d(y, 2) + f.avg_pool3d(y, 2, padding=1, count_include_pad=False)[
        :, :, :2, 1:, :2] + f.adaptive_avg_pool3d(y, (2, 3, 2)) + f.adaptive_max_pool3d(
        y, (2, 3, 2)) + f.lp_pool3d(y, 2, 2), f.max_pool3d(y, 2, return_indices=True)[1],
        f.adaptive_max_pool3d(y, 3, return_indices=True)[1])


def _conv_transpose3d_unpool3d(x, w_):
    f = nnf(x)
    y = f.conv_transpose3d(x, w_, stride=2)  # (2, 3, 6, 6, 4)
    v, i = f.max_pool3d(y, 2, return_indices=True)
    return f.max_unpool3d(v, i, 2) + y * 0.5


def _unpool_lp_1d_2d(x3, x4):
    f = nnf(x3)
    v, i = f.max_pool1d(x3, 3, return_indices=True)
    u = f.max_unpool1d(v, i, 3, output_size=(10,))[..., :9]  # (3, 4, 9)
    y1 = f.lp_pool1d(u + x3, 2, 3) + f.adaptive_max_pool1d(x3, 3)  # (3, 4, 3)
    v, i = f.max_pool2d(x4, 2, return_indices=True)
    u = f.max_unpool2d(v, i, 2)  # (3, 4, 6, 6)
    y2 = f.lp_pool2d(u + x4, 2.0, (2, 3), stride=(2, 3)) + f.lp_pool2d(x4, float("inf"), 2)[
        ..., :2]  # (3, 4, 3, 2)
    return y2 + y1.unsqueeze(-1)[..., :1].sum(-1, keepdim=True)


def _fold_lrn_shuffle(x):
    f = nnf(x)
    cols = f.unfold(x, (2, 3), padding=1, stride=(1, 2))  # (3, 36, 18)
    return (f.fold(cols * 0.5, (5, 4), (2, 3), padding=1, stride=(1, 2))
            + f.local_response_norm(x, 3, alpha=0.1, k=2.0) + f.channel_shuffle(x, 3))


def _affine_grid_sample(theta, x):
    f = nnf(x)
    grid = f.affine_grid(theta * 0.5, [3, 4, 4, 5], align_corners=False)
    return (f.grid_sample(x, grid, align_corners=False)
            + f.grid_sample(x, grid, mode="nearest", padding_mode="border", align_corners=True))


def _bilinear_pdist(a, b, w_, bias):
    f = nnf(a)
    return f.pdist(f.bilinear(a, b, w_, bias), 1.5)


CASES = {
    # Exhaustive 2x2: all combinations up to 36, else a covering set.
    **oracle.policy({
        "activations_softmin_inplace": (_activations_inplace, [(7, 5)]),
        "glu_last": (lambda a: nn_of(a).glu(a), [(3, 7, 6)]),
        "glu_dim0": (lambda a: nn_of(a).glu(a, 0), [(6, 5)]),
        "prelu_channels": (lambda x, w: nn_of(x).prelu(x, w), [(5, 3, 4), some_of((3,), S0, P)]),
        "prelu_single": (lambda x, w: nn_of(x).prelu(x, w), [(7, 5), some_of((1,), B, P)]),
        "kl_div": (_kl_div, [(7, 5), uniform((7, 5), 0.05, 1.0, layouts=(S1, B))]),
        "regression_losses": (_regression_losses, [(7, 5), some_of((7, 5), S0, P)]),
        "bce_weight": (_bce, [uniform((7, 5), 0.05, 0.95),
                              uniform((7, 5), 0.0, 1.0, grad=False, layouts=(S1, B)),
                              uniform((5,), 0.5, 1.5, grad=False, layouts=(S0, B))]),
        "margin_ranking": (lambda a, b, y: nn_of(a).margin_ranking_loss(a, b, y, margin=0.2)
                           + nn_of(a).margin_ranking_loss(a, b, y, reduction="sum"),
                           [(7,), some_of((7,), S0, P), signs((7,))]),
        "cosine_similarity_pairwise": (lambda a, b: nn_of(a).cosine_similarity(a, b)
                                       + nn_of(a).pairwise_distance(a, b)
                                       + nn_of(a).pairwise_distance(a, b, p=1.0),
                                       [(7, 5), some_of((7, 5), S1, P)]),
        "cosine_embedding_loss": (lambda a, b, y: nn_of(a).cosine_embedding_loss(a, b, y,
                                                                                 margin=0.1),
                                  [(7, 5), some_of((7, 5), S1, B),
                                   Input(signs((7,)).make, False, (S0,))]),
        "triplet_margin_loss": (lambda a, p, n: nn_of(a).triplet_margin_loss(a, p, n, margin=0.5,
                                                                           swap=True),
                                [(7, 5), some_of((7, 5), S0, B), some_of((7, 5), P)]),
    }, full_2x2_max=36),
    # Large products: a covering sample of 1-D layouts (all of them when exhaustive),
    # 3 sampled 2x2, a 2x2 covering set when exhaustive; local gradients weighted.
    **oracle.policy({
        "conv1d": (lambda x, w_, b: nnf(x).conv1d(x, w_, b, stride=2, padding=1),
                   [(3, 4, 9), w((6, 4, 3), W4), (6,)]),
        "conv2d_same": (lambda x, w_, b: nnf(x).conv2d(x, w_, b, padding="same", dilation=2),
                        [w((3, 4, 7, 6), X4D), w((5, 4, 3, 3), W4), (5,)]),
        "conv2d_groups": (lambda x, w_: nnf(x).conv2d(x, w_, stride=2, padding=(1, 0), groups=2),
                          [w((3, 4, 7, 6), X4D), w((6, 2, 3, 3), W4)]),
        "conv2d_unbatched": (lambda x, w_: nnf(x).conv2d(x, w_), [(4, 5, 6), w((3, 4, 2, 2), W4)]),
        "max_pool2d": (lambda x: nnf(x).max_pool2d(x, 3, stride=2, padding=1), [(3, 5, 7, 6)]),
        "max_pool2d_indices": (lambda x: nnf(x).max_pool2d(x, 2, ceil_mode=True,
                                                           return_indices=True), [(3, 5, 7, 6)]),
        "avg_pool2d": (lambda x: nnf(x).avg_pool2d(x, 2, padding=1, ceil_mode=True,
                                                   count_include_pad=False), [(3, 5, 7, 6)]),
        "adaptive_avg_pool2d": (lambda x: nnf(x).adaptive_avg_pool2d(x, (3, 4)), [(3, 5, 7, 6)]),
        "batch_norm_train": (lambda x, w_, b: nnf(x).batch_norm(x, None, None, w_, b, True),
                             [(5, 3, 4, 3), (3,), (3,)], {"atol": 1e-4}),
        "batch_norm_eval": (lambda x, m, v, w_, b: nnf(x).batch_norm(x, m, v, w_, b, False),
                            [(5, 3, 4, 3), Input(lambda g: torch.randn(3, generator=g), grad=False),
                             _positive(3), (3,), (3,)]),
        "layer_norm": (lambda x, w_, b: nnf(x).layer_norm(x, (5,), w_, b), [(3, 7, 5), (5,), (5,)],
                       {"atol": 1e-4}),
        "rms_norm": (lambda x, w_: nnf(x).rms_norm(x, (7, 5), w_, eps=1e-6), [(3, 7, 5), (7, 5)],
                     {"atol": 1e-4}),
        "group_norm": (lambda x, w_, b: nnf(x).group_norm(x, 3, w_, b), [(3, 6, 5), (6,), (6,)],
                       {"atol": 1e-4}),
        "activations": (_act, [(7, 5)]),
        "dropout_eval": (lambda x: nnf(x).dropout(x, 0.3, training=False) * 2, [(7, 5)]),
        "softmax_dim1": (lambda x: nnf(x).softmax(x, dim=1), [(5, 7)]),
        "softmax_dim0_f64": (lambda x: nnf(x).softmax(x, dim=0, dtype=torch.float64), [(5, 7)]),
        "log_softmax": (lambda x: nnf(x).log_softmax(x, dim=-1), [(3, 5, 7)]),
        "embedding": (lambda i, w_: nnf(w_).embedding(i, w_), [oracle.ints((3, 5), 11), (11, 4)]),
        "embedding_pad": (lambda i, w_: nnf(w_).embedding(i, w_, padding_idx=-2),
                          [oracle.ints((6,), 7), (7, 3)]),
        "cross_entropy": (lambda x, t: nnf(x).cross_entropy(x, t), [(6, 7), _targets((6,), 7)]),
        "cross_entropy_sum_ignore": (lambda x, t: nnf(x).cross_entropy(x, t, reduction="sum"),
                                     [(6, 7), _targets((6,), 7, ignore=(1, 4))]),
        "cross_entropy_none_smooth_weight": (
            lambda x, t, cw: nnf(x).cross_entropy(x, t, cw, ignore_index=-100, reduction="none",
                                                  label_smoothing=0.2),
            [(6, 7), _targets((6,), 7, ignore=(2,)), _positive(7)]),
        "cross_entropy_mean_weight_smooth": (
            lambda x, t, cw: nnf(x).cross_entropy(x, t, cw, label_smoothing=0.1),
            [(6, 7), _targets((6,), 7, ignore=(0,)), _positive(7)]),
        "cross_entropy_3d": (lambda x, t: nnf(x).cross_entropy(x, t), [(4, 5, 3),
                                                                       _targets((4, 3), 5)]),
        "cross_entropy_probs": (lambda x, t: nnf(x).cross_entropy(x, t, label_smoothing=0.1),
                                [(6, 7), _probs((6, 7))]),
        "nll_loss": (lambda x, t: nnf(x).nll_loss(x, t, reduction="sum"),
                     [(6, 7), _targets((6,), 7, ignore=(3,))]),
        "mse_loss": (lambda a, b: nnf(a).mse_loss(a, b), [(7, 5), (7, 5)]),
        "l1_loss_sum": (lambda a, b: nnf(a).l1_loss(a, b, reduction="sum"), [(7, 5), (7, 5)]),
        "bce_with_logits": (
            lambda x, t, ww, pw: nnf(x).binary_cross_entropy_with_logits(x, t, ww, pos_weight=pw),
            [(7, 5), Input(lambda g: torch.rand(7, 5, generator=g), grad=False), _positive(5),
             _positive(5)]),
        "sdpa": (lambda q, k, v: nnf(q).scaled_dot_product_attention(q, k, v),
                 [w((2, 3, 5, 4), X4D), w((2, 3, 6, 4), (S0, S1, B)),
                  w((2, 3, 6, 4), (S0, S1, S3, P))],
                 {"atol": 1e-4}),
        "sdpa_causal_scale": (
            lambda q, k, v: nnf(q).scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
            [w((2, 3, 5, 4), (S0, S1, S2, B)), w((2, 3, 5, 4), (S0, S1, B)),
             w((2, 3, 5, 4), (S0, S1, B))], {"atol": 1e-4}),
        "sdpa_float_mask": (
            lambda q, k, v, m: nnf(q).scaled_dot_product_attention(q, k, v, attn_mask=m),
            [w((2, 3, 5, 4), (S0, S1, S2, B)), w((2, 3, 6, 4), (S0, S1, B)),
             w((2, 3, 6, 4), (S0, B)), Input(lambda g: torch.randn(5, 6, generator=g), grad=False)],
            {"atol": 1e-4}),
        "sdpa_bool_mask": (
            lambda q, k, v, m: nnf(q).scaled_dot_product_attention(q, k, v, attn_mask=m),
            [w((2, 3, 5, 4), (S0, S1, B)), w((2, 3, 6, 4), (S0, B)), w((2, 3, 6, 4), (S0, B)),
             Input(lambda g: torch.rand(2, 1, 5, 6, generator=g) > 0.3, grad=False)],
            {"atol": 1e-4}),
        "pad_constant": (lambda x: nnf(x).pad(x, (1, 2), value=0.5), [(3, 4, 5)]),
        "pad_reflect": (lambda x: nnf(x).pad(x, (2, 1, 1, 1), mode="reflect"), [(2, 3, 4, 5)]),
        "pad_replicate": (lambda x: nnf(x).pad(x, (1, 0, 0, 2), mode="replicate"), [(2, 3, 4, 5)]),
        "interpolate_nearest": (lambda x: nnf(x).interpolate(x, scale_factor=2), [(3, 2, 5, 4)]),
        "interpolate_bilinear": (
            lambda x: nnf(x).interpolate(x, size=(7, 3), mode="bilinear", align_corners=True),
            [(3, 2, 5, 4)]),
        "interpolate_bilinear_scale": (
            lambda x: nnf(x).interpolate(x, scale_factor=1.5, mode="bilinear"), [(3, 2, 5, 4)]),
    }, sample_1d={2: 6, 4: 4}, sample_2x2=3, full_2x2_max=0, covering_extra=8,
    local_atol=1e-5, local_weighted=True),
    # Structured ops (issue 21): covering samples of 1-D layouts by default; the 2x2 mesh
    # (small batches, so it gives ranks empty shards) in the exhaustive suite, which CI runs.
    **oracle.policy({
        "conv3d_pools3d": (_conv3d_pools3d, [w((2, 3, 4, 5, 4), (S0, S1, S2, B, P)),
                                             w((4, 3, 2, 2, 2), W4), some_of((4,), S0, B, P)],
                           {"atol": 1e-4}),
        "conv_transpose3d_unpool3d": (_conv_transpose3d_unpool3d,
                                      [w((2, 4, 3, 3, 2), (S0, S1, S3, B, P)),
                                       w((4, 3, 2, 2, 2), W4)]),
        "unpool_lp_1d_2d": (_unpool_lp_1d_2d, [(3, 4, 9), w((3, 4, 6, 6), (S0, S1, S2, B, P))],
                            {"atol": 1e-4}),
        "fold_lrn_shuffle": (_fold_lrn_shuffle, [(3, 6, 5, 4)]),
        "affine_grid_sample": (_affine_grid_sample, [(3, 2, 3), w((3, 4, 5, 6), X4D)],
                               {"atol": 1e-4}),
        "fractional_max_pool2d": (
            lambda x, s: nnf(x).fractional_max_pool2d(x, 2, output_size=(3, 4), _random_samples=s,
                                                      return_indices=True),
            [w((3, 4, 7, 8), X4D), uniform((3, 4, 2), 0.0, 1.0, grad=False, layouts=(S0, S1, B))]),
        "fractional_max_pool3d": (
            lambda x, s: nnf(x).fractional_max_pool3d(x, (2, 1, 2), output_ratio=0.5,
                                                      _random_samples=s),
            [w((2, 3, 6, 4, 5), (S0, S1, S2, B, P)),
             uniform((2, 3, 3), 0.0, 1.0, grad=False, layouts=(S0, S1, B))]),
        "bilinear_pdist": (_bilinear_pdist, [(5, 4), some_of((5, 3), S0, S1, B),
                                             w((6, 4, 3), (S0, S1, S2, B)), some_of((6,), S0, P)],
                           {"atol": 1e-4}),
        "conv_tbc": (lambda x, w_, b: nnf(x).conv_tbc(x, w_, b, 1),
                     [(7, 3, 4), w((3, 4, 5), (S1, S2, B, P)), (5,)]),
    }, sample_1d={2: 6, 4: 4}, sample_2x2=0, full_2x2_max=0, covering_extra=8,
    local_atol=1e-5, local_weighted=True),
    # Swept on 1-D meshes only (and a 2x2 covering set when exhaustive).
    **oracle.policy({
        "leaky_elu": (lambda a: (SF if isinstance(a, sbpflow.Tensor) else torch.nn.functional)
                      .leaky_relu(a, 0.1) + (SF if isinstance(a, sbpflow.Tensor) else
                                             torch.nn.functional).elu(a), [(5, 4)]),
        "normalize_cos": (lambda a, b: nnf(a).normalize(a, dim=1) * nnf(a).cosine_similarity(
            a, b).reshape(-1, 1), [(5, 4), (5, 4)]),
        "smooth_l1": (lambda a, b: nnf(a).smooth_l1_loss(a, b, beta=0.5), [(5, 4), (5, 4)]),
        "bce": (lambda a, b: nnf(a).binary_cross_entropy(a, b), [_pos(5, 4), _pos(5, 4)]),
    }, sample_2x2=0, full_2x2_max=36, local_atol=1e-5),
}



# --------------------------------------------------------------------- issue 21's cases
def _inplace_activation_fns(a):
    """The ``F.<name>_`` forms (rrelu_ in eval is leaky_relu_), on copies of ``a``."""
    F = nn_of(a)
    out = F.rrelu(a, 0.1, 0.3) * 0.5
    for fn, args in ((F.relu_, ()), (F.elu_, (0.5,)), (F.celu_, (0.7,)), (F.selu_, ()),
                     (F.hardtanh_, (-0.5, 0.7)), (F.leaky_relu_, (0.2,)),
                     (F.threshold_, (0.1, -2.0)), (F.rrelu_, (0.2, 0.4))):
        y = a * 1.5
        assert fn(y, *args) is y
        out = out + y
    return out


def _pointwise_losses(x, t, y):
    """poisson (log input; and full, on positive inputs), hinge embedding, soft margin."""
    F = nn_of(x)
    pos = x.abs() + 0.1
    return (F.poisson_nll_loss(x, t) + F.poisson_nll_loss(pos, t, log_input=False, full=True,
                                                          reduction="sum") * 0.1
            + F.hinge_embedding_loss(x, y, margin=0.5) + F.hinge_embedding_loss(
                x, y, reduction="sum") * 0.1
            + F.soft_margin_loss(x, y) + F.soft_margin_loss(x, y, reduction="sum") * 0.1)


def _gaussian_nll(x, t, v):
    """var (N,) one dim short (homoscedastic), (N, 1) broadcast, a float; full."""
    F = nn_of(x)
    return (F.gaussian_nll_loss(x, t, v) + F.gaussian_nll_loss(x, t, v.reshape(7, 1), full=True,
                                                               reduction="sum") * 0.1
            + F.gaussian_nll_loss(x, t, 0.5, eps=1e-3))


def _margin_losses(x, t, mt, w):
    """multi margin (p 1 and 2, class weight), multilabel margin, multilabel soft margin."""
    F = nn_of(x)
    y01 = (mt >= 0).float()
    return (F.multi_margin_loss(x, t) + F.multi_margin_loss(x, t, p=2, margin=0.7, weight=w,
                                                            reduction="sum") * 0.1
            + F.multilabel_margin_loss(x, mt) + F.multilabel_margin_loss(
                x, mt, reduction="sum") * 0.1
            + F.multilabel_soft_margin_loss(x, y01, weight=w)
            + F.multilabel_soft_margin_loss(x, y01, reduction="sum") * 0.1)


def _multilabel_targets(shape, c):
    """Multilabel margin targets: each row's classes, then -1 (and anything after it)."""

    def make(g):
        t = torch.randint(0, c, shape, generator=g)
        for i, n in enumerate(torch.randint(0, shape[1] + 1, (shape[0],), generator=g)):
            if n < shape[1]:
                t[i, n] = -1
        return t

    return Input(make, grad=False)


def _triplet_distance(a, p, n):
    F = nn_of(a)

    def cos_dist(u, v):
        return 1.0 - F.cosine_similarity(u, v)

    return (F.triplet_margin_with_distance_loss(a, p, n, swap=True)
            + F.triplet_margin_with_distance_loss(a, p, n, distance_function=cos_dist,
                                                  margin=0.5, reduction="sum"))


def _fixed(values, dtype=torch.int64, layouts=(S0, B)):
    return Input(lambda g: torch.tensor(values, dtype=dtype), grad=False, layouts=layouts)


def _ctc(lp, tg, il, tl, cat):
    """(T, N, C) log-probabilities: padded and concatenated targets, each reduction."""
    F = nn_of(lp)
    lp = F.log_softmax(lp, dim=2)
    return (F.ctc_loss(lp, tg, il, tl) + F.ctc_loss(lp, tg, il, tl, reduction="sum") * 0.1
            + F.ctc_loss(lp, tg, il, tl, blank=4, reduction="none", zero_infinity=True).sum()
            * 0.01 + F.ctc_loss(lp, cat, il, tl))


def _linear_cross_entropy(x, w_, b, t):
    F = nn_of(x)
    return (F.linear_cross_entropy(x, w_, t, linear_bias=b, label_smoothing=0.1)
            + F.linear_cross_entropy(x, w_, t, reduction="sum", ignore_index=2) * 0.1)


def _mha(q, k, ipw, ipb, opw, bk):
    """multi_head_attention_forward with bias_k/v, a zero attention, bool key padding and
    attention masks (True = not allowed); weights per head compared too."""
    F = nn_of(q)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1, -2:] = True
    am = torch.arange(30).reshape(5, 6) % 7 == 3
    if F is SF:
        kw = dict(placement=q.placement, sbp=(B,) * q.placement.ndim) if q.is_global else {}
        kpm, am = sbpflow.tensor(kpm, **kw), sbpflow.tensor(am, **kw)
    return F.multi_head_attention_forward(q, k, k, 8, 2, ipw, ipb, bk, bk * 0.5, True, 0.0,
                                          opw, None, key_padding_mask=kpm, attn_mask=am,
                                          average_attn_weights=False)


# 1-D layouts by default (the suite's time is at its limit); the exhaustive suite, which CI
# runs, adds every 2x2 combination (or a covering set).
CASES.update({
    **oracle.policy({
        "activations_inplace_fns": (_inplace_activation_fns, [(7, 5)]),
        "triplet_with_distance": (_triplet_distance, [(7, 5), some_of((7, 5), S0, B),
                                                      some_of((7, 5), S1, P)]),
    }, sample_2x2=0, full_2x2_max=36),
    **oracle.policy({
        "pointwise_losses_21": (_pointwise_losses, [
            (7, 5), uniform((7, 5), 0.0, 3.0, grad=False, layouts=(S0, S1, B)), signs((7, 5))]),
        "gaussian_nll": (_gaussian_nll, [(7, 5), some_of((7, 5), S1, B),
                                         uniform((7,), 0.2, 2.0, layouts=(S0, B, P))]),
        "margin_losses_21": (_margin_losses, [
            (6, 7), _targets((6,), 7), _multilabel_targets((6, 7), 7),
            uniform((7,), 0.5, 1.5, grad=False, layouts=(S0, B))]),
        "ctc_loss": (_ctc, [(6, 4, 5), Input(lambda g: torch.randint(1, 4, (4, 3), generator=g),
                                             grad=False),
                            _fixed([6, 5, 6, 4]), _fixed([3, 2, 1, 0]),
                            _fixed([1, 2, 3, 2, 3, 1], layouts=(S0, B))]),
        "linear_cross_entropy": (_linear_cross_entropy, [(6, 4), w((7, 4), W4), (7,),
                                                         _targets((6,), 7)]),
        "grouped_mm": (lambda a, b: nnf(a).grouped_mm(a, b), [(3, 4, 8), (3, 8, 4)]),
        "grouped_mm_offs": (lambda a, b, o: nnf(a).grouped_mm(a, b, offs=o),
                            [w((6, 8), (S0, B)), w((2, 8, 4), (S0, S2, B)),
                             _fixed([2, 6], torch.int32, (B,))]),
        "multi_head_attention_forward": (_mha, [
            w((5, 3, 8), (S1, B, P)), w((6, 3, 8), (S1, B)), w((24, 8), (S0, B)),
            w((24,), (S0, B)), w((8, 8), (S1, B)), w((1, 1, 8), (B,))], {"atol": 1e-4}),
    }, sample_1d={2: 6, 4: 4}, sample_2x2=0, full_2x2_max=0, covering_extra=8,
        local_atol=1e-5, local_weighted=True),
})

(test_1d_layouts_match_torch, test_2x2_sampled_layouts_match_torch,
 test_every_layout_match_torch, test_local_matches_torch) = oracle.sweep_tests(__name__)


def test_errors_local():
    x = sbpflow.randn(4, 5)
    with pytest.raises(ValueError, match="halving dimension must be even"):
        SF.glu(x, 1)
    with pytest.raises(ValueError, match="does not support 0-dim"):
        SF.glu(sbpflow.tensor(1.0))
    with pytest.raises(ValueError, match="must have 1 or C elements"):
        SF.prelu(x, sbpflow.ones(3))
    with pytest.raises(ValueError, match="cannot be greater than max_val"):
        SF.hardtanh(x, 1.0, -1.0)
    with pytest.raises(ValueError, match="alpha must not be 0"):
        SF.celu(x, 0.0)
    with pytest.raises(ValueError, match="lambd must be >= 0"):
        SF.softshrink(x, -0.1)
    with pytest.raises(ValueError, match="reduction must be one of"):
        SF.kl_div(x, x, reduction="batch")
    with pytest.raises(ValueError, match="reduction must be one of"):
        SF.huber_loss(x, x, reduction="batchmean")
    with pytest.raises(ValueError, match="target of shape"):
        SF.binary_cross_entropy(x.sigmoid(), sbpflow.ones(5))
    with pytest.raises(ValueError, match="beta must be >= 0"):
        SF.smooth_l1_loss(x, x, beta=-1.0)
    with pytest.raises(ValueError, match="delta must be > 0"):
        SF.huber_loss(x, x, delta=0.0)
    with pytest.raises(ValueError, match="weight of shape"):
        SF.huber_loss(x, x, weight=sbpflow.ones(5))
    with pytest.raises(ValueError, match="same number of dims"):
        SF.margin_ranking_loss(x, x, sbpflow.ones(4))
    with pytest.raises(ValueError, match="expected inputs"):
        SF.cosine_embedding_loss(x, x, sbpflow.ones(4, 5))
    with pytest.raises(ValueError, match="margin must be > 0"):
        SF.triplet_margin_loss(x, x, x, margin=0.0)
    with pytest.raises(ValueError, match="size_average and reduce are deprecated"):
        SF.kl_div(x, x, size_average=True)
    with pytest.raises(TypeError, match="input must be an sbpflow.Tensor or a number"):
        sbpflow.xlogy("a", x)
    with pytest.raises(TypeError, match="other must be an sbpflow.Tensor or a number"):
        x.atan2("a")
    leaf = sbpflow.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        leaf.expm1_()


# --------------------------------------------------------------------- collectives
def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _vocab_parallel_cross_entropy():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    n, c = 8, 1001  # uneven over 2 and 4 ranks
    xv, tv = torch.randn(n, c), torch.randint(0, c, (n,))
    tv[3] = -100
    x = sbpflow.tensor(xv, placement=pl, sbp=S1, requires_grad=True)
    t = sbpflow.tensor(tv, placement=pl, sbp=B)
    logits_bytes = n * c * 4
    with CommRecorder() as fwd:
        loss = SF.cross_entropy(x, t, label_smoothing=0.1)
    with CommRecorder() as bwd:
        loss.backward()
    problems = []
    for what, rec in (("forward", fwd), ("backward", bwd)):
        if set(rec.kinds()) - {"all_reduce"}:
            problems.append(f"{what} ran {rec.kinds()}")
        if rec.total_bytes() > logits_bytes // 50:
            problems.append(f"{what} moved {rec.total_bytes()} bytes (logits {logits_bytes})")
    if fwd.count("all_reduce") > 3 or bwd.count("all_reduce") > 2:
        problems.append(f"too many all-reduces: {fwd.kinds()} / {bwd.kinds()}")
    xr = xv.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(xr, tv, label_smoothing=0.1)
    ref.backward()
    _close(loss.numpy(), ref.detach().numpy())
    _close(x.grad.numpy(), xr.grad.numpy())
    # (N, C, d) logits split on C: the same algorithm, still no gather.
    x3 = sbpflow.randn(4, 9, 3, placement=pl, sbp=S1, requires_grad=True)
    t3 = sbpflow.randint(0, 9, (4, 3), placement=pl, sbp=S0)
    with CommRecorder() as rec:
        SF.cross_entropy(x3, t3, reduction="sum").backward()
    if "all_gather" in rec.kinds() and any(r.bytes >= 4 * 9 for r in rec.records
                                           if r.kind == "all_gather" and r.dtype.is_floating_point):
        problems.append(f"3-d cross_entropy gathered floats: {rec}")
    return problems


def _softmax_split_dim():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.randn(6, 9, placement=pl, sbp=S1, requires_grad=True)
    with CommRecorder() as rec:
        y = SF.softmax(x, dim=1)
    problems = []
    if y.sbp != (S1,) or rec.kinds() != ["all_reduce", "all_reduce"]:
        problems.append(f"softmax: {y.sbp}, {rec.kinds()}")
    if max(r.bytes for r in rec.records) != 6 * 4:  # one value per row
        problems.append(f"softmax all-reduces of {[r.bytes for r in rec.records]} bytes")
    with CommRecorder() as rec:
        y = SF.log_softmax(x, dim=0)
    if y.sbp != (S1,) or rec.kinds() != []:
        problems.append(f"log_softmax over a whole dim: {y.sbp}, {rec.kinds()}")
    return problems


def _embedding_layouts():
    pl = sbpflow.placement.all("cpu")
    ids = sbpflow.randint(0, 11, (3, 5), placement=pl, sbp=B)
    wt = sbpflow.randn(11, 4, placement=pl, sbp=S0, requires_grad=True)
    problems = []
    with CommRecorder() as rec:
        y = SF.embedding(ids, wt)
    if y.sbp != (P,) or rec.kinds() != []:
        problems.append(f"S(0) weight: {y.sbp} {rec.kinds()}")
    with CommRecorder() as rec:
        y.backward(sbpflow.ones(3, 5, 4, placement=pl, sbp=B))
    if rec.kinds() != []:  # dual(P) = B: each rank's rows get their gradient locally
        problems.append(f"S(0) weight backward: {rec.kinds()}")
    w1 = sbpflow.randn(11, 4, placement=pl, sbp=S1)
    if SF.embedding(ids, w1).sbp != (S2,):
        problems.append("S(1) weight should give S(last)")
    wb = sbpflow.randn(11, 4, placement=pl, sbp=B)
    ids1 = ids.to_global(sbp=S1)
    with CommRecorder() as rec:
        y = SF.embedding(ids1, wb)
    if y.sbp != (S1,) or rec.kinds() != []:
        problems.append(f"B weight, S(1) ids: {y.sbp} {rec.kinds()}")
    return problems


def _megatron_linear_pair():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv, w1v, b1v, w2v, b2v = (torch.randn(s) for s in [(4, 8), (16, 8), (16,), (8, 16), (8,)])
    x = sbpflow.tensor(xv, placement=pl, sbp=B)
    w1 = sbpflow.tensor(w1v, placement=pl, sbp=S0, requires_grad=True)
    b1 = sbpflow.tensor(b1v, placement=pl, sbp=S0, requires_grad=True)
    w2 = sbpflow.tensor(w2v, placement=pl, sbp=S1, requires_grad=True)
    b2 = sbpflow.tensor(b2v, placement=pl, sbp=B, requires_grad=True)
    problems = []
    with CommRecorder() as fwd:
        h = SF.gelu(SF.linear(x, w1, b1))
        z = SF.linear(h, w2, b2)
        y = z.to_global(sbp=B)
    if h.sbp != (S1,) or z.sbp != (P,) or fwd.kinds() != ["all_reduce"]:
        problems.append(f"forward: h {h.sbp}, z {z.sbp}, {fwd.kinds()}")
    with CommRecorder() as bwd:
        y.backward(sbpflow.ones(4, 8, placement=pl, sbp=B))
    # The output gradient's all-reduce, and the B bias's leaf-gradient sync (P -> B).
    if bwd.kinds() != ["all_reduce", "all_reduce"]:
        problems.append(f"backward: {bwd.kinds()}")
    refs = [t.clone().requires_grad_(True) for t in (w1v, b1v, w2v, b2v)]
    F = torch.nn.functional
    F.linear(F.gelu(F.linear(xv, refs[0], refs[1])), refs[2], refs[3]).sum().backward()
    _close(y.numpy(), F.linear(F.gelu(F.linear(xv, w1v, b1v)), w2v, b2v).numpy())
    for a, r in zip((w1, b1, w2, b2), refs):
        _close(a.grad.numpy(), r.grad.numpy())
    return problems


def _batch_norm_split_batch():
    pl = sbpflow.placement.all("cpu")
    torch.manual_seed(0)
    xv = torch.randn(7, 3, 4, 4) * 2 + 1
    rm_t, rv_t = torch.zeros(3), torch.ones(3)
    x = sbpflow.tensor(xv, placement=pl, sbp=S0, requires_grad=True)
    rm = sbpflow.tensor(rm_t, placement=pl, sbp=B)
    rv = sbpflow.tensor(rv_t, placement=pl, sbp=B)
    problems = []
    with CommRecorder() as rec:
        y = SF.batch_norm(x, rm, rv, training=True, momentum=0.3)
    if y.sbp != (S0,) or rec.kinds() != ["all_reduce", "all_reduce"]:
        problems.append(f"forward: {y.sbp} {rec.kinds()}")
    if max(r.bytes for r in rec.records) > 3 * 4:
        problems.append(f"statistics should be C values: {rec}")
    xr = xv.clone().requires_grad_(True)
    ref = torch.nn.functional.batch_norm(xr, rm_t, rv_t, training=True, momentum=0.3)
    wt = torch.randn(7, 3, 4, 4)
    y.backward(sbpflow.tensor(wt, placement=pl, sbp=S0))
    (ref * wt).sum().backward()
    _close(y.numpy(), ref.detach().numpy(), 1e-4)
    _close(x.grad.numpy(), xr.grad.numpy(), 1e-4)
    _close(rm.numpy(), rm_t.numpy())
    _close(rv.numpy(), rv_t.numpy())
    # Channel-split running stats follow a channel-split input without communication.
    xc = sbpflow.tensor(xv, placement=pl, sbp=S1)
    rmc = sbpflow.zeros(3, placement=pl, sbp=S0)
    rvc = sbpflow.ones(3, placement=pl, sbp=S0)
    with CommRecorder() as rec:
        yc = SF.batch_norm(xc, rmc, rvc, training=True, momentum=0.3)
    if yc.sbp != (S1,) or rec.kinds() != []:
        problems.append(f"channel split: {yc.sbp} {rec.kinds()}")
    _close(rmc.numpy(), rm_t.numpy())
    _close(yc.numpy(), ref.detach().numpy(), 1e-4)
    return problems


def _conv_linear_signatures():
    pl = sbpflow.placement.all("cpu")
    table = [
        # (fn, input shapes, input SBPs, output SBP); none may communicate.
        (SF.conv2d, [(3, 4, 6, 6), (5, 4, 3, 3), (5,)], (S0, B, B), S0),
        (SF.conv2d, [(3, 4, 6, 6), (5, 4, 3, 3), (5,)], (B, S0, S0), S1),
        (SF.conv2d, [(3, 4, 6, 6), (5, 4, 3, 3)], (S1, S1), P),
        (SF.conv1d, [(3, 4, 6), (5, 4, 3), (5,)], (S1, S1, P), P),
        (SF.linear, [(3, 7, 5), (6, 5), (6,)], (S0, B, B), S0),
        (SF.linear, [(3, 7, 5), (6, 5), (6,)], (B, S0, S0), S2),
        (SF.linear, [(7, 5), (6, 5)], (S1, S1), P),
        (SF.max_pool2d, [(3, 4, 6, 6)], (S1,), S1),
        (SF.adaptive_avg_pool2d, [(3, 4, 6, 6)], (P,), P),
        (SF.layer_norm, [(3, 7, 5)], (S1,), S1),
    ]
    problems = []
    for fn, shapes, ins, want in table:
        xs = [sbpflow.ones(*s, placement=pl, sbp=sb) for s, sb in zip(shapes, ins)]
        extra = {SF.max_pool2d: (2,), SF.adaptive_avg_pool2d: (2,), SF.layer_norm: ((5,),)}
        with CommRecorder() as rec:
            out = fn(*xs, *extra.get(fn, ()))
        if out.sbp != (want,) or rec.kinds():
            problems.append(f"{fn.__name__}{ins}: {out.sbp} with {rec.kinds()}, want {want}")
    return problems


def _structured_signatures():
    """Layouts the structured ops keep without any collective (issue 21)."""
    pl = sbpflow.placement.all("cpu")
    f = SF
    idx = sbpflow.tensor(TF.max_pool2d(torch.randn(3, 4, 6, 6), 2, return_indices=True)[1],
                         placement=pl, sbp=S1)
    table = [
        # (fn, input shapes, input SBPs, output SBP)
        (lambda x, w_: f.conv3d(x, w_), [(3, 2, 4, 4, 4), (5, 2, 2, 2, 2)], (S0, B), S0),
        (lambda x, w_: f.conv3d(x, w_), [(3, 2, 4, 4, 4), (5, 2, 2, 2, 2)], (B, S0), S1),
        (lambda x, w_: f.conv_transpose3d(x, w_), [(3, 2, 3, 3, 3), (2, 5, 2, 2, 2)], (S1, S0),
         P),
        (lambda x, w_, b: f.conv_tbc(x, w_, b), [(6, 3, 4), (2, 4, 5), (5,)], (S1, B, B), S1),
        (lambda x, w_, b: f.conv_tbc(x, w_, b), [(6, 3, 4), (2, 4, 5), (5,)], (B, S2, S0), S2),
        (lambda x: f.avg_pool3d(x, 2), [(3, 4, 4, 4, 4)], (P,), P),
        (lambda x: f.max_pool3d(x, 2), [(3, 4, 4, 4, 4)], (S1,), S1),
        (lambda x: f.max_unpool2d(x, idx, 2), [(3, 4, 3, 3)], (S1,), S1),
        (lambda x: f.unfold(x, 2), [(3, 4, 4, 4)], (S0,), S0),
        (lambda x: f.fold(x, (4, 4), 2), [(3, 16, 9)], (P,), P),
        (lambda x: f.local_response_norm(x, 3), [(3, 4, 5, 4)], (S2,), S2),
        (lambda x: f.channel_shuffle(x, 2), [(3, 4, 5, 4)], (S3,), S3),
        (lambda x: f.fractional_max_pool2d(x, 2, output_size=2), [(3, 4, 5, 5)], (S1,), S1),
        (lambda t: f.affine_grid(t, [3, 2, 4, 5], align_corners=False), [(3, 2, 3)], (S0,), S0),
        (lambda x, g_: f.grid_sample(x, g_, align_corners=False), [(3, 4, 5, 5), (3, 2, 6, 2)],
         (S1, B), S1),
        (lambda x, g_: f.grid_sample(x, g_, align_corners=False), [(3, 4, 5, 5), (3, 2, 6, 2)],
         (B, S2), S3),
        (lambda a, b, w_: f.bilinear(a, b, w_), [(4, 3), (4, 5), (6, 3, 5)], (S0, S0, B), S0),
        (lambda a, b, w_: f.bilinear(a, b, w_), [(4, 3), (4, 5), (6, 3, 5)], (B, B, S0), S1),
    ]
    problems = []
    for k, (fn, shapes, ins, want) in enumerate(table):
        xs = [sbpflow.tensor(torch.randn(sh), placement=pl, sbp=sb) for sh, sb in zip(shapes, ins)]
        with CommRecorder() as rec:
            out = fn(*xs)
        if out.sbp != (want,) or rec.kinds():
            problems.append(f"row {k} {ins}: {out.sbp} with {rec.kinds()}, want {want}")
    x = sbpflow.randn(5, 3, placement=pl, sbp=S0)
    with CommRecorder() as rec:  # pdist has no rule: gathered, the result B
        out = SF.pdist(x)
    if out.sbp != (B,) or rec.kinds() != ["all_gather"]:
        problems.append(f"pdist: {out.sbp} with {rec.kinds()}")
    return problems


@pytest.mark.parametrize("body", [_vocab_parallel_cross_entropy, _softmax_split_dim,
                                  _embedding_layouts, _megatron_linear_pair,
                                  _batch_norm_split_batch, _conv_linear_signatures,
                                  _structured_signatures],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("world", [2, 4])
def test_collectives(dist_run, body, world):
    results = dist_run(world, body)
    assert results[0] == [], "\n".join(results[0])


# --------------------------------------------------------------------- errors
def _out_of_range_ids_raise():
    """A vocabulary- or class-split weight must not turn an id no rank owns into zeros."""
    pl = sbpflow.placement.all("cpu")
    w = sbpflow.tensor(torch.randn(10, 4), placement=pl, sbp=S0)
    ids = sbpflow.tensor(torch.tensor([0, 12]), placement=pl, sbp=B)
    with pytest.raises(IndexError, match="id 12 is out of range for 10 embeddings"):
        SF.embedding(ids, w)
    x = sbpflow.tensor(torch.randn(4, 6), placement=pl, sbp=S1)
    bad = sbpflow.tensor(torch.tensor([0, 1, 2, 9]), placement=pl, sbp=B)
    with pytest.raises(IndexError, match="target 9 is out of range for 6 classes"):
        SF.cross_entropy(x, bad)
    ok = sbpflow.tensor(torch.tensor([0, 1, -100, 5]), placement=pl, sbp=B)  # ignore_index
    want = TF.cross_entropy(x.to_global(sbp=B).to_local().to_torch(),
                                             torch.tensor([0, 1, -100, 5]))
    assert abs(SF.cross_entropy(x, ok).item() - want.item()) < 1e-5
    return "ok"


def test_out_of_range_ids_raise_on_every_rank(dist_run):
    assert dist_run(2, _out_of_range_ids_raise) == ["ok", "ok"]


def test_errors():
    x = sbpflow.randn(4, 5)
    t = sbpflow.from_torch(torch.tensor([0, 1, 2, 3]))
    g = sbpflow.ones(4, 5, placement=sbpflow.placement("cpu", [0]), sbp=B)
    with pytest.raises(TypeError, match="mix local and global"):
        SF.linear(x, g)
    with pytest.raises(TypeError, match="expected an sbpflow.Tensor"):
        SF.relu(torch.ones(2))
    with pytest.raises(ValueError, match="reduction must be one of"):
        SF.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        SF.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="needs a target of shape"):
        SF.cross_entropy(x, sbpflow.from_torch(torch.tensor([0, 1])))
    with pytest.raises(TypeError, match="must be integers"):
        SF.nll_loss(x, sbpflow.randn(4))
    with pytest.raises(TypeError, match="ids must be an integer"):
        SF.embedding(sbpflow.randn(3), x)
    with pytest.raises(ValueError, match="padding_idx 9 is out of range"):
        SF.embedding(t, x, padding_idx=9)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SF.batch_norm(sbpflow.randn(1, 3), None, None, training=True)
    with pytest.raises(ValueError, match="momentum must be a number"):
        SF.batch_norm(x, None, None, training=True, momentum=None)
    with pytest.raises(ValueError, match="needs running_mean"):
        SF.batch_norm(x, None, None)
    with pytest.raises(ValueError, match="normalized_shape"):
        SF.layer_norm(x, (4,))
    with pytest.raises(ValueError, match="even length"):
        SF.pad(x, (1, 2, 3))
    with pytest.raises(ValueError, match="exactly one of size"):
        SF.interpolate(sbpflow.randn(1, 1, 4, 4))
    with pytest.raises(ValueError, match="give dim="):
        SF.softmax(x)
    with pytest.raises(IndexError, match="out of range"):
        SF.softmax(x, dim=2)
    with pytest.raises(ValueError, match="approximate must be"):
        SF.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match="divisible by num_groups"):
        SF.group_norm(sbpflow.randn(2, 5, 3), 2)
    with pytest.raises(ValueError, match=r"2-D \(unbatched\) or 3-D input"):
        SF.conv1d(sbpflow.randn(1, 2, 3, 4), sbpflow.randn(2, 2, 1))
    # Attention dropout on global tensors: torch's math path with the layout-invariant mask.
    qt = torch.randn(1, 2, 3, 4)
    q = sbpflow.tensor(qt, placement=sbpflow.placement("cpu", [0]), sbp=B)
    for causal in (False, True):
        sbpflow.manual_seed(4)
        got = SF.scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=causal)
        torch.manual_seed(4)
        want = torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, dropout_p=0.5,
                                                                is_causal=causal)
        assert np.allclose(got.numpy(), want.numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="between 0 and 1"):
        SF.dropout(x, 2.0)


def test_inplace_rebinds_and_dropout_matches_torch():
    x = sbpflow.from_torch(torch.tensor([-1.0, 2.0]))
    y = SF.relu(x, inplace=True)
    assert y is x and x.to_torch().tolist() == [0.0, 2.0]
    torch.manual_seed(3)
    a = SF.dropout(sbpflow.ones(5, 5), 0.4).to_torch()
    torch.manual_seed(3)
    assert torch.equal(a, torch.nn.functional.dropout(torch.ones(5, 5), 0.4))


def test_local_batch_norm_updates_running_stats():
    xv = torch.randn(6, 3, 2)
    rm, rv = sbpflow.zeros(3), sbpflow.ones(3)
    rm_t, rv_t = torch.zeros(3), torch.ones(3)
    SF.batch_norm(sbpflow.from_torch(xv), rm, rv, training=True)
    torch.nn.functional.batch_norm(xv, rm_t, rv_t, training=True)
    assert torch.allclose(rm.to_torch(), rm_t) and torch.allclose(rv.to_torch(), rv_t)


# --------------------------------------------------------------------- structured ops
def _fractional_layout_invariant(mesh):
    """fractional_max_pool2d/3d draw their samples as torch does: with the same seed the
    global values and indices are torch's on one process under every layout (batched and
    unbatched), and every rank's generator stays in step with torch's."""
    pl = sbpflow.placement("cpu", mesh)
    g = torch.Generator().manual_seed(0)
    x2, x3 = torch.randn(3, 4, 7, 8, generator=g), torch.randn(2, 3, 5, 6, 4, generator=g)
    bad = []
    for name, xv, kw in (("2d", x2, dict(kernel_size=2, output_ratio=(0.5, 0.5))),
                         ("2d unbatched", x2[0], dict(kernel_size=(2, 3), output_size=(3, 3))),
                         ("3d", x3, dict(kernel_size=2, output_size=(2, 3, 2)))):
        fn = "fractional_max_pool3d" if name == "3d" else "fractional_max_pool2d"
        torch.manual_seed(5)
        ref, ref_idx = getattr(TF, fn)(xv, return_indices=True, **kw)
        ref_next = torch.rand(3)
        layouts = [S0, S1, S2, B, P] if len(mesh) != 2 or not isinstance(mesh[0], list) else \
            [(S0, S1), (S1, S0), (B, S0), (P, S1), (S0, S0)]
        for sbp in layouts:
            x = sbpflow.tensor(xv, placement=pl, sbp=sbp)
            sbpflow.manual_seed(5)
            y, idx = getattr(SF, fn)(x, return_indices=True, **kw)
            if not (np.array_equal(y.numpy(), ref.numpy())
                    and np.array_equal(idx.numpy(), ref_idx.numpy())
                    and torch.equal(torch.rand(3), ref_next)):
                bad.append(f"{name} {sbp}")
    return bad


@pytest.mark.parametrize("world,mesh", [(2, [0, 1]), (4, [[0, 1], [2, 3]])])
def test_fractional_max_pool_layout_invariant(dist_run, world, mesh):
    assert dist_run(world, _fractional_layout_invariant, mesh)[0] == []


def test_structured_errors_and_aliases():
    x4 = sbpflow.randn(2, 4, 5, 5)
    with pytest.raises(ValueError, match=r"4 or 5 dims \(\(N, C, D, H, W\)"):
        SF.max_pool3d(x4[0, 0], 2)
    with pytest.raises(ValueError, match="indices of shape"):
        SF.max_unpool2d(x4, sbpflow.zeros(2, 4, 5, 4, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="should be type int64"):
        SF.max_unpool2d(x4, sbpflow.zeros(2, 4, 5, 5, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="invalid output_size"):
        SF.max_unpool2d(x4, sbpflow.zeros(2, 4, 5, 5, dtype=torch.int64), 2, output_size=(3, 3))
    with pytest.raises(ValueError, match="either an output_size or an output_ratio"):
        SF.fractional_max_pool2d(x4, 2)
    with pytest.raises(ValueError, match="Only 3D or 4D"):
        SF.unfold(sbpflow.randn(4, 5), 2)
    with pytest.raises(ValueError, match="unbatched \\(2D\\) or batched \\(3D\\)"):
        SF.fold(x4, (4, 4), 2)
    with pytest.raises(ValueError, match="Expected 3D or higher"):
        SF.local_response_norm(sbpflow.randn(4, 5), 2)
    with pytest.raises(ValueError, match="divisible by groups"):
        SF.channel_shuffle(x4, 3)
    with pytest.raises(ValueError, match="Nx2x3"):
        SF.affine_grid(sbpflow.randn(2, 3, 3), [2, 1, 4, 4], align_corners=False)
    with pytest.raises(NotImplementedError, match="4D and 5D"):
        SF.affine_grid(sbpflow.randn(2, 2, 3), [2, 4, 4], align_corners=False)
    with pytest.raises(ValueError, match="expected mode"):
        SF.grid_sample(x4, sbpflow.randn(2, 3, 3, 2), mode="area")
    with pytest.raises(ValueError, match="grid_sample: expected input"):
        SF.grid_sample(x4, sbpflow.randn(2, 3, 3, 3), align_corners=False)
    with pytest.raises(ValueError, match="only supports 2D"):
        SF.pdist(x4)
    with pytest.raises(ValueError, match="bilinear: expected"):
        SF.bilinear(sbpflow.randn(3, 4), sbpflow.randn(2, 5), sbpflow.randn(6, 4, 5))
    with pytest.raises(ValueError, match="conv_tbc: input channels"):
        SF.conv_tbc(sbpflow.randn(5, 2, 3), sbpflow.randn(2, 4, 4), sbpflow.randn(4))
    # torch's conv_tbc views its input and output gradient; shards are often strided slices
    xt, wt, bt = torch.randn(7, 6, 4), torch.randn(3, 4, 5), torch.randn(5)
    gt = torch.randn(7, 6, 5)
    x = sbpflow.tensor(xt)[:, ::2].detach().requires_grad_(True)
    SF.conv_tbc(x, sbpflow.tensor(wt), sbpflow.tensor(bt), 1).backward(sbpflow.tensor(gt)[:, ::2])
    xr = xt[:, ::2].clone().requires_grad_(True)
    torch.conv_tbc(xr, wt, bt, 1).backward(gt[:, ::2].contiguous())
    assert torch.allclose(x.grad.to_torch(), xr.grad)
    # the deprecated aliases: torch's warnings and argument mapping
    for name, kw, want in (("upsample", dict(scale_factor=2, mode="bilinear"),
                            dict(scale_factor=2, mode="bilinear")),
                           ("upsample_nearest", dict(size=(7, 6)), dict(size=(7, 6))),
                           ("upsample_bilinear", dict(scale_factor=1.5),
                            dict(scale_factor=1.5, mode="bilinear", align_corners=True))):
        with pytest.warns(UserWarning, match="is deprecated"):
            got = getattr(SF, name)(x4, **kw)
        assert torch.equal(got.to_torch(), TF.interpolate(x4.to_torch(), **want)), name
    with pytest.warns(UserWarning, match="align_corners=False since 1.3.0"):
        SF.affine_grid(sbpflow.randn(2, 2, 3), [2, 1, 4, 4])
# --------------------------------------------------------------------- random ops (issue 21)
def _random_ops_layout_invariant():
    """dropout1d/3d, (feature) alpha dropout, rrelu (training, and rrelu_) and gumbel
    softmax give torch's values for the same seed under S(0), S(1), B (and P where the
    op takes it), with torch's gradients; the output keeps the input's splits."""
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    x3, x5 = torch.randn(5, 6, 7, generator=g), torch.randn(3, 4, 2, 3, 2, generator=g)
    cases = [  # (name, fn(F, x), value, layouts, exact)
        ("dropout1d", lambda F, x: F.dropout1d(x, 0.4), x3, (S0, S1, S2, B, P), True),
        ("dropout1d_unbatched", lambda F, x: F.dropout1d(x, 0.4), x3[0], (S0, S1, B, P), True),
        ("dropout3d", lambda F, x: F.dropout3d(x, 0.5), x5, (S0, S1, S2, B, P), True),
        ("alpha_dropout", lambda F, x: F.alpha_dropout(x, 0.3, True), x3, (S0, S1, S2, B, P),
         True),
        ("alpha_dropout_t", lambda F, x: F.alpha_dropout(x.transpose(0, 2), 0.3, True), x3,
         (S0, S1, B), True),  # a permuted view: torch draws in memory order
        ("feature_alpha_dropout", lambda F, x: F.feature_alpha_dropout(x, 0.2, True), x3,
         (S0, S1, S2, B, P), True),
        ("rrelu", lambda F, x: F.rrelu(x, 0.1, 0.4, training=True), x3, (S0, S1, B, P), True),
        ("rrelu_", lambda F, x: F.rrelu_(x * 1, 0.1, 0.4, training=True), x3, (S1, B), True),
        ("gumbel_softmax", lambda F, x: F.gumbel_softmax(x, tau=0.7, dim=1), x3,
         (S0, S1, B, P), False),
        ("gumbel_softmax_hard", lambda F, x: F.gumbel_softmax(x, hard=True), x3,
         (S0, S2, B), False),
    ]
    bad = []
    for name, fn, value, layouts, exact in cases:
        w = torch.randn(value.shape if name != "alpha_dropout_t" else (7, 6, 5), generator=g)
        xr = value.clone().requires_grad_(True)
        torch.manual_seed(5)
        ref = fn(TF, xr)
        (ref * w).sum().backward()
        for s in layouts:
            xs = sbpflow.tensor(value, placement=pl, sbp=s, requires_grad=True)
            sbpflow.manual_seed(5)
            y = fn(SF, xs)
            y.backward(sbpflow.tensor(w, placement=pl, sbp=y.sbp))
            got, gx = y.numpy(), xs.grad.numpy()
            same = np.array_equal if exact else (lambda a, b: np.allclose(a, b, atol=1e-6))
            if not same(got, ref.detach().numpy()) or not np.allclose(gx, xr.grad.numpy(),
                                                                       atol=1e-6):
                bad.append(f"{name} {s}")
            if s.is_split() and name != "alpha_dropout_t" and y.sbp != (s,):
                bad.append(f"{name} {s} -> {y.sbp}")
    return bad


def test_random_ops_layout_invariant(dist_run):
    assert dist_run(2, _random_ops_layout_invariant)[0] == []


def test_random_ops_local_match_torch_and_errors():
    x, x5 = torch.randn(4, 5, 3), torch.randn(2, 4, 3, 2, 2)
    for fn, v in ((SF.dropout1d, x), (SF.dropout3d, x5), (SF.alpha_dropout, x),
                  (SF.feature_alpha_dropout, x)):
        torch.manual_seed(2)
        got = fn(sbpflow.tensor(v), 0.3, True)
        torch.manual_seed(2)
        assert torch.equal(got.to_torch(), getattr(TF, fn.__name__)(v, 0.3, True)), fn
        assert torch.equal(fn(sbpflow.tensor(v), 0.3, False).to_torch(), v)  # eval: identity
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match="3-D input to dropout3d"):
        got = SF.dropout3d(sbpflow.tensor(x), 0.5)  # taken as unbatched (C, D, H), as torch
    torch.manual_seed(2)
    with pytest.warns(UserWarning):
        assert torch.equal(got.to_torch(), TF.dropout3d(x, 0.5))
    y = sbpflow.tensor(x.clone())
    assert SF.dropout1d(y, 1.0, inplace=True) is y and not y.to_torch().any()
    with pytest.raises(ValueError, match="between 0 and 1"):
        SF.alpha_dropout(sbpflow.tensor(x), 1.5, True)
    with pytest.raises(ValueError, match="2-D"):
        SF.dropout1d(sbpflow.randn(2, 3, 4, 5))
    with pytest.raises(ValueError, match="at least 2"):
        SF.feature_alpha_dropout(sbpflow.randn(3), 0.5, True)
    with pytest.raises(ValueError, match="lower bound"):
        SF.rrelu(sbpflow.tensor(x), 0.5, 0.1, True)
    with pytest.warns(UserWarning, match="eps"):
        SF.gumbel_softmax(sbpflow.tensor(x), eps=1e-5)
    assert torch.equal(SF.rrelu(sbpflow.tensor(x)).to_torch(), TF.rrelu(x))


# --------------------------------------------------------------------- issue 21: layouts
def _losses_21_no_gather():
    """On a split batch the new losses give a P value with no collective in forward;
    multilabel_soft_margin_loss over a split class dim sums the class terms into P (no
    gather of the logits); ctc_loss keeps the batch split of log_probs (dim 1)."""
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    xv, tv = torch.randn(8, 6, generator=g), torch.randint(0, 6, (8,), generator=g)
    x, t = (sbpflow.tensor(v, placement=pl, sbp=S0) for v in (xv, tv))
    y = sbpflow.tensor((xv > 0).float() * 2 - 1, placement=pl, sbp=S0)
    lp = sbpflow.tensor(torch.randn(7, 8, 5, generator=g).log_softmax(2), placement=pl, sbp=S1)
    tg = sbpflow.tensor(torch.randint(1, 5, (8, 3), generator=g), placement=pl, sbp=S0)
    lengths = [sbpflow.tensor(torch.full((8,), n), placement=pl, sbp=S0) for n in (7, 2)]
    calls = {
        "poisson_nll_loss": lambda: SF.poisson_nll_loss(x, x.abs()),
        "hinge_embedding_loss": lambda: SF.hinge_embedding_loss(x, y),
        "soft_margin_loss": lambda: SF.soft_margin_loss(x, y, reduction="sum"),
        "gaussian_nll_loss": lambda: SF.gaussian_nll_loss(x, y, x.abs() + 0.1),
        "multi_margin_loss": lambda: SF.multi_margin_loss(x, t),
        "multilabel_soft_margin_loss": lambda: SF.multilabel_soft_margin_loss(x, (y + 1) / 2),
        "ctc_loss": lambda: SF.ctc_loss(lp, tg, *lengths),
    }
    problems = []
    for name, fn in calls.items():
        with CommRecorder() as rec:
            out = fn()
        if out.sbp != (P,) or rec.kinds():
            problems.append(f"{name}: {out.sbp} with {rec.kinds()}")
    xc = sbpflow.tensor(xv, placement=pl, sbp=S1)
    yc = sbpflow.tensor((xv > 0).float(), placement=pl, sbp=S1)
    with CommRecorder() as rec:
        out = SF.multilabel_soft_margin_loss(xc, yc, reduction="none")
    if out.sbp != (P,) or rec.kinds():
        problems.append(f"class split multilabel_soft_margin_loss: {out.sbp} {rec.kinds()}")
    want = TF.multilabel_soft_margin_loss(xv, (xv > 0).float(), reduction="none")
    if not np.allclose(out.numpy(), want.numpy(), atol=1e-6):
        problems.append("class split multilabel_soft_margin_loss: values")
    return problems


def test_losses_21_split_batch_gives_partial_without_gather(dist_run):
    assert dist_run(2, _losses_21_no_gather)[0] == []


def test_errors_21():
    x = sbpflow.randn(4, 5)
    t = sbpflow.from_torch(torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="only p == 1 and p == 2"):
        SF.multi_margin_loss(x, t, p=3)
    with pytest.raises(ValueError, match="weight must be one-dimensional"):
        SF.multi_margin_loss(x, t, weight=sbpflow.ones(4))
    with pytest.raises(ValueError, match="needs a target of shape"):
        SF.multilabel_margin_loss(x, t)
    with pytest.raises(TypeError, match="integer class indices"):
        SF.multi_margin_loss(x, sbpflow.randn(4))
    with pytest.raises(ValueError, match="var has negative"):
        SF.gaussian_nll_loss(x, x, -sbpflow.ones(4, 5))
    with pytest.raises(ValueError, match="incorrect size"):
        SF.gaussian_nll_loss(x, x, sbpflow.ones(3))
    with pytest.raises(ValueError, match="size_average and reduce are deprecated"):
        SF.poisson_nll_loss(x, x, reduce=False)
    with pytest.raises(ValueError, match="margin must be greater than 0"):
        SF.triplet_margin_with_distance_loss(x, x, x, margin=0.0)
    with pytest.raises(ValueError, match="same number of dims"):
        SF.triplet_margin_with_distance_loss(x, x, sbpflow.randn(5))
    with pytest.raises(ValueError, match="input_lengths must have shape"):
        SF.ctc_loss(sbpflow.randn(6, 4, 5), t.reshape(4, 1), (6, 6), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="ignore_index cannot be specified"):
        SF.linear_cross_entropy(x, sbpflow.randn(3, 5), sbpflow.randn(4, 3), ignore_index=1)
    with pytest.raises(ValueError, match="in_features"):
        SF.linear_cross_entropy(x, sbpflow.randn(3, 4), t)
    with pytest.raises(ValueError, match="need attn_mask if specifying the is_causal"):
        q = sbpflow.randn(3, 2, 4)
        SF.multi_head_attention_forward(q, q, q, 4, 2, sbpflow.randn(12, 4), None, None, None,
                                        False, 0.0, sbpflow.randn(4, 4), None, is_causal=True)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        SF.multi_head_attention_forward(q, q, q, 4, 3, sbpflow.randn(12, 4), None, None, None,
                                        False, 0.0, sbpflow.randn(4, 4), None)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        SF.elu_(sbpflow.randn(3, requires_grad=True))
    with pytest.raises(ValueError, match="alpha must not be 0"):
        SF.celu_(x, 0.0)
