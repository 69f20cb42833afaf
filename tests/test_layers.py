"""Module oracle per layer (sbpflow.nn against torch.nn): built with the same seed, the
layers hold the same parameters (initialisation matches torch's, bit for bit), and give
equal outputs, parameter gradients (and input gradients for ``LAYERS_INPUT_GRADS``) and
buffers, locally and data parallel on global tensors (parameters B, batch split: 6 rows
are uneven on 4 ranks); the layouts and collectives of the layers that take other splits;
module arguments, reprs, state dicts and parameter containers. Recurrent layers:
test_rnn.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _layer_oracle import check_layer, run_layers

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor")


def _f(*shape):
    return lambda g: torch.randn(shape, generator=g)


def _i(high, *shape):
    return lambda g: torch.randint(0, high, shape, generator=g)


def _lib(x):
    return sbpflow if isinstance(x, sbpflow.Tensor) else torch


def _as(x, t: torch.Tensor):
    """``t`` as the kind of tensor ``x`` is (a local sbpflow tensor for sbpflow inputs)."""
    return sbpflow.tensor(t) if isinstance(x, sbpflow.Tensor) else t


def _Params(nn):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = nn.ParameterList([nn.Parameter(torch.randn(4, 5)) for _ in range(2)])
            self.ws.append(torch.randn(5, 3))
            self.bs = nn.ParameterDict({"a": nn.Parameter(torch.randn(5)),
                                        "b": nn.Parameter(torch.randn(3))})

        def forward(self, x):
            h = (x @ self.ws[0] + self.bs["a"]).tanh()
            h = h * (x @ self.ws[1])
            return h @ self.ws[-1] + self.bs["b"]

    return M()


def _Tf(nn, batch_first, norm_first, activation):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Transformer(8, 2, 2, 2, 16, 0.0, activation, batch_first=batch_first,
                                    norm_first=norm_first)

        def forward(self, src, tgt):
            T = tgt.shape[1 if batch_first else 0]
            N, S = src.shape[0 if batch_first else 1], src.shape[1 if batch_first else 0]
            pad = torch.zeros(N, S, dtype=torch.bool)
            pad[1, -2:] = True  # the second sequence's last two source positions
            mask = type(self.t).generate_square_subsequent_mask(T)
            return self.t(src, tgt, tgt_mask=mask, src_key_padding_mask=_as(src, pad),
                          memory_key_padding_mask=_as(src, pad), tgt_is_causal=True)

    return M()


def _Dec(nn):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            # A callable activation (a Module one is lost by torch's deep copy of the layer:
            # TransformerDecoderLayer.__setstate__ puts F.relu back).
            layer = nn.TransformerDecoderLayer(8, 2, 12, 0.0, nn.functional.gelu,
                                               batch_first=True, bias=False)
            self.dec = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(8, bias=False))
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(
                8, 2, 12, 0.0, batch_first=True), 1, enable_nested_tensor=False)

        def forward(self, src, tgt):
            m = self.enc(src)
            mm = _as(src, torch.zeros(tgt.shape[1], src.shape[1]))  # float memory_mask
            return self.dec(tgt, m, memory_mask=mm, tgt_is_causal=True,
                            tgt_mask=_as(src, torch.ones(tgt.shape[1], tgt.shape[1],
                                                         dtype=torch.bool).triu(1)))

    return M()


def _probs(*shape):
    return lambda g: torch.rand(shape, generator=g).softmax(-1)


def _unit(*shape):
    return lambda g: torch.rand(shape, generator=g)


def _signs(n):
    return lambda g: torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def _tensor(nn, values):
    """A buffer value for ``nn``: a torch tensor for torch.nn, an sbpflow one for ours."""
    return values if nn is torch.nn else sbpflow.tensor(values)


def _Head(nn, head, pre=None, n_in=1, out=5):
    """A Linear(4, out) projection of each of ``n_in`` inputs (optionally through ``pre``),
    then ``head`` on them and the remaining inputs (targets)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, out)
            self.head = head

        def forward(self, *xs):
            ys = [self.proj(x) for x in xs[:n_in]]
            if pre is not None:
                ys = [pre(y) for y in ys]
            return self.head(*ys, *xs[n_in:])

    return M()


