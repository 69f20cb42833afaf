"""Tensor semantics (ARCHITECTURE "API decisions") on real gloo ranks and in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split

S0, S1 = split(0), split(1)


def _rank():
    return sbpflow.distributed.get_rank()


def _local_split_uneven_and_checked():
    pl = sbpflow.placement.all("cpu")
    r = _rank()
    local = torch.arange(4 * 3).reshape(4, 3).float() + 100 * r if r == 0 else \
        torch.arange(3 * 3).reshape(3, 3).float() + 100 * r
    x = sbpflow.from_torch(local).to_global(pl, S0)
    assert tuple(x.shape) == (7, 3) and x.sbp == (S0,)
    full = x.numpy()
    assert np.array_equal(full[:4], np.arange(12).reshape(4, 3))
    assert np.array_equal(full[4:], np.arange(9).reshape(3, 3) + 100)
    # Shards that do not fit the shard function are refused, naming the ranks.
    bad = torch.zeros(3 if r == 0 else 4, 3)
    with pytest.raises(ValueError, match=r"rank 0 has \(3, 3\), expected \(4, 3\)"):
        sbpflow.from_torch(bad).to_global(pl, S0)
    # check_meta=False with the global size skips the exchange.
    y = sbpflow.from_torch(local).to_global(pl, S0, check_meta=False, size=(7, 3))
    assert np.array_equal(y.numpy(), full)
    return "ok"


def test_local_to_global_split(dist_run):
    dist_run(2, _local_split_uneven_and_checked)


def _local_broadcast_rank0_wins_and_grads():
    pl = sbpflow.placement.all("cpu")
    r = _rank()
    local = torch.full((2, 3), float(r + 1), requires_grad=True)
    before = local.detach().clone()
    x = sbpflow.from_torch(local).to_global(pl, B)
    assert np.array_equal(x.numpy(), np.ones((2, 3)))  # rank 0's value
    assert torch.equal(local.detach(), before)  # input not overwritten
    w = sbpflow.tensor(torch.arange(6.0).reshape(2, 3), placement=pl, sbp=B)
    x.backward(w)
    # Only rank 0's value was used: it gets the whole gradient, the others zeros.
    want = torch.arange(6.0).reshape(2, 3) if r == 0 else torch.zeros(2, 3)
    torch.testing.assert_close(local.grad, want)
    # grad_sbp=B: every rank's local input receives the whole gradient.
    local2 = torch.full((2, 3), float(r + 1), requires_grad=True)
    x2 = sbpflow.from_torch(local2).to_global(pl, B, grad_sbp=B)
    x2.backward(w)
    torch.testing.assert_close(local2.grad, torch.arange(6.0).reshape(2, 3))
    with pytest.raises(ValueError, match="grad_sbp"):
        sbpflow.from_torch(local2).to_global(pl, B, grad_sbp=S0)
    return "ok"


def test_local_to_global_broadcast(dist_run):
    dist_run(2, _local_broadcast_rank0_wins_and_grads)


def _local_partial_sums():
    pl = sbpflow.placement.all("cpu")
    r = _rank()
    local = torch.full((3,), float(r + 1), requires_grad=True)
    x = sbpflow.from_torch(local).to_global(pl, P)
    n = pl.size
    assert x.numpy().tolist() == [n * (n + 1) / 2] * 3
    x.backward(sbpflow.tensor([1.0, 2.0, 3.0], placement=pl, sbp=B))
    torch.testing.assert_close(local.grad, torch.tensor([1.0, 2.0, 3.0]))
    return "ok"


def test_local_to_global_partial(dist_run):
    dist_run(4, _local_partial_sums)


def _loss_through_local_ops():
    # A P loss built from local torch ops seeds 1 on every rank; x.grad = d(sum x^2)/dx.
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    full = torch.randn(7, 5)
    x = sbpflow.tensor(full, placement=pl, sbp=(S0, S1), requires_grad=True)
    local_loss = (x.to_local().to_torch() ** 2).sum()
    loss = sbpflow.from_torch(local_loss).to_global(pl, (P, P))
    np.testing.assert_allclose(loss.item(), (full ** 2).sum().item(), rtol=1e-5)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), (2 * full).numpy(), rtol=1e-6)
    # A B scalar: the ranks' seeds sum to 1 (coordinate 0 of each B axis seeds 1).
    s = sbpflow.tensor(3.0, placement=pl, sbp=(B, B), requires_grad=True)
    t = s.to_global(sbp=(B, B))
    t.backward()
    assert s.grad.sbp == (B, B) and s.grad.item() == 1.0
    with pytest.raises(RuntimeError, match="scalar"):
        x.to_global(sbp=(B, B)).backward()
    return "ok"


def test_backward_seeds_p_and_b_scalars(dist_run):
    dist_run(4, _loss_through_local_ops)


def _leaf_grad_layouts():
    pl = sbpflow.placement.all("cpu")
    w = sbpflow.ones(8, 3, placement=pl, sbp=B, requires_grad=True)
    x = sbpflow.tensor(torch.arange(8.0).repeat(3, 1).t(), placement=pl, sbp=S0)
    # Data-parallel shape: each rank multiplies its S(0) rows of x with the whole B
    # weight; the local gradient of w is a summand (P), all-reduced by the leaf hook.
    xs = x.to_local().to_torch()
    rows = pl.shard_slices((8, 3), (S0,))[0]
    part = (w.to_local().to_torch()[rows] * xs).sum()
    loss = sbpflow.from_torch(part).to_global(pl, P)
    with CommRecorder() as rec:
        loss.backward()
    assert rec.kinds() == ["all_reduce"] and w.grad.sbp == (B,)
    np.testing.assert_allclose(w.grad.numpy(), x.numpy())
    # ZeRO-like: the same gradient laid out S(0) arrives by reduce-scatter.
    w2 = sbpflow.ones(8, 3, placement=pl, sbp=B).set_grad_sbp(S0)
    part = (w2.to_local().to_torch()[rows] * xs).sum()
    with CommRecorder() as rec:
        sbpflow.from_torch(part).to_global(pl, P).backward()
    assert rec.kinds() == ["reduce_scatter"] and w2.grad.sbp == (S0,)
    assert tuple(w2.grad.to_local().shape) == (4, 3)
    np.testing.assert_allclose(w2.grad.numpy(), x.numpy())
    return "ok"


def test_leaf_grad_layout_and_grad_sbp(dist_run):
    dist_run(2, _leaf_grad_layouts)


def _global_grad_sbp_routes_backward():
    pl = sbpflow.placement.all("cpu")
    x = sbpflow.tensor(torch.arange(12.0).reshape(4, 3), placement=pl, sbp=S0, requires_grad=True)
    y = x.to_global(sbp=B, grad_sbp=B)
    with CommRecorder() as rec:
        y.backward(sbpflow.ones(4, 3, placement=pl, sbp=B))
    # dual(B)=P -> B (all-reduce) -> S(0) (slice) instead of the default reduce-scatter.
    assert rec.kinds() == ["all_reduce"]
    np.testing.assert_allclose(x.grad.numpy(), np.ones((4, 3)))
    # Across placements the waypoint lives on the source placement.
    a, b = sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])
    u = sbpflow.tensor(torch.arange(6.0), placement=a, sbp=S0, requires_grad=True)
    v = u.to_global(b, S0, grad_sbp=B)
    v.backward(sbpflow.tensor(torch.arange(6.0) * 2, placement=b, sbp=S0))
    np.testing.assert_allclose(u.grad.numpy(), np.arange(6.0) * 2)
    return "ok"


def test_global_grad_sbp(dist_run):
    dist_run(2, _global_grad_sbp_routes_backward)


def _creation_layout_invariant():
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(7)
    want = torch.randn(7, 5)
    for nd in [(S0, S1), (B, S0), (S1, B), (B, B), (S0, S0)]:
        sbpflow.manual_seed(7)
        x = sbpflow.randn(7, 5, placement=pl, sbp=nd)
        assert np.array_equal(x.numpy(), want.numpy()), nd
    with pytest.raises(ValueError, match="partial_sum"):
        sbpflow.randn(2, 2, placement=pl, sbp=(P, B))
    for nd in [(S0, S1), (B, S0), (S1, S1)]:
        sbpflow.manual_seed(3)
        u = sbpflow.rand(7, 5, placement=pl, sbp=nd)
        k = sbpflow.randint(0, 100, (7, 5), placement=pl, sbp=nd)
        torch.manual_seed(3)
        assert np.array_equal(u.numpy(), torch.rand(7, 5).numpy()), nd
        assert np.array_equal(k.numpy(), torch.randint(0, 100, (7, 5)).numpy()), nd
    # full/zeros/ones: P keeps the value at coordinate 0 of that axis.
    f = sbpflow.full((3, 2), 2.5, placement=pl, sbp=(P, S0))
    assert np.array_equal(f.numpy(), np.full((3, 2), 2.5, dtype=np.float32))
    coord = pl.coord()
    assert f.to_local().to_torch().eq(2.5 if coord[0] == 0 else 0).all()
    assert np.array_equal(sbpflow.ones(5, placement=pl, sbp=(S0, P)).numpy(), np.ones(5))
    # tensor(): every rank passes data; the first rank of the placement wins.
    t = sbpflow.tensor([float(_rank())] * 4, placement=pl, sbp=(S0, B))
    assert t.numpy().tolist() == [0.0] * 4
    return "ok"


def test_creation(dist_run):
    dist_run(4, _creation_layout_invariant)


def _outside_ranks():
    sub = sbpflow.placement("cpu", [1, 2])
    x = sbpflow.tensor(torch.arange(6.0), placement=sub, sbp=S0)
    r = _rank()
    local = x.to_local().to_torch()
    if r in (1, 2):
        assert local.shape == (3,)
    else:
        assert local.numel() == 0  # outside the placement: empty shard
    assert x.numpy().tolist() == list(range(6))  # every rank gets the value
    assert x.to_global(sbp=B).tolist() == list(range(6))
    assert sbpflow.tensor(5.0, placement=sub, sbp=P).item() == 5.0
    # From local shards: ranks outside pass anything and still learn the global shape.
    loc = {1: torch.ones(3, 2), 2: 2 * torch.ones(2, 2)}.get(r, torch.zeros(9, 9))
    z = sbpflow.from_torch(loc).to_global(sub, S0)
    assert tuple(z.shape) == (5, 2)
    assert z.numpy().tolist() == [[1.0, 1.0]] * 3 + [[2.0, 2.0]] * 2
    return "ok"


def test_ranks_outside_the_placement(dist_run):
    dist_run(4, _outside_ranks)


def test_local_tensor_api():
    x = sbpflow.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    assert x.is_local and not x.is_global and x.placement is None and x.sbp is None
    assert x.shape == (2, 2) and x.dtype == torch.float32 and x.device.type == "cpu"
    assert x.tolist() == [[1.0, 2.0], [3.0, 4.0]] and x.to_torch().shape == (2, 2)
    t = torch.ones(3)
    assert sbpflow.from_torch(t).to_torch() is t  # no copy
    with pytest.raises(ValueError, match="placement= and sbp="):
        sbpflow.from_torch(t).to_global(sbp=B)
    with pytest.raises(TypeError, match="sbpflow.placement"):
        sbpflow.from_torch(t).to_global("cpu", B)
    with pytest.raises(ValueError, match="without sbp"):
        sbpflow.zeros(2, placement=sbpflow.placement("cpu", [0]))
    with pytest.raises(ValueError, match=r"S\(1\) splits dim 1, but the tensor has 1 dims"):
        sbpflow.zeros(2, placement=sbpflow.placement("cpu", [0]), sbp=S1)
    with pytest.raises(ValueError, match="to_torch"):
        sbpflow.zeros(2, placement=sbpflow.placement("cpu", [0]), sbp=B).to_torch()


def test_world_of_one_global():
    pl = sbpflow.placement("cpu", [0])
    x = sbpflow.tensor([1.0, 2.0, 3.0], placement=pl, sbp=S0, requires_grad=True)
    y = x.to_global(sbp=B)
    assert "S(0)" in repr(x) and y.sbp == (B,)
    y.backward(sbpflow.ones(3, placement=pl, sbp=B))
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


def _rank_dependent_inputs():
    pl = sbpflow.placement.all("cpu")
    r = _rank()
    # B: only the first rank's value, dtype and shape count; the others are overwritten.
    local = torch.arange(4.0) if r == 0 else torch.arange(6, dtype=torch.int64)
    x = sbpflow.from_torch(local).to_global(pl, B)
    assert x.dtype == torch.float32 and x.to_local().to_torch().tolist() == [0.0, 1.0, 2.0, 3.0]
    # tensor(): data of different lengths per rank; the first rank's wins.
    t = sbpflow.tensor([1.0] * (r + 2), placement=pl, sbp=S0)
    assert tuple(t.shape) == (2,) and t.numpy().tolist() == [1.0, 1.0]
    # S with disagreeing dtypes is refused, naming both ranks.
    with pytest.raises(ValueError, match=r"rank 0 has shape \(2,\) and dtype torch.float32, but "
                                         r"rank 1 has shape \(2,\) and dtype torch.float64"):
        sbpflow.from_torch(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64)) \
            .to_global(pl, S0)
    # gloo has no int16: a clear TypeError on every rank, not a timeout.
    with pytest.raises(TypeError, match="cast to torch.int32"):
        sbpflow.ones(4, dtype=torch.int16, placement=pl, sbp=S0).numpy()
    # Setting a gradient layout after a gradient exists would mislabel it: refused.
    w = sbpflow.ones(4, placement=pl, sbp=B, requires_grad=True)
    w.to_global(sbp=S0).backward(sbpflow.ones(4, placement=pl, sbp=S0))
    with pytest.raises(ValueError, match="already has a gradient"):
        w.set_grad_sbp(S0)
    return "ok"


def test_rank_dependent_inputs(dist_run):
    dist_run(2, _rank_dependent_inputs)


def _outside_ranks_take_the_members_dtype():
    sub = sbpflow.placement("cpu", [2, 3])
    r = _rank()
    local = torch.ones(2) if r in (2, 3) else torch.zeros(5, dtype=torch.int64)
    x = sbpflow.from_torch(local).to_global(sub, S0)
    assert x.dtype == torch.float32 and tuple(x.shape) == (4,)
    assert x.numpy().tolist() == [1.0] * 4
    return "ok"


def test_outside_ranks_take_the_members_dtype(dist_run):
    dist_run(4, _outside_ranks_take_the_members_dtype)


def test_single_process_input_checks():
    pl = sbpflow.placement("cpu", [0])
    with pytest.raises(ValueError, match=r"local shape \(2,\) is not its shard \(5, 3\)"):
        sbpflow.from_torch(torch.ones(2)).to_global(pl, S0, check_meta=False, size=(5, 3))
    t = torch.ones(3, requires_grad=True)
    x = sbpflow.tensor(t)  # a detached copy, as torch.tensor(t) makes
    assert not x.requires_grad and x.to_torch() is not t
    assert sbpflow.zeros(np.int64(2)).shape == (2,)
    with pytest.raises(TypeError, match="int dim"):
        sbpflow.sbp.Split("a")
    with pytest.raises(ValueError, match="not on a mesh"):
        sbpflow.shard_slices((4,), (2,), (S0,), (5,))


def _like_and_grad_mode():
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    x = sbpflow.randn(7, 5, placement=pl, sbp=(S0, S1))
    z = sbpflow.zeros_like(x)
    assert z.sbp == x.sbp and z.placement == pl and tuple(z.shape) == (7, 5)
    o = sbpflow.ones_like(x, sbp=(B, B))
    assert o.sbp == (B, B) and o.numpy().sum() == 35
    p = sbpflow.ones(7, 5, placement=pl, sbp=(P, S1))
    sbpflow.manual_seed(1)
    r = sbpflow.randn_like(p)  # P read as B: random fills are never partial
    torch.manual_seed(1)
    assert r.sbp == (B, S1) and np.array_equal(r.numpy(), torch.randn(7, 5).numpy())
    w = sbpflow.ones(3, placement=pl, sbp=(B, B), requires_grad=True)
    with sbpflow.no_grad():
        y = w * 2
    assert not y.requires_grad
    with sbpflow.set_grad_enabled(True):
        assert (w * 2).requires_grad
    return "ok"


def test_like_creation_and_grad_mode(dist_run):
    dist_run(4, _like_and_grad_mode)


def _data_updates_in_place():
    """``.data`` on every 1-D layout: an in-place update through it changes the tensor,
    with no autograd history; the tensor stays a leaf whose gradient is right."""
    pl = sbpflow.placement.all("cpu")
    base = torch.arange(12.0).reshape(4, 3) + 1
    for sbp in (S0, S1, B, P):
        p = sbpflow.tensor(base, placement=pl, sbp=B).to_global(pl, sbp)
        p.requires_grad_(True)
        d = p.data
        assert d.sbp == p.sbp and d.placement == p.placement and not d.requires_grad
        assert d.grad_fn is None
        d.mul_(2)  # the classic loop's update, through .data
        assert np.allclose(p.numpy(), 2 * base.numpy()), sbp
        assert p.is_leaf and p.requires_grad and p.grad_fn is None
        (p * p).sum().backward()  # d(sum p^2)/dp = 2p, with p's new values
        assert np.allclose(p.grad.numpy(), 4 * base.numpy()), sbp
        # p.data = t: p holds t's values (any shape), same autograd leaf
        p.data = sbpflow.tensor(torch.ones(2, 3), placement=pl, sbp=B).to_global(pl, sbp)
        assert tuple(p.shape) == (2, 3) and np.allclose(p.numpy(), 1) and p.requires_grad
    p = sbpflow.tensor(base, placement=pl, sbp=S0)
    with pytest.raises(ValueError, match=r"this tensor is global .*value is local"):
        p.data = sbpflow.from_torch(base)
    with pytest.raises(ValueError, match=r"value is global .*to_global\(placement=\.\.\., "
                                         r"sbp=\(S\(0\),\)\)"):
        p.data = sbpflow.tensor(base, placement=pl, sbp=B)
    with pytest.raises(TypeError, match="sbpflow.from_torch"):
        p.data = base
    return "ok"


def test_data_is_the_values_without_history_on_every_layout(dist_run):
    """Issue 21: ``p.data`` (how classic training loops update parameters) was missing."""
    assert dist_run(2, _data_updates_in_place) == ["ok", "ok"]
    x = sbpflow.from_torch(torch.ones(3)).requires_grad_()
    x.data.add_(1)
    assert torch.equal(x.to_torch().detach(), torch.full((3,), 2.0)) and x.is_leaf
