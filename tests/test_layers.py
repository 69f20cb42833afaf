"""Module oracle per layer: sbpflow.nn and torch.nn built with the same seed hold the same
parameters (initialisation matches torch's), and give equal outputs and parameter
gradients, locally and data parallel on global tensors (parameters B, batch S(0))."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _layer_oracle import check_layer

import sbpflow
from sbpflow.sbp import split


def _f(*shape):
    return lambda g: torch.randn(shape, generator=g)


def _i(high, *shape):
    return lambda g: torch.randint(0, high, shape, generator=g)


# name -> (builder(nn) -> module, input makers, kwargs for forward)
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
}


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


def _run(name: str, mode: str) -> str:
    build, makers = LAYERS[name]
    return check_layer(name, build, makers, mode)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_local_matches_torch(name):
    _run(name, "local")


def _run_all(names):
    return [_run(n, "dp") for n in names]


@pytest.mark.parametrize("world", [2, 4])
def test_layers_data_parallel_match_torch(dist_run, world):
    dist_run(world, _run_all, sorted(LAYERS))


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