def _Unpool(nn, n: int):
    """MaxPool{n}d(2, return_indices) -> MaxUnpool{n}d(2) back to the input's size, then
    LPPool and adaptive max pooling of the same rank (Conv first: parameter gradients)."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[n - 1]
    pool = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[n - 1]
    unpool = (nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d)[n - 1]
    lp = (nn.LPPool1d, nn.LPPool2d, nn.LPPool3d)[n - 1]
    amax = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)[n - 1]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv(2, 3, 1)
            self.pool, self.unpool = pool(2, return_indices=True), unpool(2)
            self.lp, self.amax = lp(2, 2, stride=1), amax(2, return_indices=True)

        def forward(self, x):
            y = self.conv(x)
            v, i = self.pool(y)
            u = self.unpool(v, i, output_size=y.shape)
            return self.lp(u + y) + self.amax(y)[0].sum()

    return M()


def _Bil(nn):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bil = nn.Bilinear(4, 3, 5)

        def forward(self, a, b):
            return self.bil(a, b)

    return M()


def _lazy(nn, module, *shape):
    """``module`` materialised by a forward on zeros of ``shape`` (the same draws on both
    sides: the oracle then compares the materialised parameters with torch's)."""
    x = torch.zeros(shape)
    module(x if nn is torch.nn else sbpflow.tensor(x))
    return module


# name -> (builder(nn) -> module, input makers): batch dim 0, parameter gradients
LAYERS = {
    "Linear": (lambda nn: nn.Linear(6, 5), [_f(7, 6)]),
    "Linear_nobias_3d": (lambda nn: nn.Linear(6, 5, bias=False), [_f(3, 4, 6)]),
    "Conv1d": (lambda nn: nn.Conv1d(3, 4, 3, padding=1, stride=2), [_f(4, 3, 9)]),
    "Conv2d": (lambda nn: nn.Conv2d(3, 4, 3, padding="same", dilation=2), [_f(4, 3, 7, 6)]),
    "Conv2d_groups": (lambda nn: nn.Conv2d(4, 6, 2, groups=2, bias=False), [_f(2, 4, 5, 5)]),
    "BatchNorm1d": (lambda nn: nn.BatchNorm1d(5), [_f(8, 5)]),
    "BatchNorm2d": (lambda nn: nn.BatchNorm2d(3, momentum=0.3), [_f(4, 3, 5, 5)]),
    "LayerNorm": (lambda nn: nn.LayerNorm(6), [_f(5, 3, 6)]),
    "RMSNorm": (lambda nn: nn.RMSNorm([3, 6], eps=1e-6), [_f(5, 3, 6)]),
    "GroupNorm": (lambda nn: nn.GroupNorm(2, 4), [_f(4, 4, 5)]),
    "Embedding": (lambda nn: nn.Embedding(11, 4, padding_idx=2), [_i(11, 6, 3)]),
    "Dropout": (lambda nn: nn.Dropout(0.3), [_f(6, 5)]),
    "activations": (lambda nn: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6),
                                             nn.GELU("tanh"), nn.Linear(6, 6), nn.SiLU(),
                                             nn.Tanh(), nn.Sigmoid(), nn.Identity()),
                    [_f(5, 4)]),
    "Softmax": (lambda nn: nn.Sequential(nn.Linear(4, 6), nn.Softmax(dim=1)), [_f(5, 4)]),
    "LogSoftmax": (lambda nn: nn.Sequential(nn.Linear(4, 6), nn.LogSoftmax(-1)), [_f(5, 4)]),
    "pools": (lambda nn: nn.Sequential(nn.Conv2d(2, 3, 3), nn.MaxPool2d(2),
                                       nn.AvgPool2d(2, stride=1), nn.AdaptiveAvgPool2d((2, 1)),
                                       nn.Flatten()), [_f(4, 2, 11, 9)]),
    "ModuleList_Dict": (lambda nn: _ListDict(nn), [_f(5, 4)]),
    "MultiheadAttention": (lambda nn: _MHA(nn, batch_first=True, need_weights=True),
                           [_f(4, 5, 8)]),
    "MultiheadAttention_seq_first": (lambda nn: _MHA(nn, batch_first=False, need_weights=False),
                                     [_f(5, 4, 8)]),
    "TransformerEncoderLayer": (lambda nn: nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, batch_first=True), [_f(4, 5, 8)]),
    "TransformerEncoderLayer_prenorm_gelu": (lambda nn: nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, activation="gelu", norm_first=True),
        [_f(5, 4, 8)]),
    "CrossEntropyLoss": (lambda nn: _Loss(nn, nn.CrossEntropyLoss(label_smoothing=0.1,
                                                                  ignore_index=1)),
                         [_f(6, 4), _i(5, 6)]),
    "NLLLoss": (lambda nn: _Loss(nn, nn.NLLLoss(reduction="sum"), log=True),
                [_f(6, 4), _i(5, 6)]),
    "MSELoss": (lambda nn: _Loss(nn, nn.MSELoss()), [_f(6, 4), _f(6, 5)]),
    "L1Loss": (lambda nn: _Loss(nn, nn.L1Loss(reduction="sum")), [_f(6, 4), _f(6, 5)]),
    "BCEWithLogitsLoss": (lambda nn: _Loss(nn, nn.BCEWithLogitsLoss()),
                          [_f(6, 4), lambda g: torch.rand((6, 5), generator=g)]),
    "activations_more": (lambda nn: nn.Sequential(
        nn.Linear(4, 6), nn.LeakyReLU(0.2), nn.Linear(6, 6), nn.ELU(0.5), nn.Hardswish(),
        nn.Linear(6, 6), nn.Hardsigmoid(), nn.Mish(), nn.Softplus(2.0, 10.0),
        nn.Hardtanh(-0.5, 0.5), nn.Linear(6, 6), nn.ReLU6(), nn.SELU(), nn.CELU(0.7),
        nn.LogSigmoid(), nn.Softsign(), nn.Tanhshrink(), nn.Linear(6, 6), nn.Softshrink(0.1),
        nn.Hardshrink(0.05), nn.Threshold(0.1, -1.0), nn.LeakyReLU()), [_f(6, 4)]),
    "PReLU_channels": (lambda nn: nn.Sequential(nn.Linear(4, 6), nn.PReLU(6, init=0.1),
                                                nn.Linear(6, 3), nn.PReLU()), [_f(6, 4)]),
    "GLU_Softmin": (lambda nn: nn.Sequential(nn.Linear(4, 8), nn.GLU(), nn.Softmin(dim=1)),
                    [_f(6, 4)]),
    "KLDivLoss": (lambda nn: _Head(nn, nn.KLDivLoss(reduction="batchmean"),
                                   pre=lambda y: y.log_softmax(-1)), [_f(6, 4), _probs(6, 5)]),
    "KLDivLoss_log_target": (lambda nn: _Head(nn, nn.KLDivLoss(reduction="sum", log_target=True),
                                              pre=lambda y: y.log_softmax(-1)),
                             [_f(6, 4), _f(6, 5)]),
    "SmoothL1Loss": (lambda nn: _Head(nn, nn.SmoothL1Loss(beta=0.5)), [_f(6, 4), _f(6, 5)]),
    "HuberLoss": (lambda nn: _Head(nn, nn.HuberLoss(reduction="sum", delta=0.5)),
                  [_f(6, 4), _f(6, 5)]),
    "BCELoss": (lambda nn: _Head(nn, nn.BCELoss(weight=_tensor(nn, torch.arange(1.0, 6.0) / 5)),
                                 pre=lambda y: y.sigmoid()), [_f(6, 4), _unit(6, 5)]),
    "MarginRankingLoss": (lambda nn: _Head(nn, nn.MarginRankingLoss(margin=0.1),
                                           pre=lambda y: y.sum(1), n_in=2),
                          [_f(6, 4), _f(6, 4), _signs(6)]),
    "CosineEmbeddingLoss": (lambda nn: _Head(nn, nn.CosineEmbeddingLoss(margin=0.2), n_in=2),
                            [_f(6, 4), _f(6, 4), _signs(6)]),
    "TripletMarginLoss": (lambda nn: _Head(nn, nn.TripletMarginLoss(margin=0.5, swap=True),
                                           n_in=3), [_f(6, 4), _f(6, 4), _f(6, 4)]),
    "CosineSimilarity": (lambda nn: _Head(nn, nn.CosineSimilarity(dim=1), n_in=2),
                         [_f(6, 4), _f(6, 4)]),
    "PairwiseDistance": (lambda nn: _Head(nn, nn.PairwiseDistance(p=1.5, keepdim=True), n_in=2),
                         [_f(6, 4), _f(6, 4)]),
    # structured layers (issue 21)
    "pools_3d": (lambda nn: nn.Sequential(
        nn.Conv3d(2, 3, 2, padding=1), nn.MaxPool3d(2), nn.AvgPool3d(2, stride=1, padding=1),
        nn.AdaptiveAvgPool3d((2, 2, 1)), nn.AdaptiveMaxPool3d(1), nn.LPPool3d(2, 1),
        nn.Flatten()), [_f(6, 2, 4, 4, 3)]),
    # SyncBatchNorm is BatchNorm over the global batch: torch's BatchNorm on the whole batch
    "SyncBatchNorm": (lambda nn: nn.Sequential(nn.Conv2d(3, 4, 1), (
        nn.SyncBatchNorm if nn is sbpflow.nn else nn.BatchNorm2d)(4, momentum=0.2)),
        [_f(6, 3, 4, 3)]),
    "DataParallel": (lambda nn: nn.DataParallel(nn.Sequential(nn.Linear(4, 5), nn.Tanh())),
                     [_f(6, 4)]),
    "FractionalMaxPool": (lambda nn: nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.FractionalMaxPool2d(2, output_ratio=0.6), nn.Unflatten(2, (2, 2)),
        nn.FractionalMaxPool3d((1, 1, 2), output_size=(1, 1, 2))), [_f(6, 2, 7, 8)]),
}

