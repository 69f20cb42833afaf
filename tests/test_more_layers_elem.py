"""Module oracle for the added activations, distances and losses: sbpflow.nn and torch.nn
built with the same seed hold the same parameters (PReLU's ``weight``), and give equal
outputs and parameter gradients, locally and data parallel on global tensors (parameters
B, batch S(0), 6 rows: uneven on 4 ranks)."""

from __future__ import annotations

import pytest
import torch
from _layer_oracle import check_layer

import sbpflow


def _f(*shape):
    return lambda g: torch.randn(shape, generator=g)


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


# name -> (builder(nn) -> module, input makers)
LAYERS = {
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
}


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
    assert dist_run(world, _run_all, sorted(LAYERS))[0] == ["ok"] * len(LAYERS)


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
