"""Module oracle for the recurrent layers (RNN, LSTM, GRU and their cells): sbpflow.nn and
torch.nn built with the same seed hold the same parameters bit for bit, and give equal
outputs, final states, input / state gradients and parameter gradients, locally and data
parallel on global tensors (parameters B, batch split: S(0) batch-first, S(1) seq-first).
Data parallel, the forward runs no collective and the backward only the gradient
all-reduce (CommRecorder)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from _layer_oracle import run_layers, same_init_pair

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

# torch's own LSTM(proj_size > 0) warns that oneDNN does not support projections
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")

# name -> (builder(nn) -> module, input shape, hx shapes (None: default zeros; a pair for
# LSTM / LSTMCell), batch dim of the input (None: unbatched))
CASES = {
    "RNN_tanh_2l_bi": (lambda nn: nn.RNN(5, 4, num_layers=2, bidirectional=True),
                       (3, 6, 5), None, 1),
    "RNN_relu_bf_hx": (lambda nn: nn.RNN(5, 4, 2, nonlinearity="relu", batch_first=True),
                       (6, 3, 5), (2, 6, 4), 0),
    "RNN_nobias_bi_bf_hx": (lambda nn: nn.RNN(5, 4, 2, bias=False, batch_first=True,
                                              bidirectional=True),
                            (6, 4, 5), (4, 6, 4), 0),
    "LSTM_2l_bi_bf": (lambda nn: nn.LSTM(5, 4, 2, batch_first=True, bidirectional=True),
                      (6, 3, 5), None, 0),
    "LSTM_2l_bi_hx": (lambda nn: nn.LSTM(5, 4, 2, bidirectional=True),
                      (3, 6, 5), ((4, 6, 4), (4, 6, 4)), 1),
    "LSTM_proj_hx": (lambda nn: nn.LSTM(5, 4, 2, proj_size=3),
                     (3, 6, 5), ((2, 6, 3), (2, 6, 4)), 1),
    "LSTM_dropout_eval": (lambda nn: nn.LSTM(5, 4, 3, dropout=0.5).eval(), (3, 6, 5), None, 1),
    "LSTM_dropout1_train": (lambda nn: nn.LSTM(5, 4, 2, dropout=1.0), (3, 6, 5), None, 1),
    "GRU_2l_bi": (lambda nn: nn.GRU(5, 4, 2, bidirectional=True), (3, 6, 5), None, 1),
    "GRU_nobias_bf_hx": (lambda nn: nn.GRU(5, 4, 2, batch_first=True, bias=False),
                         (6, 3, 5), (2, 6, 4), 0),
    "RNN_unbatched_bi_hx": (lambda nn: nn.RNN(5, 4, 2, bidirectional=True),
                            (3, 5), (4, 4), None),
    "LSTM_unbatched_hx": (lambda nn: nn.LSTM(5, 4), (3, 5), ((1, 4), (1, 4)), None),
    "GRU_unbatched_bf": (lambda nn: nn.GRU(5, 4, batch_first=True), (3, 5), None, None),
    "RNNCell_tanh": (lambda nn: nn.RNNCell(5, 4), (6, 5), None, 0),
    "RNNCell_relu_hx": (lambda nn: nn.RNNCell(5, 4, nonlinearity="relu"), (6, 5), (6, 4), 0),
    "LSTMCell_hx": (lambda nn: nn.LSTMCell(5, 4), (6, 5), ((6, 4), (6, 4)), 0),
    "LSTMCell_nobias": (lambda nn: nn.LSTMCell(5, 4, bias=False), (6, 5), None, 0),
    "GRUCell_hx": (lambda nn: nn.GRUCell(5, 4), (6, 5), (6, 4), 0),
    "GRUCell_unbatched": (lambda nn: nn.GRUCell(5, 4), (5,), (4,), None),
    "LSTMCell_unbatched": (lambda nn: nn.LSTMCell(5, 4), (5,), None, None),
}


def _flat(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _nest(hx, xs):
    """hx shapes -> the same nesting of tensors taken from the iterator ``xs``."""
    if hx is None:
        return None
    if isinstance(hx[0], tuple):
        return tuple(next(xs) for _ in hx)
    return next(xs)


def run(name: str, mode: str) -> str:
    build, x_shape, hx_shape, batch_dim = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    shapes = [x_shape] + ([] if hx_shape is None else
                          list(hx_shape) if isinstance(hx_shape[0], tuple) else [hx_shape])
    vals = [torch.randn(s, generator=g) for s in shapes]
    tm, sm, t_params = same_init_pair(name, build)
    tin = [v.clone().requires_grad_(True) for v in vals]
    if mode == "local":
        sin = [sbpflow.tensor(v, requires_grad=True) for v in vals]
    else:
        pl = sbpflow.placement.all("cpu")
        sm.to_global(pl, B)
        # the input split on its batch dim; a given state (.., N, H) split on its batch dim
        sbps = [B if batch_dim is None else split(batch_dim)]
        sbps += [B if batch_dim is None else split(len(s) - 2) for s in shapes[1:]]
        sin = [sbpflow.tensor(v, placement=pl, sbp=s, requires_grad=True)
               for v, s in zip(vals, sbps)]
    ref = _flat(tm(tin[0], _nest(hx_shape, iter(tin[1:]))))
    with CommRecorder() as rec:
        out = _flat(sm(sin[0], _nest(hx_shape, iter(sin[1:]))))
    assert rec.kinds() == [], (name, rec.kinds())  # data parallel: shard-local forward
    assert len(out) == len(ref), name
    for o, r in zip(out, ref):
        assert tuple(o.shape) == tuple(r.shape), (name, o.shape, r.shape)
        if mode != "local" and batch_dim is not None:  # the batch split passes through
            assert o.sbp[0] == split(batch_dim if o is out[0] else o.ndim - 2), (name, o.sbp)
        assert np.allclose(o.numpy(), r.detach().numpy(), rtol=1e-5, atol=1e-5), name
    ws = [torch.randn(r.shape, generator=g) for r in ref]
    sum((r * w).sum() for r, w in zip(ref, ws)).backward()
    gws = [sbpflow.tensor(w) if mode == "local" else
           sbpflow.tensor(w, placement=o.placement, sbp=o.sbp) for o, w in zip(out, ws)]
    loss = sum((o * w).sum() for o, w in zip(out, gws))
    with CommRecorder() as rec:
        loss.backward()
    # only the gradient reduction of B leaves (bucketed all-reduce), nothing in the layers
    assert set(rec.kinds()) <= {"all_reduce"} and rec.count() <= 2, (name, rec.kinds())
    for s, t in zip(sin, tin):
        assert s.grad is not None and np.allclose(s.grad.numpy(), t.grad.numpy(), rtol=1e-4,
                                                  atol=1e-5), name
    for n, p in sm.named_parameters():
        tg = t_params[n].grad
        assert p.grad is not None and np.allclose(p.grad.numpy(), tg.numpy(), rtol=1e-4,
                                                  atol=1e-5), (name, n)
    return "ok"


@pytest.mark.parametrize("name", sorted(CASES))
def test_rnn_local_matches_torch(name):
    run(name, "local")


def test_rnn_data_parallel_2_ranks(dist_run):
    dist_run(2, run_layers, __name__, sorted(CASES))


# batch 6 over 4 ranks: shards 2, 2, 1, 1
_UNEVEN = ["LSTM_2l_bi_bf", "GRU_2l_bi", "RNN_relu_bf_hx", "LSTMCell_hx"]


def test_rnn_data_parallel_4_ranks_uneven_batch(dist_run):
    dist_run(4, run_layers, __name__, _UNEVEN)


@pytest.mark.parametrize("cls,kw", [("RNN", {"nonlinearity": "relu"}), ("LSTM", {}),
                                    ("GRU", {"bias": False}), ("LSTM", {"proj_size": 2}),
                                    ("LSTMCell", {}), ("GRUCell", {})])
def test_state_dict_round_trip_with_torch(cls, kw):
    multi = not cls.endswith("Cell")
    args = (5, 4, 2) if multi else (5, 4)
    extra = {"bidirectional": True} if multi else {}
    torch.manual_seed(3)
    tm = getattr(torch.nn, cls)(*args, **kw, **extra)
    sbpflow.manual_seed(7)  # different init: the load must overwrite it
    sm = getattr(sbpflow.nn, cls)(*args, **kw, **extra)
    tsd = tm.state_dict()
    assert list(sm.state_dict()) == list(tsd)
    for k, v in tsd.items():
        assert tuple(sm.state_dict()[k].shape) == tuple(v.shape), k
    sm.load_state_dict(tsd)
    back = {k: torch.from_numpy(v.numpy()) for k, v in sm.state_dict().items()}
    torch.manual_seed(11)
    tm2 = getattr(torch.nn, cls)(*args, **kw, **extra)
    tm2.load_state_dict(back)
    for k, v in tm2.state_dict().items():
        assert torch.equal(v, tsd[k]), k


def test_reprs_and_all_weights():
    m = sbpflow.nn.LSTM(5, 4, 2, batch_first=True, bidirectional=True, proj_size=3)
    assert repr(m) == repr(torch.nn.LSTM(5, 4, 2, batch_first=True, bidirectional=True,
                                         proj_size=3))
    assert repr(sbpflow.nn.RNN(3, 2, nonlinearity="relu")) == repr(
        torch.nn.RNN(3, 2, nonlinearity="relu"))
    assert repr(sbpflow.nn.GRUCell(3, 2, bias=False)) == repr(torch.nn.GRUCell(3, 2, bias=False))
    assert repr(sbpflow.nn.RNNCell(3, 2, nonlinearity="relu")) == repr(
        torch.nn.RNNCell(3, 2, nonlinearity="relu"))
    tw = torch.nn.LSTM(5, 4, 2, batch_first=True, bidirectional=True, proj_size=3).all_weights
    assert [[tuple(p.shape) for p in ps] for ps in m.all_weights] == [
        [tuple(p.shape) for p in ps] for ps in tw]
    m.flatten_parameters()  # a no-op kept for ported code


def test_dropout_train_changes_output_only_between_layers():
    sbpflow.manual_seed(0)
    m = sbpflow.nn.GRU(5, 4, 2, dropout=0.5)
    x = sbpflow.randn(3, 2, 5)
    out_train, _ = m(x)
    m.eval()
    out_eval, h_eval = m(x)
    assert not np.allclose(out_train.numpy(), out_eval.numpy())
    m1 = sbpflow.nn.GRU(5, 4, 1)
    with pytest.warns(UserWarning, match="non-zero dropout expects num_layers greater than 1"):
        sbpflow.nn.GRU(5, 4, 1, dropout=0.5)
    assert m1(x)[0].shape == (3, 2, 4) and h_eval.shape == (2, 2, 4)


def _t(*shape):
    return sbpflow.randn(*shape)


@pytest.mark.parametrize("fn,exc,match", [
    (lambda: sbpflow.nn.RNN(5, 4)(_t(3, 2, 6)), ValueError,
     r"input.size\(-1\) must be equal to input_size. Expected 5, got 6"),
    (lambda: sbpflow.nn.GRU(5, 4)(_t(2, 3, 2, 5)), ValueError,
     "Expected input to be 2D or 3D, got 4D"),
    (lambda: sbpflow.nn.RNN(5, 4, 2)(_t(3, 2, 5), _t(1, 2, 4)), ValueError,
     r"expected h_0 of shape \(2, 2, 4\), got \(1, 2, 4\)"),
    (lambda: sbpflow.nn.RNN(5, 4)(_t(3, 2, 5), _t(1, 4)), ValueError,
     "for batched 3-D input, h_0 should also be 3-D but got 2-D"),
    (lambda: sbpflow.nn.LSTM(5, 4)(_t(3, 2, 5), _t(1, 2, 4)), TypeError,
     r"hx must be a tuple \(h_0, c_0\)"),
    (lambda: sbpflow.nn.LSTM(5, 4, proj_size=2)(_t(3, 2, 5), (_t(1, 2, 4), _t(1, 2, 4))),
     ValueError, r"expected h_0 of shape \(1, 2, 2\)"),
    (lambda: sbpflow.nn.LSTM(5, 4, batch_first=True)(_t(2, 0, 5)), ValueError,
     r"Expected sequence length to be larger than 0, got input of shape \(2, 0, 5\)"),
    (lambda: sbpflow.nn.GRU(5, 4)(torch.randn(3, 2, 5)), TypeError,  # a torch tensor
     "input must be an sbpflow.Tensor, got Tensor"),
    (lambda: sbpflow.nn.RNN(5, 4, nonlinearity="gelu"), ValueError,
     "Unknown nonlinearity 'gelu'"),
    (lambda: sbpflow.nn.LSTM(5, 4, dropout=1.5), ValueError, "dropout should be a number"),
    (lambda: sbpflow.nn.LSTM(5, 4, proj_size=4), ValueError,
     r"proj_size \(4\) has to be smaller than hidden_size \(4\)"),
    (lambda: sbpflow.nn.GRU(5, 0), ValueError, "hidden_size must be greater than zero"),
    (lambda: sbpflow.nn.GRU(5, 4.0), TypeError, "hidden_size should be of type int"),
    (lambda: sbpflow.nn.RNNCell(5, 4)(_t(2, 6)), ValueError,
     "input has inconsistent input_size: got 6, expected 5"),
    (lambda: sbpflow.nn.GRUCell(5, 4)(_t(3, 5), _t(2, 4)), ValueError,
     r"expected hx of shape \(3, 4\) for input of shape \(3, 5\), got \(2, 4\)"),
    (lambda: sbpflow.nn.LSTMCell(5, 4)(_t(5), (_t(4), _t(3))), ValueError,
     r"expected c of shape \(4,\)"),
    (lambda: sbpflow.nn.RNNCell(5, 4)(_t(1, 2, 5)), ValueError,
     "Expected input to be 1D or 2D, got 3D"),
], ids=lambda v: None)
def test_errors(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def _mixed_kinds():
    pl = sbpflow.placement.all("cpu")
    m = sbpflow.nn.GRU(5, 4).to_global(pl, B)
    x = sbpflow.randn(3, 2, 5, placement=pl, sbp=split(1))
    with pytest.raises(TypeError, match="input is global but h_0 is local"):
        m(x, sbpflow.zeros(1, 2, 4))
    return "ok"


def test_mixed_local_global_state_error(dist_run):
    dist_run(2, _mixed_kinds)


def _other_layouts():
    """Layouts other than the batch split still give torch's values (the op library boxes):
    the sequence split (S(0) seq-first), B, and a 2x2 mesh with the batch split on one axis
    (P-free). Values and gradients."""
    g = torch.Generator().manual_seed(5)
    xv = torch.randn(5, 6, 3, generator=g)
    torch.manual_seed(0)
    tm = torch.nn.LSTM(3, 4, 2, bidirectional=True)
    ref, (rh, rc) = tm(xv)
    (ref.sum() + rh.sum() + rc.sum()).backward()
    world = sbpflow.distributed.get_world_size()
    meshes = [(sbpflow.placement.all("cpu"), [split(0), B, split(1)])]
    if world == 4:
        pl2 = sbpflow.placement("cpu", [[0, 1], [2, 3]])
        meshes.append((pl2, [(split(1), B), (B, split(1)), (split(1), split(0))]))
    for pl, sbps in meshes:
        for sbp in sbps:
            sbpflow.manual_seed(0)
            sm = sbpflow.nn.LSTM(3, 4, 2, bidirectional=True).to_global(pl, B)
            x = sbpflow.tensor(xv, placement=pl, sbp=sbp, requires_grad=True)
            out, (h, c) = sm(x)
            assert np.allclose(out.numpy(), ref.detach().numpy(), atol=1e-5), sbp
            assert np.allclose(c.numpy(), rc.detach().numpy(), atol=1e-5), sbp
            (out.sum() + h.sum() + c.sum()).backward()
            for n, p in sm.named_parameters():
                assert np.allclose(p.grad.numpy(), dict(tm.named_parameters())[n].grad.numpy(),
                                   atol=1e-5), (sbp, n)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_other_input_layouts(dist_run, world):
    dist_run(world, _other_layouts)