# name -> (builder(nn) -> module, input makers, batch dim of the inputs): input gradients too
LAYERS_INPUT_GRADS = {
    "ParameterList_Dict": (_Params, [_f(6, 4)], 0),
    "Transformer": (lambda nn: _Tf(nn, False, False, "relu"), [_f(5, 4, 8), _f(3, 4, 8)], 1),
    "Transformer_batch_first_prenorm_gelu": (lambda nn: _Tf(nn, True, True, "gelu"),
                                             [_f(4, 5, 8), _f(4, 3, 8)], 0),
    "TransformerDecoder": (_Dec, [_f(4, 5, 8), _f(4, 3, 8)], 0),
    "ConvTranspose1d": (lambda nn: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1,
                                                      output_padding=1), [_f(5, 3, 7)], 0),
    "ConvTranspose2d": (lambda nn: nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 1), padding=1,
                                                      groups=2, dilation=2, bias=False),
                        [_f(3, 4, 5, 4)], 0),
    "pools_1d": (lambda nn: nn.Sequential(nn.Conv1d(2, 4, 3), nn.MaxPool1d(3, 2, 1),
                                          nn.AvgPool1d(2, 1, count_include_pad=False),
                                          nn.AdaptiveAvgPool1d(3)), [_f(5, 2, 13)], 0),
    "resample_2d": (lambda nn: nn.Sequential(
        nn.Conv2d(2, 8, 3), nn.PixelShuffle(2), nn.ReflectionPad2d((1, 0, 2, 1)),
        nn.AdaptiveMaxPool2d((3, 4)), nn.Upsample(scale_factor=2, mode="bilinear"),
        nn.ReplicationPad2d(1), nn.ZeroPad2d((0, 2, 1, 1)), nn.ConstantPad2d(1, 0.5),
        nn.PixelUnshuffle(2)), [_f(3, 2, 7, 8)], 0),
    "pads_1d": (lambda nn: nn.Sequential(nn.Linear(5, 6), nn.ConstantPad1d((1, 2), -1.0),
                                         nn.ReflectionPad1d(2)), [_f(4, 3, 5)], 0),
    "Dropout2d": (lambda nn: nn.Sequential(nn.Conv2d(3, 5, 1), nn.Dropout2d(0.4)),
                  [_f(6, 3, 4, 3)], 0),
    "InstanceNorm": (lambda nn: nn.Sequential(
        nn.Conv1d(3, 4, 2), nn.InstanceNorm1d(4), nn.Unflatten(2, (2, 3)),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True)), [_f(5, 3, 7)], 0),
    # a channel split (dim 1) passes, with the affine weight and bias split along C
    "InstanceNorm2d_channels": (lambda nn: nn.InstanceNorm2d(5, affine=True),
                                [_f(3, 5, 4, 4)], 1),
    # structured layers (issue 21)
    "conv_3d": (lambda nn: nn.Sequential(
        nn.Conv3d(2, 4, 2), nn.BatchNorm3d(4), nn.ConvTranspose3d(4, 2, 2, stride=2),
        nn.InstanceNorm3d(2, affine=True, track_running_stats=True)), [_f(5, 2, 3, 3, 2)], 0),
    "unpool_1d": (lambda nn: _Unpool(nn, 1), [_f(5, 2, 8)], 0),
    "unpool_2d": (lambda nn: _Unpool(nn, 2), [_f(5, 2, 6, 4)], 0),
    "unpool_3d": (lambda nn: _Unpool(nn, 3), [_f(5, 2, 4, 2, 4)], 0),
    "fold_lrn_resample": (lambda nn: nn.Sequential(
        nn.Conv2d(2, 6, 1), nn.LocalResponseNorm(3), nn.CrossMapLRN2d(3, k=2.0),
        nn.ChannelShuffle(3), nn.Unfold(2, padding=1), nn.Fold((5, 4), 2, padding=1),
        nn.Softmax2d(), nn.UpsamplingNearest2d(scale_factor=2),
        nn.UpsamplingBilinear2d(size=(7, 9))), [_f(4, 2, 5, 4)], 0),
    "pads_3d_circular": (lambda nn: nn.Sequential(
        nn.Conv3d(2, 3, 1), nn.ConstantPad3d(1, 0.5), nn.ZeroPad3d((1, 0, 0, 1, 1, 0)),
        nn.ReflectionPad3d(1), nn.ReplicationPad3d((0, 1, 1, 0, 2, 0)), nn.CircularPad3d(1),
        nn.Flatten(3), nn.CircularPad2d((1, 0, 2, 1)), nn.Flatten(2), nn.CircularPad1d(2)),
        [_f(3, 2, 3, 3, 2)], 0),
    "Bilinear": (_Bil, [_f(6, 4), _f(6, 3)], 0),
    "Lazy_2d": (lambda nn: _lazy(nn, nn.Sequential(
        nn.LazyConv2d(4, 2), nn.LazyBatchNorm2d(), nn.LazyConvTranspose2d(3, 2, stride=2),
        nn.LazyInstanceNorm2d(), nn.Flatten(), nn.LazyLinear(5)), 2, 2, 4, 3),
        [_f(4, 2, 4, 3)], 0),
    "Lazy_1d_3d": (lambda nn: _lazy(nn, nn.Sequential(
        nn.LazyConv3d(3, (1, 2, 1)), nn.LazyBatchNorm3d(momentum=0.3), nn.Flatten(2),
        nn.LazyConv1d(4, 2, groups=1), nn.LazyBatchNorm1d(affine=False),
        nn.LazyConvTranspose1d(2, 2, groups=2), nn.LazyInstanceNorm1d(affine=False),
        nn.Unflatten(2, (2, -1)), nn.Unflatten(3, (1, -1)), nn.LazyInstanceNorm3d(),
        nn.LazyConvTranspose3d(2, 1)), 2, 2, 2, 3, 2), [_f(5, 2, 2, 3, 2)], 0),
}


def _classes(*values):
    return lambda g: torch.tensor(values)


def _signs2(*shape):
    return lambda g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1


def _multilabel(n, c):
    """Multilabel margin targets (N, C): each row's classes, then -1."""

    def make(g):
        t = torch.randint(0, c, (n, c), generator=g)
        for i in range(n):
            t[i, i % c] = -1
        return t

    return make


