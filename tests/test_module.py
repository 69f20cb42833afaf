"""sbpflow.nn.Module / Parameter against torch.nn.Module's behaviour: registration,
iteration order, state dicts, hooks, modes, casts; and Module.to_global / to_local."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import nn
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split


def _pair():
    """The same module tree written for torch and for sbpflow; parameters share values."""

    def build(lib, mod):
        class Leaf(mod.Module):
            def __init__(self, n_in, n_out):
                super().__init__()
                self.weight = mod.Parameter(lib.ones(n_out, n_in) * 0.5)
                self.bias = mod.Parameter(lib.zeros(n_out))
                self.register_buffer("count", lib.zeros(1))
                self.register_buffer("scratch", lib.zeros(2), persistent=False)

            def forward(self, x):
                return x @ self.weight.t() + self.bias

        class Net(mod.Module):
            def __init__(self):
                super().__init__()
                self.a = Leaf(2, 3)
                self.b = Leaf(3, 2)
                self.tied = self.a  # shared submodule: listed once
                self.register_parameter("gate", None)
                self.scale = mod.Parameter(lib.ones(1) * 2.0)

            def forward(self, x):
                return self.b(self.a(x).tanh()) * self.scale

        return Net()

    return build(torch, torch.nn), build(sbpflow, nn)


def test_registration_and_iteration_match_torch():
    t, s = _pair()
    assert [n for n, _ in s.named_parameters()] == [n for n, _ in t.named_parameters()]
    assert [n for n, _ in s.named_buffers()] == [n for n, _ in t.named_buffers()]
    assert [n for n, _ in s.named_modules()] == [n for n, _ in t.named_modules()]
    assert [n for n, _ in s.named_children()] == [n for n, _ in t.named_children()]
    assert list(s.state_dict()) == list(t.state_dict())
    assert len(list(s.parameters())) == len(list(t.parameters()))
    assert isinstance(s.a.weight, nn.Parameter) and s.a.weight.requires_grad
    assert s.get_parameter("a.bias") is s.a.bias and s.get_submodule("b") is s.b
    assert s.get_buffer("a.count") is s.a.count
    del s.scale
    assert "scale" not in dict(s.named_parameters())


def test_forward_backward_and_grads_match_torch():
    t, s = _pair()
    x = torch.randn(4, 2)
    yt, ys = t(x), s(sbpflow.tensor(x))
    assert np.allclose(ys.numpy(), yt.detach().numpy(), atol=1e-6)
    yt.sum().backward()
    ys.sum().backward()
    for (n, pt), (_, ps) in zip(t.named_parameters(), s.named_parameters()):
        assert np.allclose(ps.grad.numpy(), pt.grad.numpy(), atol=1e-6), n
    s.zero_grad()
    assert all(p.grad is None for p in s.parameters())


def test_setattr_rules_and_errors():
    _, s = _pair()
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'scale'"):
        s.scale = sbpflow.ones(1)
    s.scale = None
    assert s.scale is None and "scale" not in s.state_dict()
    with pytest.raises(KeyError, match="contain"):
        s.register_buffer("a.b", sbpflow.ones(1))
    with pytest.raises(KeyError, match="already exists"):
        s.register_parameter("forward", None)
    with pytest.raises(TypeError, match="sbpflow.nn.Parameter or None required"):
        s.register_parameter("p", torch.nn.Parameter(torch.ones(1)))

    class Early(nn.Module):
        def __init__(self):
            self.w = nn.Parameter(sbpflow.ones(1))

    with pytest.raises(AttributeError, match="before Module.__init__"):
        Early()
    with pytest.raises(NotImplementedError, match='missing the required "forward"'):
        nn.Module()()


def test_state_dict_round_trip_and_key_errors():
    t, s = _pair()
    with torch.no_grad():
        for p in t.parameters():
            p.uniform_()
    res = s.load_state_dict(t.state_dict())  # torch tensors load into sbpflow modules
    assert res.missing_keys == [] and res.unexpected_keys == []
    for (n, a), (_, b) in zip(t.state_dict().items(), s.state_dict().items()):
        assert np.array_equal(b.numpy(), a.numpy()), n
    sd = s.state_dict()
    sd["extra"] = sbpflow.ones(1)
    del sd["a.bias"]
    with pytest.raises(RuntimeError) as e:
        s.load_state_dict(sd)
    assert 'Missing key(s) in state_dict: "a.bias"' in str(e.value)
    assert 'Unexpected key(s) in state_dict: "extra"' in str(e.value)
    res = s.load_state_dict(sd, strict=False)
    assert res.missing_keys == ["a.bias"] and res.unexpected_keys == ["extra"]
    sd = s.state_dict()
    sd["scale"] = sbpflow.ones(2)
    with pytest.raises(RuntimeError, match="size mismatch for scale"):
        s.load_state_dict(sd)
    w = s.a.weight
    s.load_state_dict({k: v * 2 for k, v in s.state_dict().items()})
    assert s.a.weight is w  # copied in place, identity kept
    s2 = _pair()[1]
    s2.load_state_dict(s.state_dict(), assign=True)
    assert np.array_equal(s2.a.weight.numpy(), s.a.weight.numpy())


def test_hooks_modes_casts_and_copies():
    _, s = _pair()
    seen = []
    h1 = s.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    h2 = s.register_forward_hook(lambda m, args, out: seen.append(out.shape) or out + 1)
    y = s(sbpflow.ones(4, 2))
    assert seen == [(4, 2)] and np.allclose(y.numpy(), 1 + 2 * 0.5 * np.tanh(0) * 0 + 0)
    h1.remove()
    h2.remove()
    y2 = s(sbpflow.ones(4, 2))
    assert len(seen) == 1 and not np.allclose(y2.numpy(), y.numpy())
    h3 = s.register_forward_pre_hook(lambda m, a, k: ((a[0] * 2,), k), with_kwargs=True)
    assert np.allclose(s(sbpflow.ones(4, 2) * 0.5).numpy(), y2.numpy())
    h3.remove()
    assert s.training and not s.eval().a.training and s.train().b.training
    w = s.a.weight
    s.to(torch.float64)
    assert s.a.weight is w and w.dtype == torch.float64 and w.requires_grad and w.is_leaf
    assert s.a.count.dtype == torch.float64
    with pytest.raises(TypeError, match="floating point"):
        s.to(torch.int64)
    s.float()
    c = copy.deepcopy(s)
    assert c.a.weight is not s.a.weight and c.tied is c.a
    assert np.array_equal(c.a.weight.numpy(), s.a.weight.numpy())
    s.requires_grad_(False)
    assert not any(p.requires_grad for p in s.parameters())
    visited = []
    s.apply(lambda m: visited.append(type(m).__name__))
    assert visited == ["Leaf", "Leaf", "Net"]
    assert "(a): Leaf()" in repr(s)


def _to_global_and_back(nd):
    pl = sbpflow.placement.all("cpu") if nd == 1 else sbpflow.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    t, s = _pair()
    with torch.no_grad():
        for p in t.parameters():
            p.normal_()
    s.load_state_dict(t.state_dict())
    w = s.a.weight
    plan = {"a.weight": split(0) if nd == 1 else (split(0), split(1)),
            "a.bias": split(0) if nd == 1 else (B, split(0))}
    s.to_global(pl, plan)
    assert s.a.weight is w and w.is_global and w.is_leaf and w.requires_grad
    assert s.b.weight.sbp == (B,) * nd and s.a.count.is_global
    x = torch.randn(5, 2)
    ys = s(sbpflow.tensor(x, placement=pl, sbp=split(0) if nd == 1 else (split(0), B)))
    yt = t(x)
    assert np.allclose(ys.numpy(), yt.detach().numpy(), atol=1e-5)
    ys.backward(sbpflow.ones(*ys.shape, placement=pl, sbp=ys.sbp))
    yt.sum().backward()
    for (n, pt), (_, ps) in zip(t.named_parameters(), s.named_parameters()):
        assert ps.grad.sbp == ps.sbp, n
        assert np.allclose(ps.grad.numpy(), pt.grad.numpy(), atol=1e-5), n
    sd = s.state_dict()
    assert sd["a.weight"].is_global
    back = _pair()[1]
    back.load_state_dict(sd)  # global values into a local module: whole values
    assert np.allclose(back.a.weight.numpy(), t.a.weight.detach().numpy())
    # Module.to_local keeps each rank's shard (as Tensor.to_local; OneFlow's rule)
    w_sbp, b_sbp = w.sbp, s.b.weight.sbp
    s.to_local()
    assert s.a.weight.is_local and s.a.weight is w and w.requires_grad and w.is_leaf
    idx = sbpflow.shard_slices(tuple(t.a.weight.shape), pl.shape, w_sbp, pl.coord())
    assert tuple(w.shape) == tuple(t.a.weight[idx].shape) != tuple(t.a.weight.shape)
    assert np.allclose(w.numpy(), t.a.weight.detach()[idx].numpy())
    assert b_sbp == (B,) * nd  # broadcast: the whole value
    assert np.allclose(s.b.weight.numpy(), t.b.weight.detach().numpy())
    return "ok"


@pytest.mark.parametrize("world,nd", [(2, 1), (4, 2)])
def test_module_to_global_matches_torch(dist_run, world, nd):
    dist_run(world, _to_global_and_back, nd)


def _to_global_errors():
    _, s = _pair()
    with pytest.raises(ValueError, match="does not fit scale"):
        s.to_global(sbpflow.placement.all("cpu"), {"scale": split(1)})
    return "ok"


def test_module_to_global_errors(dist_run):
    dist_run(2, _to_global_errors)
