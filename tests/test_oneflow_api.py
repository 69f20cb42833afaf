"""OneFlow's API around global tensors (``import sbpflow as oneflow``): ``sbpflow.env``,
``amp.StaticGradScaler``/``DynamicGradScaler``, ``utils.global_view``, ``sbp.broadcast()``,
the legacy ``Tensor(*sizes)`` constructor, ``reshape(x, shape=...)``, numpy's
``__array__``, and views that move no data on 2-D meshes. Oracle: plain torch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import sbpflow
import sbpflow as oneflow  # the way a OneFlow user imports it
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split as S

# ------------------------------------------------------------------ one process


def test_sbp_values_with_and_without_a_call():
    assert oneflow.sbp.broadcast() is oneflow.sbp.broadcast is B
    assert oneflow.sbp.partial_sum() is oneflow.sbp.partial_sum is P
    assert isinstance(oneflow.sbp.split(0), oneflow.sbp.sbp)
    assert isinstance(oneflow.sbp.broadcast(), oneflow.sbp.sbp)
    assert (repr(oneflow.sbp.broadcast()), repr(oneflow.sbp.split(1))) == ("B", "S(1)")
    with pytest.raises(TypeError):
        oneflow.sbp.split(0)()  # split is a function of the dim; its value is not callable


def test_env_in_one_process():
    env = oneflow.env
    assert (env.get_rank(), env.get_world_size(), env.get_local_rank(),
            env.get_node_size()) == (0, 1, 0, 1)
    pl = env.all_device_placement("cpu")
    assert pl == oneflow.placement("cpu", [0]) == oneflow.placement.all("cpu")
    with pytest.raises(ValueError, match="placement type"):
        env.all_device_placement("tpu")


def test_legacy_tensor_constructor_matches_torch():
    for args in [(2, 3), (torch.Size([4, 1]),), (5,), ()]:
        x, t = oneflow.Tensor(*args), torch.Tensor(*args)
        assert (x.shape, x.dtype, x.is_local) == (t.shape, t.dtype, True), args
    for data in [[1, 2, 3], [[1.5, 2], [3, 4]], np.arange(6, dtype=np.int64).reshape(2, 3)]:
        x, t = oneflow.Tensor(data), torch.Tensor(data)
        assert x.dtype == t.dtype == torch.float32
        assert torch.equal(x.to_torch(), t)
    src = oneflow.tensor([1.0, 2.0])
    alias = oneflow.Tensor(src)  # torch.Tensor(t) aliases t
    alias.add_(1)
    assert src.tolist() == [2.0, 3.0]
    with pytest.raises(TypeError, match="data must be a sequence"):
        oneflow.Tensor(2.5)
    with pytest.raises(TypeError, match="sizes must all be ints"):
        oneflow.Tensor(2, [3])
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['dtype'\]"):
        oneflow.Tensor(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="both placement= and sbp="):
        oneflow.Tensor(2, 3, placement=oneflow.placement("cpu", [0]))
    with pytest.raises(ValueError, match="non-negative"):
        oneflow.Tensor(2, -1)


def test_reshape_shape_keyword_matches_torch():
    t = torch.arange(12.0)
    x = oneflow.from_torch(t.clone())
    for got, want in [(oneflow.reshape(x, shape=(3, 4)), torch.reshape(t, shape=(3, 4))),
                      (x.reshape(shape=(2, -1)), t.reshape(shape=(2, -1))),
                      (oneflow.reshape(x, (4, 3)), torch.reshape(t, (4, 3)))]:
        assert torch.equal(got.to_torch(), want)
    with pytest.raises(TypeError, match="positionally or as shape="):
        x.reshape(3, 4, shape=(3, 4))
    with pytest.raises(TypeError, match=r"keywords \['size'\]"):
        x.reshape(size=(3, 4))


def test_numpy_array_protocol():
    a = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x = oneflow.tensor(a)
    assert np.array_equal(x, a) and not np.array_equal(x, a + 1)
    assert np.allclose(oneflow.relu(x), np.maximum(a, 0))
    assert np.asarray(x, dtype=np.float64).dtype == np.float64
    assert np.array(x).shape == (3, 4) and np.isclose(x.sum(), a.sum(), atol=1e-5)
    with pytest.raises(ValueError, match="copy=False"):
        x.__array__(copy=False)


def _train(scaler, steps, poison_at=None):
    torch.manual_seed(0)
    sbpflow.manual_seed(0)
    m = sbpflow.nn.Linear(4, 1)
    opt = sbpflow.optim.SGD(m.parameters(), lr=0.1)
    scales = []
    for i in range(steps):
        x = sbpflow.tensor(torch.randn(8, 4))
        loss = m(x).square().mean()
        if i == poison_at:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return m.weight.to_torch().detach().clone(), scales


def _torch_train(steps, skip=()):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(steps):
        x = torch.randn(8, 4)
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        if i not in skip:
            opt.step()
    return m.weight.detach()


def test_static_grad_scaler_keeps_its_scale_and_skips_inf_steps():
    w, scales = _train(oneflow.amp.StaticGradScaler(1024.0), 4, poison_at=2)
    assert scales == [1024.0] * 4
    assert torch.allclose(w, _torch_train(4, skip={2}), atol=1e-6)
    assert not torch.allclose(w, _torch_train(4), atol=1e-6)  # the poisoned step was skipped
    assert oneflow.amp.StaticGradScaler(8.0).scale_factor == 8.0
    with pytest.raises(ValueError, match="scale_factor must be a number > 0, got 0"):
        oneflow.amp.StaticGradScaler(0)
    s = oneflow.amp.StaticGradScaler(4.0)
    with pytest.raises(TypeError, match="fixed at 4.0"):
        s.update(8.0)


def test_dynamic_grad_scaler_grows_and_backs_off():
    scaler = oneflow.amp.DynamicGradScaler(init_scale=2.0 ** 10, growth_factor=4.0,
                                           backoff_factor=0.25, growth_interval=2)
    w, scales = _train(scaler, 5, poison_at=2)
    # clean, clean (grow x4), inf (back off /4), clean, clean (grow x4)
    assert scales == [2.0 ** 10, 2.0 ** 12, 2.0 ** 10, 2.0 ** 10, 2.0 ** 12]
    assert torch.allclose(w, _torch_train(5, skip={2}), atol=1e-6)
    for kwargs, match in [({"growth_factor": 1.0}, "growth_factor must be a number > 1"),
                          ({"backoff_factor": 1.5}, r"backoff_factor must be a number in \(0, 1\)"),
                          ({"growth_interval": 0}, "growth_interval must be a positive int"),
                          ({"init_scale": -1}, "init_scale must be a number > 0")]:
        with pytest.raises(ValueError, match=match):
            oneflow.amp.DynamicGradScaler(**kwargs)


def test_global_mode_errors_and_state_in_one_process():
    from sbpflow.utils.global_view import current_global_mode, global_mode

    pl = oneflow.placement("cpu", [0])
    with pytest.raises(ValueError, match="needs both placement= and sbp="):
        global_mode(True, placement=pl)
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        global_mode(True, placement=pl, sbp=(B, B))
    assert not current_global_mode().is_enabled
    with global_mode(True, placement=pl, sbp=S(1)):
        with pytest.raises(ValueError, match="does not fit a created 1-dim tensor"):
            oneflow.zeros(3)
        assert oneflow.zeros(2, 3).sbp == (S(1),)
    assert oneflow.zeros(2, 3).is_local


# ------------------------------------------------------------------ several ranks


def _env_body():
    env = oneflow.env
    out = [env.get_rank(), env.get_world_size(), env.get_local_rank()]
    pl = env.all_device_placement("cpu")
    out.append(pl == oneflow.placement("cpu", list(range(env.get_world_size()))))
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        out.append(env.get_node_size())
        os.environ["LOCAL_WORLD_SIZE"] = "x"
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x'"):
            env.get_node_size()
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return out


def test_env_on_two_ranks(dist_run):
    assert dist_run(2, _env_body) == [[0, 2, 0, True, 2], [1, 2, 1, True, 2]]


def _global_mode_body():
    from sbpflow.utils.global_view import current_global_mode, global_mode

    pl = oneflow.placement("cpu", [0, 1])
    with global_mode(True, placement=pl, sbp=oneflow.sbp.split(0)):
        info = current_global_mode()
        assert info.is_enabled and info.placement == pl and info.sbp == (S(0),)
        a = oneflow.arange(6)
        ones = oneflow.ones(4, 3)
        data = oneflow.tensor([[1.0, 2.0], [3.0, 4.0]])
        sbpflow.manual_seed(3)
        r = oneflow.randn(4, 2)
        with global_mode(False):
            assert not current_global_mode().is_enabled
            assert oneflow.zeros(2).is_local
        assert current_global_mode().is_enabled
    assert not current_global_mode().is_enabled and oneflow.ones(2).is_local
    for t in (a, ones, data, r):
        assert t.is_global and t.placement == pl and t.sbp == (S(0),)
    torch.manual_seed(3)
    want_r = torch.randn(4, 2)
    assert torch.equal(torch.from_numpy(r.numpy()), want_r)  # layout-invariant draw
    assert a.to_local().tolist() == [[0, 1, 2], [3, 4, 5]][oneflow.env.get_rank()]
    assert np.array_equal(data, [[1.0, 2.0], [3.0, 4.0]]) and np.array_equal(ones, np.ones((4, 3)))
    return "ok"


def test_global_mode_creates_global_tensors(dist_run):
    assert dist_run(2, _global_mode_body) == ["ok", "ok"]


def _global_view_body():
    from sbpflow.utils import global_view

    pl = oneflow.placement("cpu", [0, 1])
    sbpflow.manual_seed(0)
    model = oneflow.nn.Sequential(oneflow.nn.Linear(8, 4), oneflow.nn.ReLU(),
                                  oneflow.nn.Linear(4, 2))
    sd = model.state_dict()
    g = global_view.to_global(sd, pl, (oneflow.sbp.broadcast,))
    assert list(g) == list(sd) and all(v.is_global and v.sbp == (B,) for v in g.values())
    split = global_view.to_global({"w": g["0.weight"], "n": None, "k": [g["0.bias"]]},
                                  sbp=lambda t: S(0))
    assert split["n"] is None and split["w"].sbp == (S(0),) == split["k"][0].sbp
    loc = global_view.to_local(split, copy=True)
    r = oneflow.env.get_rank()
    assert torch.equal(loc["w"].to_torch(), sd["0.weight"].to_torch()[2 * r:2 * r + 2])
    with pytest.warns(UserWarning, match="leaf str is not a tensor"):
        global_view.to_global(["x"], pl, B)
    with pytest.raises(ValueError, match="placement= and/or sbp="):
        global_view.to_global(sd)
    return "ok"


def test_global_view_to_global_to_local(dist_run):
    assert dist_run(2, _global_view_body) == ["ok", "ok"]


def _legacy_global_body():
    pl = oneflow.placement("cpu", [0, 1])
    r = oneflow.env.get_rank()
    x = oneflow.Tensor(5, 3, placement=pl, sbp=oneflow.sbp.split(0))
    assert (tuple(x.shape), tuple(x.to_local().shape), x.dtype) == ((5, 3), (3 - r, 3),
                                                                   torch.float32)
    data = [[1, 2], [3, 4], [5, 6]]
    y = oneflow.Tensor(data, placement=pl, sbp=oneflow.sbp.broadcast())
    assert y.sbp == (B,) and y.dtype == torch.float32
    assert np.array_equal(y, torch.Tensor(data).numpy())  # __array__: collective
    z = oneflow.Tensor(data, placement=pl, sbp=[oneflow.sbp.split(1)])
    assert z.to_local().tolist() == [[1.0], [3.0], [5.0]] if r == 0 else [[2.0], [4.0], [6.0]]
    assert np.array_equal(oneflow.reshape(z, shape=(2, 3)), torch.Tensor(data).reshape(2, 3))
    return "ok"


def test_legacy_tensor_constructor_global(dist_run):
    assert dist_run(2, _legacy_global_body) == ["ok", "ok"]


# ------------------------------------------------------------ views that move no data


def _view_body(in_shape, nd_in, out_shape, mesh):
    pl = oneflow.placement("cpu", mesh)
    torch.manual_seed(0)
    t = torch.randn(*in_shape)
    x = oneflow.tensor(t, placement=pl, sbp=nd_in).requires_grad_(True)
    g = torch.randn(*out_shape)
    with CommRecorder() as rec:
        y = x.view(*out_shape)
    forward = rec.count()
    gy = oneflow.tensor(g, placement=pl, sbp=y.sbp)  # the gradient laid out as y
    with CommRecorder() as rec:
        y.backward(gy)
    backward = rec.count()
    assert np.array_equal(y.detach().numpy(), t.reshape(out_shape).numpy())
    assert np.array_equal(x.grad.numpy(), g.reshape(in_shape).numpy())
    return forward, backward, y.sbp, x.grad.sbp


@pytest.mark.parametrize("in_shape,nd_in,out_shape,nd_out", [
    ((8, 4), (S(0), S(0)), (2, 4, 4), (S(0), S(1))),  # the case
    ((2, 4, 4), (S(0), S(1)), (8, 4), (S(0), S(0))),  # and back
    ((6, 4), (S(0), S(0)), (2, 3, 4), (S(0), S(1))),  # uneven: rows 2,1,2,1
    ((4, 4, 6), (S(0), S(2)), (16, 2, 3), (S(0), S(1))),  # two groups, one split each
])
def test_view_on_2x2_mesh_moves_no_data(dist_run, in_shape, nd_in, out_shape, nd_out):
    for fwd, bwd, out_sbp, grad_sbp in dist_run(4, _view_body, in_shape, nd_in, out_shape,
                                                [[0, 1], [2, 3]]):
        assert (fwd, bwd) == (0, 0)
        assert out_sbp == nd_out and grad_sbp == nd_in


def test_view_that_needs_data_still_moves_it(dist_run):
    # S(1) of (8, 4) on 2 ranks: rank 0 holds columns 0..1 of every row, not a contiguous
    # range of (32,): the reshape must box, and gives torch's values.
    results = dist_run(2, _view_body, (8, 4), (S(1),), (32,), [0, 1])
    assert all(fwd > 0 for fwd, _, _, _ in results)


# ------------------------------------------------------------------ issue 21's OneFlow items
def _module_round_trip():
    pl = oneflow.placement.all("cpu")
    m = oneflow.nn.Linear(6, 4)
    w, b = m.weight.numpy().copy(), m.bias.numpy().copy()
    m.to_global(pl, S(0))
    shard = m.weight.to_local().numpy().copy()
    m.to_local()
    local = (tuple(m.weight.shape), np.array_equal(m.weight.numpy(), shard))
    with CommRecorder() as rec:
        m.to_global(pl, S(0))  # the shards taken back as they were: no communication
    back = (m.weight.sbp == (S(0),), tuple(m.weight.shape), np.array_equal(m.weight.numpy(), w),
            np.array_equal(m.bias.numpy(), b), len(rec.records))
    m.to_local()
    m.to_global(pl, B)  # another layout: boxed from the remembered one
    again = np.array_equal(m.weight.numpy(), w) and m.weight.sbp == (B,)
    fresh = oneflow.nn.Linear(6, 4)  # never global: local values are whole values
    fresh.to_global(pl, S(0))
    return local, back, again, tuple(fresh.weight.shape)


def test_module_to_local_then_to_global_round_trips(dist_run):
    for local, back, again, fresh in dist_run(2, _module_round_trip):
        assert local == ((2, 6), True)
        assert back == (True, (4, 6), True, True, 0), back
        assert again and fresh == (4, 6)


def _devices():
    pl = oneflow.placement.all("cpu")
    x = oneflow.ones(4, placement=pl, sbp=S(0))
    p = oneflow.nn.Parameter(oneflow.ones(4, placement=pl, sbp=B))
    t = p.to(oneflow.Tensor)
    return (str(x.device), x.device.type, type(t).__name__, t._local is p._local,
            t.to(oneflow.Tensor) is t, str(oneflow.ones(2).device))


def test_global_device_has_the_rank_index_and_to_tensor_type(dist_run):
    """OneFlow's ``.device`` of a global tensor carries this rank's device index;
    ``param.to(flow.Tensor)`` gives the plain tensor (same storage)."""
    for rank, (dev, kind, cls, same, ident, local) in enumerate(dist_run(2, _devices)):
        assert (dev, kind, cls, same, ident, local) == (f"cpu:{rank}", "cpu", "Tensor", True,
                                                        True, "cpu")


def _zero_graph(stage: int):
    """OneFlow's ZeRO graph test, against torch: a broadcast linear and a split one, SGD
    with momentum, gradient accumulation 2, ``enable_zero(stage, shard_min_size=1)``."""
    pl = oneflow.placement.all("cpu")
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4, bias=False))
    xs = [torch.randn(4, 8) for _ in range(3)]
    dp = oneflow.nn.Linear(8, 6).to_global(pl, B)
    mp = oneflow.nn.Linear(6, 4, bias=False).to_global(pl, S(0))
    with torch.no_grad():
        for mine, theirs in [(dp.weight, ref[0].weight), (dp.bias, ref[0].bias),
                             (mp.weight, ref[1].weight)]:
            mine.copy_(oneflow.tensor(theirs, placement=pl, sbp=mine.sbp))
    sgd = oneflow.optim.SGD([{"params": dp.parameters()}, {"params": mp.parameters()}],
                            lr=0.1, momentum=0.9)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    class Train(oneflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.dp, self.mp = dp, mp
            self.add_optimizer(sgd)
            self.config.set_gradient_accumulation_steps(2)
            self.config.enable_zero(True, stage=stage, shard_min_size=1)

        def build(self, x):
            loss = self.mp(self.dp(x).to_global(pl, B)).square().mean()
            loss.backward()
            return loss

    class Eval(oneflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.dp, self.mp = dp, mp

        def build(self, x):
            return self.mp(self.dp(x).to_global(pl, B))

    train, before = Train(), (dp.weight.sbp, dp.bias.sbp, mp.weight.sbp)
    losses, ref_losses = [], []
    for x in xs:
        losses.append(train(oneflow.tensor(x, placement=pl, sbp=S(0))).mean().item())
        ref_sgd.zero_grad()
        loss = sum(ref(half).square().mean() / 2 for half in x.chunk(2))
        loss.backward()
        ref_sgd.step()
        ref_losses.append(loss.item())
    after = (dp.weight.sbp, dp.bias.sbp, mp.weight.sbp)
    program = next(iter(train._programs.values())).gm
    counts = [sum(1 for n in program.graph.nodes if kind in str(n.target))
              for kind in ("all_gather", "reduce_scatter")]
    out = Eval()(oneflow.tensor(xs[0], placement=pl, sbp=S(0))).numpy()
    with torch.no_grad():
        ref_out = ref(xs[0]).numpy()
    params = [p.numpy() for p in (dp.weight, dp.bias, mp.weight)]
    ref_params = [p.detach().numpy() for p in (ref[0].weight, ref[0].bias, ref[1].weight)]
    return before, after, counts, losses, ref_losses, params, ref_params, out, ref_out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_graph_stores_parameters_split_after_the_first_call(dist_run, stage):
    """OneFlow's ``enable_zero``: after the first call every sharded parameter is stored
    ``S(0)`` (at every stage), training follows torch on one process, and another graph
    (evaluation) consumes the split parameters and gives torch's output."""
    for before, after, counts, losses, ref_losses, params, ref_params, out, ref_out in \
            dist_run(2, _zero_graph, stage):
        assert before == ((B,), (B,), (S(0),)) and after == ((S(0),),) * 3, (before, after)
        if stage < 3:  # the activation's gather per micro-batch, each parameter's per step
            assert counts[0] == 2 + 2, counts
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(params, ref_params):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