# issue 21: random layers (the same masks as torch's under the batch split), losses, attention
LAYERS.update({
    "dropouts_alpha_rrelu": (lambda nn: nn.Sequential(
        nn.Linear(5, 6), nn.AlphaDropout(0.3), nn.Linear(6, 6), nn.FeatureAlphaDropout(0.2),
        nn.RReLU(0.1, 0.3), nn.Linear(6, 4), nn.Dropout1d(0.4)), [_f(6, 3, 5)]),
    "Dropout3d": (lambda nn: nn.Sequential(nn.Linear(3, 4), nn.Dropout3d(0.5)),
                  [_f(6, 2, 2, 3, 3)]),
    "PoissonNLLLoss": (lambda nn: _Head(nn, nn.PoissonNLLLoss(full=True)),
                       [_f(6, 4), lambda g: torch.rand((6, 5), generator=g) * 3]),
    "GaussianNLLLoss": (lambda nn: _Head(nn, nn.GaussianNLLLoss(full=True, reduction="sum")),
                        [_f(6, 4), _f(6, 5), lambda g: torch.rand((6,), generator=g) + 0.1]),
    "HingeEmbedding_SoftMargin": (lambda nn: _Head(nn, _Sum(nn, nn.HingeEmbeddingLoss(margin=0.5),
                                                            nn.SoftMarginLoss(reduction="sum"))),
                                  [_f(6, 4), _signs2(6, 5)]),
    "MultiLabelSoftMarginLoss": (lambda nn: _Head(nn, nn.MultiLabelSoftMarginLoss(
        weight=_tensor(nn, torch.arange(1.0, 6.0) / 5))),
        [_f(6, 4), lambda g: torch.randint(0, 2, (6, 5), generator=g).float()]),
    "MultiMargin_MultiLabelMargin": (lambda nn: _Head(nn, _Sum(
        nn, nn.MultiMarginLoss(p=2, margin=0.5, weight=_tensor(nn, torch.arange(1.0, 6.0) / 5)),
        nn.MultiLabelMarginLoss(reduction="sum"), targets=[0, 1])),
        [_f(6, 4), _i(5, 6), _multilabel(6, 5)]),
    "TripletMarginWithDistanceLoss": (lambda nn: _Head(nn, nn.TripletMarginWithDistanceLoss(
        distance_function=lambda a, b: 1.0 - nn.functional.cosine_similarity(a, b), swap=True),
        n_in=3), [_f(6, 4), _f(6, 4), _f(6, 4)]),
    "CTCLoss": (lambda nn: _CTC(nn), [_f(6, 7, 4), lambda g: torch.randint(1, 5, (6, 3),
                                                                            generator=g),
                                      lambda g: torch.tensor([7, 6, 7, 5, 4, 7]),
                                      lambda g: torch.tensor([3, 2, 1, 0, 3, 2])]),
    "NLLLoss2d": (lambda nn: _Loss(nn, nn.NLLLoss2d(), log=True), [_f(6, 4), _i(5, 6)]),
    "LinearCrossEntropyLoss": (lambda nn: nn.LinearCrossEntropyLoss(
        4, 5, bias=True, label_smoothing=0.1), [_f(6, 4), _i(5, 6)]),
    "LinearCrossEntropyLoss_kdim": (lambda nn: nn.LinearCrossEntropyLoss(
        4, 5, out_features=(2,), weight=_tensor(nn, torch.arange(1.0, 6.0))),
        [_f(6, 4), _i(5, 6, 2)]),
    # targets in the shortlist [0, 3) and both clusters [3, 6), [6, 10)
    "AdaptiveLogSoftmaxWithLoss": (lambda nn: _ASM(nn), [_f(6, 8), _classes(0, 4, 7, 9, 2, 5)]),
    "AdaptiveLogSoftmax_log_prob": (lambda nn: _ASM(nn, log_prob=True),
                                    [_f(6, 8), _classes(0, 4, 7, 9, 2, 5)]),
})
LAYERS_INPUT_GRADS.update({
    "MultiheadAttention_kdim_bias_kv_zero_attn": (lambda nn: _MHA_kv(nn),
                                                  [_f(6, 4, 8), _f(6, 5, 5), _f(6, 5, 3)], 0),
})

# Run on 2 ranks only (the others on 4 as well): the larger stacks of LAYERS_INPUT_GRADS.
TWO_RANKS_ONLY = ["ConvTranspose1d", "InstanceNorm2d_channels", "Transformer", "TransformerDecoder",
                  "pads_1d", "pools_1d", "resample_2d"]


def run(name: str, mode: str) -> str:
    """Check layer ``name`` in ``mode`` (``"local"`` or ``"dp"``): ``"ok"`` or raises."""
    if name in LAYERS:
        build, makers = LAYERS[name]
        return check_layer(name, build, makers, mode)
    build, makers, bdim = LAYERS_INPUT_GRADS[name]
    return check_layer(name, build, makers, mode, bdim=bdim, input_grads=True)


@pytest.mark.parametrize("name", sorted({**LAYERS, **LAYERS_INPUT_GRADS}))
def test_layer_local_matches_torch(name):
    run(name, "local")


@pytest.mark.parametrize("world", [2, 4])
def test_layers_data_parallel_match_torch(dist_run, world):
    names = sorted(n for n in {**LAYERS, **LAYERS_INPUT_GRADS}
                   if world == 2 or n not in TWO_RANKS_ONLY)
    assert dist_run(world, run_layers, __name__, names)[0] == ["ok"] * len(names)


def _ListDict(nn):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).tanh()
            return self.heads["a"](x).sum(1) + self.heads["b"](x).sum(1)

    return M()


def _MHA(nn, batch_first, need_weights):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)

        def forward(self, x):
            out, w = self.attn(x, x, x, need_weights=need_weights)
            return out if w is None else out + w.sum()

    return M()


def _Loss(nn, loss, log=False):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 5)
            self.loss = loss

        def forward(self, x, target):
            y = self.proj(x)
            if log:
                y = y.log_softmax(-1)
            return self.loss(y, target)

    return M()


def _Sum(nn, *losses, targets=None):
    """The sum of ``losses`` of the same prediction; loss ``i`` takes target
    ``targets[i]`` of the remaining inputs (all of them by default)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.losses = nn.ModuleList(losses)

        def forward(self, y, *ts):
            total = None
            for i, loss in enumerate(self.losses):
                v = loss(y, *(ts if targets is None else (ts[targets[i]],)))
                total = v if total is None else total + v
            return total

    return M()


def _CTC(nn):
    """(N, T, 4) features -> Linear -> (T, N, C) log-probabilities -> CTCLoss."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 5)
            self.ctc = nn.CTCLoss(zero_infinity=True)

        def forward(self, x, targets, input_lengths, target_lengths):
            lp = self.proj(x).transpose(0, 1).log_softmax(2)
            return self.ctc(lp, targets, input_lengths, target_lengths)

    return M()


def _ASM(nn, log_prob=False):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.asm = nn.AdaptiveLogSoftmaxWithLoss(8, 10, [3, 6], div_value=2.0,
                                                     head_bias=True)

        def forward(self, x, target):
            if log_prob:
                return self.asm.log_prob(x)
            out, loss = self.asm(x, target)
            return out + loss

    return M()


def _MHA_kv(nn):
    """kdim/vdim (separate projection weights), bias_k/v, a zero attention, dropout on the
    weights (layout-invariant mask), a key padding mask."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, dropout=0.3, add_bias_kv=True,
                                              add_zero_attn=True, kdim=5, vdim=3,
                                              batch_first=True)

        def forward(self, x, k, v):
            pad = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool)
            pad[1, -2:] = True
            if isinstance(x, sbpflow.Tensor) and x.is_global:
                pad = sbpflow.tensor(pad, placement=x.placement, sbp=x.sbp)
            elif isinstance(x, sbpflow.Tensor):
                pad = sbpflow.tensor(pad)
            out, w = self.attn(x, k, v, key_padding_mask=pad, average_attn_weights=False)
            return out + w.sum()

    return M()

def _per_rank_batchnorm():
    pl = sbpflow.placement.all("cpu")
    rank = sbpflow.distributed.get_rank()
    g = torch.Generator().manual_seed(0)
    xv = torch.randn(8, 3, 4, 4, generator=g)
    bn = sbpflow.nn.BatchNorm2d(3, momentum=0.2, sync_stats=False).to_global(pl)
    out = bn(sbpflow.tensor(xv, placement=pl, sbp=split(0)))
    ref = torch.nn.BatchNorm2d(3, momentum=0.2)
    mine = xv[rank * 4:(rank + 1) * 4]
    want = ref(mine)  # each rank normalises with its own part's statistics
    assert np.allclose(out.to_local().to_torch().detach().numpy(), want.detach().numpy(),
                       atol=1e-5)
    first = torch.nn.BatchNorm2d(3, momentum=0.2)
    first(xv[:4])  # the running statistics are rank 0's, on every rank
    for got, exp in ((bn.running_mean, first.running_mean), (bn.running_var, first.running_var)):
        assert np.allclose(got.to_local().to_torch().numpy(), exp.numpy(), atol=1e-6)
    return "ok"


def test_batchnorm_per_rank_statistics(dist_run):
    dist_run(2, _per_rank_batchnorm)


def _batchnorm_on_a_whole_batch(sync_stats: bool):
    """A broadcast input (every rank the whole batch, as on one rank or under a layout
    that keeps the batch whole) takes torch's fused kernel whatever ``sync_stats``: the
    output, the parameters' gradients (summed once, not once per rank) and the running
    statistics equal torch's on the whole batch, with no collective for the
    statistics."""
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(1)
    xv, dy = torch.randn(8, 3, 4, 4, generator=g), torch.randn(8, 3, 4, 4, generator=g)
    bn = sbpflow.nn.BatchNorm2d(3, momentum=0.2, sync_stats=sync_stats).to_global(pl)
    ref = torch.nn.BatchNorm2d(3, momentum=0.2)
    with torch.no_grad():
        ref.weight.copy_(torch.arange(1.0, 4.0))
        bn.weight._local.copy_(torch.arange(1.0, 4.0))
    x = sbpflow.tensor(xv, placement=pl, sbp=B)
    with CommRecorder() as rec, sbpflow.ops.observe() as ops:
        out = bn(x)
    assert rec.records == [], [r.kind for r in rec.records]
    assert ops == [], [r.op for r in ops]  # the fused kernel, not the written-out form
    (out * sbpflow.tensor(dy, placement=pl, sbp=B)).sum().backward()
    want = ref(xv)
    (want * dy).sum().backward()
    np.testing.assert_allclose(out.to_local().to_torch().detach().numpy(),
                               want.detach().numpy(), atol=1e-5)
    for got, exp in ((bn.weight.grad, ref.weight.grad), (bn.bias.grad, ref.bias.grad),
                     (bn.running_mean, ref.running_mean), (bn.running_var, ref.running_var)):
        np.testing.assert_allclose(got.to_local().to_torch().numpy(), exp.numpy(), atol=1e-5)
    return True


def test_batchnorm_on_a_whole_batch_runs_the_fused_kernel(dist_run):
    for sync in (True, False):
        assert all(dist_run(2, _batchnorm_on_a_whole_batch, sync))


def _per_rank_batchnorm_coalesced(mesh):
    """Per-rank BatchNorm statistics: each layer updates its own running statistics and
    the outermost module call broadcasts them all at its end, once per mesh axis of the
    batch split; a layer called twice in one forward takes the first call's broadcast
    values before its second update (as one broadcast per layer did)."""
    pl = sbpflow.placement("cpu", mesh)
    rank = sbpflow.distributed.get_rank()
    sbpflow.manual_seed(0)
    net = sbpflow.nn.Sequential(sbpflow.nn.BatchNorm2d(3, momentum=0.2, sync_stats=False),
                                sbpflow.nn.Conv2d(3, 4, 1),
                                sbpflow.nn.BatchNorm2d(4, momentum=0.3, sync_stats=False))
    net.to_global(pl)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.2), torch.nn.Conv2d(3, 4, 1),
                              torch.nn.BatchNorm2d(4, momentum=0.3))
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 3, 4, 4, generator=g) for _ in range(2)]
    x4 = torch.randn(8, 4, 4, 4, generator=g)
    sbp = (split(0), B) if len(pl.shape) == 2 else split(0)
    dp = pl.shape[0]
    first = slice(0, 8 // dp)  # the first data-parallel coordinate's rows: its stats win
    kinds = []
    for x in xs:
        gx = sbpflow.tensor(x, placement=pl, sbp=sbp)
        with CommRecorder() as rec:
            net(gx)
        kinds.append([(r.kind, r.axis, r.bytes) for r in rec.records])
        ref(x[first])
    want = {k: v.numpy() for k, v in ref.state_dict().items()}
    for k, v in net.state_dict().items():  # this rank's shard: rank 0's values everywhere
        assert np.allclose(v.to_local().to_torch().numpy(), want[k], atol=1e-6), (rank, k)
    # One layer called twice in one forward: the second call flushes the first call's
    # statistics before it reads them; one more broadcast at the end.
    twice = _Twice(net[2])
    gx = sbpflow.tensor(x4, placement=pl, sbp=sbp)
    with CommRecorder() as rec:
        twice(gx)
    kinds.append([(r.kind, r.axis, r.bytes) for r in rec.records])
    ref[2](ref[2](x4[first]))
    for k, v in net[2].state_dict().items():
        assert np.allclose(v.to_local().to_torch().numpy(), ref[2].state_dict()[k].numpy(),
                           atol=1e-6), (rank, k)
    return kinds


class _Twice(sbpflow.nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x):
        return self.bn(self.bn(x))


@pytest.mark.parametrize("world,mesh", [(2, [0, 1]), (4, [[0, 1], [2, 3]])])
def test_batchnorm_per_rank_statistics_one_coalesced_broadcast(dist_run, world, mesh):
    kinds = dist_run(world, _per_rank_batchnorm_coalesced, mesh)
    # (3 + 4 channels) x (mean, var) x 4 bytes in one broadcast over the data-parallel axis
    # 0 per forward (was one per layer); the layer called twice: 2 x 4 x 2 x 4 bytes
    assert kinds == [[[("broadcast", 0, 56)]] * 2 + [[("broadcast", 0, 32)] * 2]] * world, \
        kinds


# ------------------------------------------------------------------ layouts and collectives
def _conv_transpose_layouts():
    """conv_transpose2d on 2 ranks, each signature against torch, with the collectives
    it runs in forward."""
    from sbpflow.nn import functional as F
    from sbpflow.sbp import partial_sum as P
    pl = sbpflow.placement.all("cpu")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 4, 3, 3, generator=g), torch.randn(4, 6, 2, 2, generator=g), \
        torch.randn(6, generator=g)
    ref = torch.nn.functional.conv_transpose2d(x, w, b, stride=2)
    problems = []
    # (x, w, b) layouts -> (output sbp, collectives in forward)
    table = [((split(0), B, B), split(0), []),       # data parallel
             ((B, split(1), split(0)), split(1), []),  # output channels split
             ((split(1), split(0), B), B, ["all_reduce"]),  # in-channels: P, boxed to B
             ((split(2), B, B), split(0), ["all_to_all"])]  # H split: re-split on batch
    for (sx, sw, sb), want, comms in table:
        xs = [sbpflow.tensor(v, placement=pl, sbp=s) for v, s in ((x, sx), (w, sw), (b, sb))]
        with CommRecorder() as rec:
            out = F.conv_transpose2d(*xs, stride=2)
            if out.sbp == (P,):
                out = out.to_global(sbp=B)
        if out.sbp != (want,) or rec.kinds() != comms:
            problems.append(f"{(sx, sw, sb)}: got {out.sbp} with {rec.kinds()}")
        if not np.allclose(out.numpy(), ref.numpy(), atol=1e-5):
            problems.append(f"{(sx, sw, sb)}: values differ")
    return problems


def test_conv_transpose_layouts(dist_run):
    results = dist_run(2, _conv_transpose_layouts)
    assert results[0] == [], "\n".join(results[0])


def _dp_forward_backward_no_collectives():
    """Data-parallel Transformer and ConvTranspose2d: forward runs no collective (the batch
    split passes through); backward only the gradient all-reduces of the B parameters."""
    pl = sbpflow.placement.all("cpu")
    out = []
    for build, shapes in ((lambda nn: nn.Transformer(8, 2, 1, 1, 16, 0.0, batch_first=True),
                           [(4, 5, 8), (4, 3, 8)]),
                          (lambda nn: nn.ConvTranspose2d(3, 4, 3, stride=2), [(4, 3, 5, 5)])):
        sbpflow.manual_seed(0)
        m = build(sbpflow.nn).to_global(pl, B)
        xs = [sbpflow.randn(*s, placement=pl, sbp=split(0)) for s in shapes]
        with CommRecorder() as fwd:
            y = m(*xs)
        with CommRecorder() as bwd:
            y.sum().backward()
        out.append((fwd.kinds(), y.sbp == (split(0),), set(bwd.kinds()) <= {"all_reduce"}))
    return out


def test_data_parallel_forward_runs_no_collective(dist_run):
    for kinds, split_out, only_grad_sync in dist_run(2, _dp_forward_backward_no_collectives)[0]:
        assert kinds == [] and split_out and only_grad_sync


def _dropout2d_layouts():
    """Dropout2d gives torch's value under S(0), S(1), S(2), B and P (noise drawn whole)."""
    from sbpflow.sbp import partial_sum as P
    pl = sbpflow.placement.all("cpu")
    x = torch.randn(4, 6, 3, 2, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    ref = torch.nn.functional.dropout2d(x, 0.5)
    bad = []
    for s in (split(0), split(1), split(2), B, P):
        xs = sbpflow.tensor(x, placement=pl, sbp=s)
        sbpflow.manual_seed(5)
        y = sbpflow.nn.functional.dropout2d(xs, 0.5)
        if y.sbp != (s,) or not np.array_equal(y.numpy(), ref.numpy()):
            bad.append(repr(s))
    return bad


def test_dropout2d_layout_invariant(dist_run):
    assert dist_run(2, _dropout2d_layouts)[0] == []


def _parallelize_and_checkpoint(path):
    """A ParameterList/Dict under parallelize_module (a 2x2 mesh: DP x TP) and
    sbpflow.save/load round trip; values equal the local module's."""
    from sbpflow.nn.parallel import ColwiseParallel, parallelize_module
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    sbpflow.manual_seed(0)
    m = _Params(sbpflow.nn)
    m.proj = sbpflow.nn.Linear(3, 4)
    ref = {k: v.numpy() for k, v in m.state_dict().items()}
    parallelize_module(m, pl, {"proj": ColwiseParallel()})
    assert m.ws[0].placement == pl and m.bs["a"].sbp == (B, B)
    assert m.proj.weight.sbp == (B, split(0))
    x = sbpflow.randn(6, 4, placement=pl, sbp=(split(0), B))
    y = m.proj(m(x))
    y.sum().backward()
    assert m.ws[2].grad is not None and m.bs["b"].grad.sbp == (B, B)
    sbpflow.save(m.state_dict(), path)
    sbpflow.manual_seed(1)
    m2 = _Params(sbpflow.nn)
    m2.proj = sbpflow.nn.Linear(3, 4)
    parallelize_module(m2, pl, {"proj": ColwiseParallel()})
    m2.load_state_dict(sbpflow.load(path))
    got = {k: v.numpy() for k, v in m2.state_dict().items()}
    assert list(got) == list(ref) and all(np.array_equal(got[k], ref[k]) for k in ref)
    return "ok"


def test_parameter_containers_parallelize_and_checkpoint(dist_run, tmp_path):
    dist_run(4, _parallelize_and_checkpoint, str(tmp_path / "ckpt"))


# ------------------------------------------------------------------ state dicts with torch
_STATE = {
    "ParameterList_Dict": lambda nn: _Params(nn),
    "Transformer": lambda nn: nn.Transformer(8, 2, 1, 2, 16, 0.0),
    "ConvTranspose2d": lambda nn: nn.ConvTranspose2d(4, 6, 3, groups=2),
    "InstanceNorm2d": lambda nn: nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
    "pools_pads": lambda nn: nn.Sequential(nn.Conv2d(2, 4, 3), nn.AdaptiveMaxPool2d(2),
                                           nn.ZeroPad2d(1), nn.PixelShuffle(2)),
}


@pytest.mark.parametrize("name", sorted(_STATE))
def test_state_dict_round_trip_with_torch(name):
    torch.manual_seed(3)
    tm = _STATE[name](torch.nn)
    with torch.no_grad():
        for p in tm.parameters():
            p.add_(1.0)  # differ from a fresh init
    sbpflow.manual_seed(9)
    sm = _STATE[name](sbpflow.nn)
    tsd = tm.state_dict()
    assert list(sm.state_dict()) == list(tsd)
    sm.load_state_dict(tsd)
    back = {k: torch.from_numpy(v.numpy()) for k, v in sm.state_dict().items()}
    torch.manual_seed(4)
    tm2 = _STATE[name](torch.nn)
    tm2.load_state_dict(back)
    for k, v in tm2.state_dict().items():
        assert torch.equal(v, tsd[k]), k


# ------------------------------------------------------------------ containers
def test_parameter_list_semantics():
    nn = sbpflow.nn
    pl = nn.ParameterList([torch.ones(2), sbpflow.zeros(3)])
    pl.append(nn.Parameter(torch.ones(1)))
    pl.extend([torch.ones(4)])
    pl += [torch.ones(5)]
    assert len(pl) == 5 and [n for n, _ in pl.named_parameters()] == list("01234")
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in pl)
    assert tuple(pl[-1].shape) == (5,) and [tuple(p.shape) for p in pl[1:3]] == [(3,), (1,)]
    pl[0] = torch.zeros(7)
    assert tuple(pl[0].shape) == (7,) and tuple(pl.get_parameter("0").shape) == (7,)
    pl.append("note")  # non-tensors are plain attributes, as in torch
    assert pl[5] == "note" and len(list(pl.parameters())) == 5
    with pytest.raises(IndexError, match="out of range"):
        pl[9]
    with pytest.raises(TypeError, match="integers or slices"):
        pl["0"]
    with pytest.raises(TypeError, match="iterable"):
        pl.extend(torch.ones(2))


def test_parameter_dict_semantics():
    nn = sbpflow.nn
    pd = nn.ParameterDict({"a": torch.ones(2)})
    pd.update([("b", sbpflow.zeros(3))])
    pd["c"] = nn.Parameter(torch.ones(1))
    assert list(pd) == ["a", "b", "c"] and [n for n, _ in pd.named_parameters()] == ["a", "b", "c"]
    assert "b" in pd and isinstance(pd["b"], nn.Parameter) and len(pd) == 3
    assert tuple(pd.pop("a").shape) == (2,) and list(pd.keys()) == ["b", "c"]
    assert pd.get("zz") is None and pd.setdefault("d", torch.ones(4)).shape[0] == 4
    assert list((pd | {"e": torch.ones(1)}).keys()) == ["b", "c", "d", "e"]
    assert [k for k, _ in pd.items()] == ["b", "c", "d"]
    del pd["c"]
    assert list(pd) == ["b", "d"] and list(dict(pd.named_parameters())) == ["b", "d"]
    with pytest.raises(KeyError, match="contain"):
        pd["x.y"] = torch.ones(1)
    with pytest.raises(TypeError, match="keys must be strings"):
        pd[3] = torch.ones(1)
    with pytest.raises(ValueError, match="pair"):
        pd.update([("k", torch.ones(1), 3)])


# ------------------------------------------------------------------ errors and odds
def test_bad_arguments_raise():
    nn, F = sbpflow.nn, sbpflow.nn.functional
    x = sbpflow.randn(2, 4, 5, 5)
    with pytest.raises(ValueError, match="relu/gelu"):
        nn.TransformerDecoderLayer(8, 2, activation="tanh")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        nn.Transformer(8, 3)
    t = nn.Transformer(8, 2, 1, 1, 16)
    with pytest.raises(RuntimeError, match="batch number"):
        t(sbpflow.randn(5, 2, 8), sbpflow.randn(3, 4, 8))
    with pytest.raises(RuntimeError, match="d_model"):
        t(sbpflow.randn(5, 2, 6), sbpflow.randn(3, 2, 6))
    with pytest.raises(ValueError, match="num_layers"):
        nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), -1)
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.ConvTranspose2d(4, 5, 3, groups=2)
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose1d(4, 4, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match="not supported"):
        nn.ConvTranspose2d(4, 4, 3, padding="same")
    with pytest.raises(ValueError, match="channels"):
        F.conv_transpose2d(x, sbpflow.randn(3, 2, 2, 2))
    with pytest.raises(ValueError, match="valid sizes"):
        nn.ConvTranspose2d(4, 2, 3, stride=2)(x, output_size=(20, 20))
    with pytest.raises(ValueError, match="divisible by upscale_factor"):
        F.pixel_shuffle(x, 3)
    with pytest.raises(ValueError, match="divisible by downscale_factor"):
        F.pixel_unshuffle(x, 2)
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout2d(x, 1.5)
    with pytest.raises(ValueError, match="4-D"):
        F.dropout2d(sbpflow.randn(3, 4), 0.5)
    with pytest.raises(ValueError, match="more than 1 spatial"):
        F.instance_norm(sbpflow.randn(2, 3, 1))
    with pytest.raises(ValueError, match="num_features"):
        nn.InstanceNorm1d(4, affine=True)(sbpflow.randn(2, 3, 5))
    with pytest.raises(ValueError, match="exactly one"):
        nn.Upsample()
    with pytest.raises(ValueError, match="padding must be"):
        nn.ZeroPad2d((1, 2, 3))
    with pytest.raises(ValueError, match="3 dims"):
        F.max_pool1d(sbpflow.randn(5), 2)


def test_generate_square_subsequent_mask_and_unbatched_pools():
    m = sbpflow.nn.Transformer.generate_square_subsequent_mask(4)
    assert torch.equal(m.to_torch(), torch.nn.Transformer.generate_square_subsequent_mask(4))
    x = torch.randn(3, 9)
    for name, args in (("max_pool1d", (3,)), ("avg_pool1d", (2,)),
                       ("adaptive_avg_pool1d", (4,))):
        got = getattr(sbpflow.nn.functional, name)(sbpflow.tensor(x), *args)
        assert torch.allclose(got.to_torch(), getattr(torch.nn.functional, name)(x, *args))
    v, i = sbpflow.nn.functional.adaptive_max_pool2d(sbpflow.tensor(x[None]), 2, True)
    tv, ti = torch.nn.functional.adaptive_max_pool2d(x[None], 2, True)
    assert torch.equal(v.to_torch(), tv) and torch.equal(i.to_torch(), ti)


def test_module_arguments_and_reprs():
    nn = sbpflow.nn
    assert nn.PReLU(3).weight.shape == (3,) and repr(nn.PReLU(3)) == "PReLU(num_parameters=3)"
    assert nn.ReLU6().max_val == 6.0 and nn.Hardtanh(min_value=-2.0).min_val == -2.0
    assert nn.LeakyReLU().negative_slope == 0.01 and nn.ELU().alpha == 1.0
    assert nn.Softplus().beta == 1.0 and nn.Softplus().threshold == 20.0
    assert nn.KLDivLoss(reduction="batchmean").reduction == "batchmean"
    assert nn.PairwiseDistance().norm == 2.0 and nn.CosineSimilarity().dim == 1
    assert nn.HuberLoss().delta == 1.0 and nn.SmoothL1Loss().beta == 1.0
    x = sbpflow.randn(3, 4)
    y = x * 1
    nn.Hardswish(inplace=True)(y)
    assert torch.equal(y.to_torch(), torch.nn.functional.hardswish(x.to_torch()))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        nn.HuberLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="max_val"):
        nn.Hardtanh(1.0, -1.0)
    with pytest.raises(ValueError, match="margin must be > 0"):
        nn.TripletMarginLoss(margin=0.0)


# ------------------------------------------------------------------ lazy layers, SyncBatchNorm,
# DataParallel, Container (issue 21)
def test_lazy_layers_infer_sizes_as_torch():
    nn = sbpflow.nn
    m = nn.LazyLinear(3)
    assert m.has_uninitialized_params() and isinstance(m.weight, nn.UninitializedParameter)
    assert repr(m.weight) == "<UninitializedParameter>" and m.in_features == 0
    m.double()  # a cast before the first call reaches the materialised parameters
    sbpflow.manual_seed(7)
    y = m(sbpflow.randn(5, 4, dtype=torch.float64))
    torch.manual_seed(7)
    t = torch.nn.LazyLinear(3).double()
    ty = t(torch.randn(5, 4, dtype=torch.float64))
    assert type(m) is nn.Linear and m.in_features == 4 and not m._forward_pre_hooks
    assert not isinstance(m.weight, nn.UninitializedParameter) and m.weight.is_leaf
    assert m.weight.dtype == torch.float64 and torch.equal(m.weight.to_torch(), t.weight.data)
    assert np.allclose(y.numpy(), ty.detach().numpy())
    # load_state_dict materialises with the checkpoint's shapes (torch's lazy load hook)
    bn = nn.LazyBatchNorm2d()
    sd = torch.nn.BatchNorm2d(3).state_dict()
    bn.load_state_dict(sd)
    assert tuple(bn.running_mean.shape) == (3,) and bn.has_uninitialized_params() is False
    bn(sbpflow.randn(2, 3, 2, 2))
    assert type(bn) is nn.BatchNorm2d and bn.num_features == 3
    # unbatched input: the channels are dim 0 (conv) / dim -2 (instance norm)
    c = nn.LazyConv1d(4, 2)
    c(sbpflow.randn(3, 6))
    assert c.in_channels == 3 and tuple(c.weight.shape) == (4, 3, 2)
    inorm = nn.LazyInstanceNorm1d()
    inorm(sbpflow.randn(5, 6))
    assert inorm.num_features == 5 and tuple(inorm.weight.shape) == (5,)
    twin = copy.deepcopy(nn.Sequential(nn.LazyLinear(2)))  # still lazy (clones of layers)
    twin(sbpflow.randn(3, 6))
    assert type(twin[0]) is nn.Linear and twin[0].in_features == 6
    with pytest.raises(ValueError, match="divisible by groups"):
        nn.LazyConv2d(4, 1, groups=2)(sbpflow.randn(1, 3, 2, 2))
    with pytest.raises(RuntimeError, match="Expected 3D \\(unbatched\\) or 4D"):
        nn.LazyConv2d(4, 1)(sbpflow.randn(3, 2))


def _lazy_global():
    """A lazy layer called with a global input materialises replicated on its placement;
    a layout recorded by to_global before the first call is applied when it materialises
    (a per-name dict sees the dotted names). Values are torch's under the same seed."""
    nn = sbpflow.nn
    pl = sbpflow.placement.all("cpu")
    xv = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.LazyLinear(5), torch.nn.Tanh(), torch.nn.LazyLinear(2))
    want = ref(xv)
    out = []
    for layout in (None, {"0.weight": split(0), "0.bias": split(0), "2.weight": split(1)}):
        sbpflow.manual_seed(3)
        m = nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.LazyLinear(2))
        if layout is not None:
            m.to_global(pl, layout)
        y = m(sbpflow.tensor(xv, placement=pl, sbp=split(0)))
        out.append((m[0].weight.sbp, m[0].bias.sbp, m[2].weight.sbp, m[2].bias.sbp,
                    type(m[2]).__name__,
                    all(np.array_equal(p.numpy(), q.detach().numpy())
                        for p, q in zip(m.parameters(), ref.parameters())),
                    np.allclose(y.numpy(), want.detach().numpy(), atol=1e-6)))
    return out


def test_lazy_layers_on_global_inputs(dist_run):
    plain, laid_out = dist_run(2, _lazy_global)[0]
    assert plain == ((B,), (B,), (B,), (B,), "Linear", True, True)
    assert laid_out == ((split(0),), (split(0),), (split(1),), (B,), "Linear", True, True)


def test_sync_batchnorm_and_convert():
    nn = sbpflow.nn
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, sync_stats=False),
                        nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.InstanceNorm2d(4)))
    net.eval()
    w, rm = net[1].weight, net[1].running_mean
    out = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert out is net and type(net[1]) is nn.SyncBatchNorm and net[1].sync_stats
    assert net[1].weight is w and net[1].running_mean is rm and not net[1].training
    assert type(net[2][0]) is nn.SyncBatchNorm and net[2][0].weight is None
    assert type(net[2][1]) is nn.InstanceNorm2d  # not a BatchNorm (as torch)
    assert list(net.state_dict()) == list(torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.Sequential(
            torch.nn.BatchNorm1d(4, affine=False), torch.nn.InstanceNorm2d(4)))).state_dict())
    bn = nn.SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, 2, 2)  # any rank >= 2
    assert np.allclose(bn(sbpflow.tensor(x)).numpy(),
                       torch.nn.BatchNorm3d(3)(x).detach().numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2D"):
        bn(sbpflow.randn(3))
    with pytest.raises(ValueError, match="process_group must be None"):
        nn.SyncBatchNorm(3, process_group=object())


def test_data_parallel_and_container():
    nn = sbpflow.nn
    inner = nn.Linear(4, 2)
    dp = nn.DataParallel(inner, device_ids=[0], dim=0)
    x = sbpflow.randn(3, 4)
    assert dp.module is inner and list(dp.state_dict()) == ["module.weight", "module.bias"]
    assert torch.equal(dp(x).to_torch(), inner(x).to_torch())
    assert list(dp.state_dict()) == list(torch.nn.DataParallel(torch.nn.Linear(4, 2))
                                         .state_dict())
    c = nn.Container(a=nn.Linear(2, 3), b=nn.ReLU())
    assert list(dict(c.named_children())) == ["a", "b"] and list(c.state_dict()) == [
        "a.weight", "a.bias"]


def test_structured_layers_arguments_and_errors():
    nn = sbpflow.nn
    with pytest.raises(ValueError, match="either an output size, or a pooling ratio"):
        nn.FractionalMaxPool2d(2)
    with pytest.raises(ValueError, match="only one of output_size and output_ratio"):
        nn.FractionalMaxPool3d(2, output_size=3, output_ratio=0.5)
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.FractionalMaxPool2d(2, output_ratio=1.5)
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        nn.CircularPad1d(1)(sbpflow.randn(1, 2, 3, 4))
    with pytest.raises(ValueError, match="Expected input to be 4D"):
        nn.CrossMapLRN2d(3)(sbpflow.randn(2, 3, 4))
    with pytest.raises(ValueError, match="Softmax2d: expected input to be 3D or 4D"):
        nn.Softmax2d()(sbpflow.randn(2, 3))
    with pytest.raises(ValueError, match="in1_features must be > 0"):
        nn.Bilinear(0, 2, 3)
    assert nn.MaxUnpool2d(2).stride == (2, 2) and nn.MaxUnpool3d(2, 1).padding == (0, 0, 0)
    assert repr(nn.LPPool2d(2, 3)) == repr(torch.nn.LPPool2d(2, 3))
    assert repr(nn.LocalResponseNorm(3)) == repr(torch.nn.LocalResponseNorm(3))
    assert repr(nn.Bilinear(2, 3, 4)) == repr(torch.nn.Bilinear(2, 3, 4))
    assert repr(nn.ChannelShuffle(2)) == repr(torch.nn.ChannelShuffle(2))
    v, i = nn.MaxPool2d(2, return_indices=True)(sbpflow.randn(1, 2, 4, 4))
    assert i.dtype == torch.int64 and tuple(v.shape) == (1, 2, 2, 2)
def test_modules_21_arguments_and_methods():
    nn = sbpflow.nn
    assert nn.RReLU().lower == 1 / 8 and nn.RReLU().upper == 1 / 3
    assert repr(nn.RReLU(0.1, 0.2, inplace=True)) == "RReLU(lower=0.1, upper=0.2, inplace=True)"
    assert isinstance(nn.AlphaDropout(0.2), nn.Dropout) and nn.Dropout3d().p == 0.5
    with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
        assert nn.PoissonNLLLoss(size_average=False).reduction == "sum"
    with pytest.warns(FutureWarning, match="NLLLoss2d"):
        assert isinstance(nn.NLLLoss2d(), nn.NLLLoss)
    assert nn.TripletMarginWithDistanceLoss().distance_function is \
        sbpflow.nn.functional.pairwise_distance
    assert nn.CTCLoss(blank=3).blank == 3 and nn.GaussianNLLLoss().eps == 1e-6
    with pytest.raises(ValueError, match="only p == 1 and p == 2"):
        nn.MultiMarginLoss(p=3)
    with pytest.raises(ValueError, match="margin to be greater than 0"):
        nn.TripletMarginWithDistanceLoss(margin=0.0)
    with pytest.raises(ValueError, match="weight shape"):
        nn.LinearCrossEntropyLoss(4, 5, weight=sbpflow.ones(4))
    with pytest.raises(ValueError, match="cutoffs should be a sequence of unique"):
        nn.AdaptiveLogSoftmaxWithLoss(8, 10, [6, 3])
    mha = nn.MultiheadAttention(8, 2, kdim=5, add_bias_kv=True)
    assert mha.in_proj_weight is None and tuple(mha.k_proj_weight.shape) == (8, 5)
    assert tuple(mha.bias_k.shape) == (1, 1, 8) and not mha._qkv_same_embed_dim
    # AdaptiveLogSoftmaxWithLoss: log_prob, predict and an unbatched forward as torch's
    torch.manual_seed(0)
    ta = torch.nn.AdaptiveLogSoftmaxWithLoss(8, 10, [3, 6], div_value=2.0)
    sbpflow.manual_seed(0)
    sa = nn.AdaptiveLogSoftmaxWithLoss(8, 10, [3, 6], div_value=2.0)
    x = torch.randn(5, 8)
    assert torch.allclose(sa.log_prob(sbpflow.tensor(x)).to_torch(), ta.log_prob(x), atol=1e-6)
    assert torch.equal(sa.predict(sbpflow.tensor(x)).to_torch(), ta.predict(x))
    out, loss = sa(sbpflow.tensor(x[0]), sbpflow.tensor(torch.tensor(7)))
    want = ta(x[0], torch.tensor(7))
    assert out.shape == () and torch.allclose(out.to_torch(), want.output, atol=1e-6)
    assert torch.allclose(loss.to_torch(), want.loss, atol=1e-6)
    with pytest.raises(ValueError, match="Target values should be in"):
        sa(sbpflow.tensor(x), sbpflow.tensor(torch.tensor([0, 1, 2, 3, 10])))
