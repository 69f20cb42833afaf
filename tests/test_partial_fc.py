"""The margin softmax and the class-split Partial FC head (``sbpflow.nn.CombinedMarginLoss``,
``sbpflow.nn.PartialFC``) against a one-process PyTorch oracle written here from
InsightFace's formulas (``recognition/arcface_torch/losses.py``, ``partial_fc_v2.py``)."""

from __future__ import annotations

import pytest
import torch

# (s, m1, m2, m3): ArcFace, CosFace, combined (SphereFace-like m1 with both additive margins)
MARGINS = [(64.0, 1.0, 0.5, 0.0), (64.0, 1.0, 0.0, 0.4), (30.0, 1.2, 0.3, 0.2)]


# ------------------------------------------------------------------ the oracle
def torch_margin_logits(cos, labels, s, m1, m2, m3):
    """InsightFace's CombinedMarginLoss on one process: the target logit cos(theta) of
    each row becomes cos(m1 theta + m2) - m3 (its input clamped to [-1, 1], written in
    place under no_grad as InsightFace's ArcFace branch), then everything times s."""
    rows = torch.arange(cos.shape[0])
    with torch.no_grad():
        t = cos[rows, labels].clamp(-1, 1)
        cos[rows, labels] = torch.cos(m1 * torch.arccos(t) + m2) - m3
    return cos * s


def torch_head(W, X, Y, margins, classes=None):
    """Loss and gradients (W, X) of the head on one process: normalize, linear, clamp,
    margin, mean cross entropy. ``classes``: the classes used (Partial FC's sample; the
    labels are remapped into it), default all."""
    W = W.clone().requires_grad_()
    X = X.clone().requires_grad_()
    Wu, Yu = W, Y
    if classes is not None:
        Wu = W[classes]
        Yu = torch.searchsorted(classes, Y)
        assert bool((classes[Yu] == Y).all())
    cos = torch.nn.functional.linear(torch.nn.functional.normalize(X),
                                     torch.nn.functional.normalize(Wu)).clamp(-1, 1)
    logits = torch_margin_logits(cos, Yu, *margins)
    loss = torch.nn.functional.cross_entropy(logits, Yu)
    loss.backward()
    return loss.detach(), W.grad, X.grad


def _data(C, d, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(C, d, generator=g), torch.randn(N, d, generator=g),
            torch.randint(0, C, (N,), generator=g))


def _head(C, d, r=1.0, margins=MARGINS[0], seed=0, W=None, sparse_grad=None):
    import sbpflow
    import sbpflow.nn as nn
    from sbpflow.sbp import split

    pl = sbpflow.placement.all("cpu")
    head = nn.PartialFC(nn.CombinedMarginLoss(*margins), d, C, sample_rate=r, placement=pl,
                        seed=seed, sparse_grad=sparse_grad)
    if W is not None:
        with torch.no_grad():
            head.weight._local.copy_(W[pl.shard_slices((C, d), (split(0),))])
    return head, pl


def _whole(t):
    return torch.as_tensor(t.numpy())


def _whole_grad(p):
    """``p.grad`` as a whole torch tensor, a sparse shard gradient densified first."""
    from sbpflow.tensor import Tensor

    g = p.grad
    local = g._local.to_dense() if g._local.is_sparse else g._local
    return _whole(Tensor(local, g.placement, g.sbp, g.shape))


# ------------------------------------------------------------------ r = 1
def _r1_body(C, d, N):
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    W, X, Y = _data(C, d, N)
    out = []
    for margins in MARGINS:
        head, pl = _head(C, d, margins=margins, W=W)
        x = sbpflow.tensor(X, placement=pl, sbp=split(0), requires_grad=True)
        y = sbpflow.tensor(Y, placement=pl, sbp=split(0))
        with sbpflow.distributed.CommRecorder() as rec:
            loss = head(x, y)
            loss.backward()
        ref_loss, ref_gw, ref_gx = torch_head(W, X, Y, margins)
        torch.testing.assert_close(torch.tensor(loss.item()), ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_whole(head.weight.grad), ref_gw, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(_whole(x.grad), ref_gx, rtol=1e-4, atol=1e-6)
        assert head.weight.grad.sbp == (split(0),) and x.grad.sbp == (split(0),)
        # no collective carries anything of size C: features, labels, and per-row values
        biggest = max(r.bytes for r in rec.records if r.kind != "check")
        out.append((rec.total_bytes(), biggest))
    return out


@pytest.mark.parametrize("world,C", [(2, 7), (4, 11)])
def test_margin_softmax_r1_matches_torch(dist_run, world, C):
    """ArcFace, CosFace and combined margins at r = 1, uneven class splits (7 over 2: 4,3;
    11 over 4: 3,3,3,2): loss, weight and feature gradients equal the one-process oracle;
    the collectives' bytes do not grow with C."""
    d, N = 8, 2 * world
    small = dist_run(world, _r1_body, C, d, N)[0]
    big = dist_run(world, _r1_body, C * 10 + 1, d, N)[0]
    assert small == big  # bytes moved per step are independent of the number of classes
    assert all(b <= N * d * 4 for _, b in small)


def _r1_sparse_body(C, d, N):
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    W, X, Y = _data(C, d, N)
    grads = []
    for sparse_grad in (None, True):
        head, pl = _head(C, d, W=W, sparse_grad=sparse_grad)
        x = sbpflow.tensor(X, placement=pl, sbp=split(0), requires_grad=True)
        head(x, sbpflow.tensor(Y, placement=pl, sbp=split(0))).backward()
        assert head.weight.grad._local.is_sparse is bool(sparse_grad)
        grads.append(_whole_grad(head.weight))
    assert torch.equal(grads[0], grads[1])
    return head.weight.grad._local.coalesce().indices()[0].tolist()


def test_r1_sparse_grad_true(dist_run):
    """At r = 1 the default gradient is dense; sparse_grad=True makes it a sparse tensor
    of every row of the shard (7 classes over 2 ranks: 4 + 3) with the same values."""
    assert dist_run(2, _r1_sparse_body, 7, 4, 4) == [[0, 1, 2, 3], [0, 1, 2]]


def _local_margin_body():
    import sbpflow
    import sbpflow.nn as nn
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    cos = torch.rand(6, 9, generator=g) * 2 - 1
    y = torch.tensor([0, 8, 3, 3, 5, 1])
    pl = sbpflow.placement.all("cpu")
    for margins in MARGINS:
        ref_in = cos.clone().requires_grad_()
        ref = torch_margin_logits(ref_in.clone(), y, *margins)
        ref.backward(torch.ones_like(ref))
        loss = nn.CombinedMarginLoss(*margins)
        # local tensors
        a = sbpflow.from_torch(cos.clone()).requires_grad_()
        out = loss(a, sbpflow.from_torch(y))
        torch.testing.assert_close(out.to_torch(), ref.detach(), rtol=1e-5, atol=1e-5)
        # class-split global logits (S(1)), labels S(0)
        b = sbpflow.tensor(cos, placement=pl, sbp=split(1), requires_grad=True)
        outg = loss(b, sbpflow.tensor(y, placement=pl, sbp=split(0)))
        assert outg.sbp == (split(1),)
        torch.testing.assert_close(_whole(outg), ref.detach(), rtol=1e-5, atol=1e-5)
        outg.sum().backward()
        torch.testing.assert_close(_whole(b.grad), ref_in.grad)
    return "ok"


def test_combined_margin_loss_alone(dist_run):
    """CombinedMarginLoss by itself: local tensors and class-split S(1) logits on 2 ranks
    give InsightFace's values; the gradient is s everywhere (InsightFace's no_grad margin)."""
    assert dist_run(2, _local_margin_body) == ["ok", "ok"]


# ------------------------------------------------------------------ sampling
def _sample_body(C, d, N, r, seed, steps):
    import sbpflow
    import sbpflow.comm as comm
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    W, X, Y = _data(C, d, N, seed=5)
    head, pl = _head(C, d, r=r, seed=seed, W=W)
    start, n_local = head._ranges()[pl.coord()[0]]
    out = {"idx": [], "counts": []}
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        X = torch.randn(N, d, generator=g)
        Y = torch.randint(0, C, (N,), generator=g)
        x = sbpflow.tensor(X, placement=pl, sbp=split(0), requires_grad=True)
        y = sbpflow.tensor(Y, placement=pl, sbp=split(0))
        head.zero_grad()
        loss = head(x, y)
        loss.backward()
        idx = head.sampled_index
        pos = torch.unique(Y[(Y >= start) & (Y < start + n_local)]) - start
        assert bool(torch.isin(pos, idx).all()), "a positive class was not sampled"
        assert bool((idx[1:] > idx[:-1]).all()), "sampled rows not sorted and distinct"
        assert idx.numel() == max(int(r * n_local), pos.numel())
        g = head.weight.grad._local
        assert g.is_sparse, "the default at r < 1 is a sparse gradient"
        rows = g.coalesce().indices()[0]
        assert torch.equal(rows, idx), "the sparse gradient's rows are not the sample"
        out["idx"].append(idx.tolist())
        out["counts"].append(torch.bincount(idx, minlength=n_local))
        if step == 0:  # values and gradients = the oracle on the union of the samples
            pad = torch.full((C,), -1)
            pad[: idx.numel()] = idx + start
            every = comm.all_gather(sbpflow.from_torch(pad)).to_torch()
            classes = every[every >= 0].sort().values
            ref_loss, ref_gw, ref_gx = torch_head(W, X, Y, MARGINS[0], classes)
            torch.testing.assert_close(torch.tensor(loss.item()), ref_loss, rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(_whole_grad(head.weight), ref_gw, rtol=1e-4,
                                       atol=1e-6)
            torch.testing.assert_close(_whole(x.grad), ref_gx, rtol=1e-4, atol=1e-6)
    out["freq"] = torch.stack(out.pop("counts")).float().mean(0).tolist()
    out["n_local"] = n_local
    return out


def test_partial_fc_sampling(dist_run):
    """r = 0.1 on 2 ranks, 203 classes (102 + 101), 8 labels a step: every positive kept,
    max(int(r C_local), positives) sorted distinct rows per step, the weight's sparse
    gradient holds exactly those rows, and the loss and gradients equal the oracle on the
    sampled classes; the same seed gives the same samples, another seed others; each class
    is drawn about r of the time (a bound of 5 binomial standard deviations on the mean
    rate)."""
    C, d, N, r, steps = 203, 8, 8, 0.1, 40
    a = dist_run(2, _sample_body, C, d, N, r, 7, steps)
    b = dist_run(2, _sample_body, C, d, N, r, 7, steps)
    c = dist_run(2, _sample_body, C, d, N, r, 8, steps)
    for ra, rb, rc in zip(a, b, c):
        assert ra["idx"] == rb["idx"]           # deterministic per seed
        assert ra["idx"] != rc["idx"]           # and the seed matters
        freq = torch.tensor(ra["freq"])
        n = ra["n_local"]
        p = sum(len(i) for i in ra["idx"]) / (steps * n)  # mean rate of a class
        assert abs(p - r) < 0.02
        # each class is drawn about p of the steps: the spread of the classes' rates is
        # the binomial one (within a factor 2; its estimate has a relative sd of ~0.14)
        ratio = float(freq.var()) / (p * (1 - p) / steps)
        assert 0.5 < ratio < 2.0, ratio
        assert float(freq.max()) < p + 6 * (p * (1 - p) / steps) ** 0.5


def _tiny_rate_body():
    """r so small that int(r C_local) is 0, all labels on rank 0's classes: rank 1 has no
    positive and still samples one class (found by the README trial: it crashed)."""
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    head, pl = _head(1000, 8, r=1e-4)
    opt = sbpflow.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = sbpflow.tensor(torch.randn(8, 8, generator=g), placement=pl, sbp=split(0))
    y = sbpflow.tensor(torch.randint(0, 10, (8,), generator=g), placement=pl, sbp=split(0))
    loss = head(x, y)
    loss.backward()
    opt.step()
    return loss.item(), head.sampled_index.numel()


def test_a_tiny_sample_rate_samples_one_class_on_a_rank_without_positives(dist_run):
    out = dist_run(2, _tiny_rate_body)
    assert out[0][0] == out[1][0] and out[0][0] > 0
    assert out[1][1] == 1 and 1 <= out[0][1] <= 8, out


def _sgd_body(C, d, N, r, momentum):
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    W, X, Y = _data(C, d, N, seed=2)
    head, pl = _head(C, d, r=r, seed=3, W=W, margins=(2.0, 1.0, 0.5, 0.0), sparse_grad=False)
    opt = sbpflow.optim.SGD(head.parameters(), lr=0.5, momentum=momentum)
    x = sbpflow.tensor(X, placement=pl, sbp=split(0))
    y = sbpflow.tensor(Y, placement=pl, sbp=split(0))
    before = head.weight._local.clone()
    head(x, y).backward()
    assert not head.weight.grad._local.is_sparse
    opt.step()
    opt.zero_grad()
    first = head.sampled_index.clone()
    changed = (head.weight._local != before).any(1).nonzero().squeeze(1)
    # (with s = 2 no softmax probability underflows, so every sampled row has a gradient)
    assert torch.equal(changed, first), (changed, first)  # only the sampled rows moved
    # a second step with other labels: InsightFace v2's (torch SGD's) semantics for rows
    # sampled only in the first step: unchanged without momentum; with momentum they move
    # by their decayed momentum buffer
    mid = head.weight._local.clone()
    buf = opt.state[head.weight._local]["momentum_buffer"].clone() if momentum else None
    head(x, sbpflow.tensor((Y + 1) % C, placement=pl, sbp=split(0))).backward()
    opt.step()
    second = head.sampled_index
    only_first = first[~torch.isin(first, second)]
    moved = head.weight._local[only_first]
    if momentum:
        torch.testing.assert_close(moved, mid[only_first] - 0.5 * momentum * buf[only_first])
    else:
        assert torch.equal(moved, mid[only_first])
    assert only_first.numel() > 0
    return "ok"


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_partial_fc_v2_sgd_updates_sampled_rows(dist_run, momentum):
    """sparse_grad=False (a dense gradient): after an SGD step only the sampled rows change
    (bit-identical others); on the next step the rows no longer sampled keep their values
    (plain SGD) or move by their decayed momentum (momentum 0.9: InsightFace PartialFC_V2
    with torch.optim.SGD)."""
    assert dist_run(2, _sgd_body, 401, 8, 8, 0.1, momentum) == ["ok", "ok"]


# ------------------------------------------------------------------ v1: lazy momentum
LR, MOMENTUM, WD = 0.1, 0.9, 5e-4


def _batch(C, d, N, step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(N, d, generator=g), torch.randint(0, C, (N,), generator=g)


def _all_samples(head, start):
    """Every rank's sampled classes of this step (global indices, sorted)."""
    import sbpflow
    import sbpflow.comm as comm

    pad = torch.full((head.num_classes,), -1)
    idx = head.sampled_index
    pad[: idx.numel()] = idx + start
    every = comm.all_gather(sbpflow.from_torch(pad)).to_torch()
    return every[every >= 0].sort().values


def _v1_oracle_step(W, mom, X, Y, classes, margins):
    """One step of InsightFace v1 (``partial_fc.py`` + ``train.py``) on one process: the
    sampled rows of the weight and of its momentum are copied into a sub-parameter and its
    ``momentum_buffer``, ``torch.optim.SGD`` (momentum, weight_decay) steps it, and both
    are written back; the other rows and their momentum are not touched."""
    _, gW, _ = torch_head(W, X, Y, margins, classes)
    sub = torch.nn.Parameter(W[classes].clone())
    opt = torch.optim.SGD([sub], lr=LR, momentum=MOMENTUM, weight_decay=WD)
    opt.state[sub]["momentum_buffer"] = mom[classes].clone()
    sub.grad = gW[classes]
    opt.step()
    W, mom = W.clone(), mom.clone()
    W[classes] = sub.detach()
    mom[classes] = opt.state[sub]["momentum_buffer"]
    return W, mom


def _v1_body(C, d, N, r, steps, sparse_grad):
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    margins = (2.0, 1.0, 0.5, 0.0)  # s = 2: every sampled row gets a nonzero gradient
    W, _, _ = _data(C, d, N, seed=4)
    head, pl = _head(C, d, r=r, seed=9, W=W, margins=margins, sparse_grad=sparse_grad)
    opt = sbpflow.optim.SGD(head.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    start, n_local = head._ranges()[pl.coord()[0]]
    mine = slice(start, start + n_local)
    Wo, mom_o = W.clone(), torch.zeros_like(W)
    out = {"frozen": [], "err_w": 0.0, "err_m": 0.0}
    for step in range(steps):
        X, Y = _batch(C, d, N, step)
        w_before = head.weight._local.clone()
        st = opt.state.get(head.weight._local, {})
        m_before = st["momentum_buffer"].clone() if st else torch.zeros_like(w_before)
        opt.zero_grad()
        head(sbpflow.tensor(X, placement=pl, sbp=split(0)),
             sbpflow.tensor(Y, placement=pl, sbp=split(0))).backward()
        opt.step()
        idx = head.sampled_index
        Wo, mom_o = _v1_oracle_step(Wo, mom_o, X, Y, _all_samples(head, start), margins)
        w = head.weight._local.detach()
        m = opt.state[head.weight._local]["momentum_buffer"]
        rest = torch.ones(n_local, dtype=torch.bool)
        rest[idx] = False
        # the unsampled rows and their momentum: bit-identical to before the step
        out["frozen"].append(bool(torch.equal(w[rest], w_before[rest])) and
                             bool(torch.equal(m[rest], m_before[rest])))
        out["err_w"] = max(out["err_w"], float((w - Wo[mine]).abs().max()))
        out["err_m"] = max(out["err_m"], float((m - mom_o[mine]).abs().max()))
    out["rest_sampled"] = int(rest.sum())
    return out


@pytest.mark.parametrize("sparse_grad", [None, False])
def test_partial_fc_v1_lazy_momentum_matches_insightface(dist_run, sparse_grad):
    """The default at r < 1 (a sparse gradient, stepped by sbpflow.optim.SGD's lazy
    momentum) is the original Partial FC: 6 steps of SGD (momentum 0.9, weight_decay
    5e-4) at r = 0.1 on 2 ranks (203 classes: 102 + 101) equal a one-process InsightFace
    v1 oracle (sub-parameter and its momentum stepped by torch.optim.SGD and written back)
    given the same samples, weight and momentum; the unsampled rows and their momentum are
    bit-identical to before each step. sparse_grad=False (the PartialFC_V2 semantics)
    fails both: there the unsampled rows' momentum decays and moves them, and weight
    decay shrinks every row."""
    res = dist_run(2, _v1_body, 203, 8, 8, 0.1, 6, sparse_grad)
    for r in res:
        assert r["rest_sampled"] > 0
        if sparse_grad is None:
            assert all(r["frozen"]), r["frozen"]
            assert r["err_w"] < 1e-6 and r["err_m"] < 1e-6, r
        else:
            assert not any(r["frozen"])  # step 0 too: weight decay shrinks every row
            assert r["err_w"] > 1e-4 and r["err_m"] > 1e-4, r


def _adam_body(name):
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    head, pl = _head(203, 8, r=0.1)
    opt = getattr(sbpflow.optim, name)(head.parameters(), lr=0.01)
    X, Y = _batch(203, 8, 8, 0)
    x = sbpflow.tensor(X, placement=pl, sbp=split(0))
    y = sbpflow.tensor(Y, placement=pl, sbp=split(0))
    head(x, y).backward()
    before = head.weight._local.clone()
    with pytest.raises(RuntimeError) as e:
        opt.step()
    assert torch.equal(head.weight._local, before)  # nothing stepped
    # the fix named in the message works: a dense gradient
    dense, _ = _head(203, 8, r=0.1, sparse_grad=False)
    opt = getattr(sbpflow.optim, name)(dense.parameters(), lr=0.01)
    dense(x, y).backward()
    opt.step()
    return str(e.value)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_partial_fc_sparse_grad_refused_by_adam(dist_run, name):
    """Adam/AdamW cannot step the sparse gradient (r < 1, the default): a RuntimeError
    before any update names the optimizer, the parameter (shape, layout), PartialFC as
    its source and both fixes (an optimizer with a sparse update, or sparse_grad=False);
    with sparse_grad=False the same optimizer steps."""
    for msg in dist_run(2, _adam_body, name):
        assert msg.startswith(f"{name} cannot step a sparse gradient"), msg
        assert "(203, 8)" in msg and "S(0)" in msg, msg
        assert "nn.PartialFC" in msg and "sparse_grad=False" in msg, msg
        assert "sbpflow.optim.SGD" in msg and "SparseAdam" in msg, msg


# ------------------------------------------------------------------ resume
def _resume_body(folder, k, steps, mode):
    import warnings

    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    C, d, N = 203, 8, 8
    W, _, _ = _data(C, d, N, seed=6)

    def make():
        head, pl = _head(C, d, r=0.1, seed=11, W=W)
        opt = sbpflow.optim.SGD(head.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
        return head, pl, opt

    def run(head, pl, opt, first, last):
        idx = []
        for step in range(first, last):
            X, Y = _batch(C, d, N, step)
            opt.zero_grad()
            head(sbpflow.tensor(X, placement=pl, sbp=split(0)),
                 sbpflow.tensor(Y, placement=pl, sbp=split(0))).backward()
            opt.step()
            idx.append(head.sampled_index.tolist())
        return idx

    head, pl, opt = make()
    idx_a = run(head, pl, opt, 0, k)
    sbpflow.save({"model": head.state_dict(), "optim": opt.state_dict()}, folder)
    idx_a += run(head, pl, opt, k, steps)
    w_a = head.weight._local.clone()
    m_a = opt.state[head.weight._local]["momentum_buffer"].clone()

    head, pl, opt = make()
    run(head, pl, opt, 0, 1)  # the fresh module has moved on: the load must undo it
    ck = sbpflow.load(folder)
    if mode == "no_sampler":  # what a resume without the sampler state gives
        del ck["model"]["_extra_state"]
        with pytest.raises(RuntimeError, match='Missing key.*"_extra_state"'):
            head.load_state_dict(ck["model"])
        head.load_state_dict(ck["model"], strict=False)
    else:
        head.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    idx_b = run(head, pl, opt, k, steps)
    w_b = head.weight._local
    m_b = opt.state[head.weight._local]["momentum_buffer"]
    res = {"same_samples": idx_b == idx_a[k:], "same_weight": bool(torch.equal(w_a, w_b)),
           "same_momentum": bool(torch.equal(m_a, m_b))}
    # another number of ranks: reseeded as a fresh module, with a warning
    state = head.state_dict()["_extra_state"]
    fresh, _ = _head(C, d, r=0.1, seed=11)
    other = torch.zeros(3, state.shape[1], dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head.set_extra_state(other)
    res["warned"] = [str(w.message) for w in caught]
    res["reseeded"] = bool(torch.equal(head._generator.get_state(),
                                       fresh._generator.get_state()))
    with pytest.raises(ValueError, match=r"expected \(2, \d+\)"):
        head.set_extra_state(torch.zeros(2, 7, dtype=torch.uint8))
    return res


@pytest.mark.parametrize("mode", ["resume", "no_sampler"])
def test_partial_fc_resume_is_exact(dist_run, tmp_path, mode):
    """Train 3 steps (r = 0.1, SGD momentum 0.9, weight decay 5e-4, 2 ranks), save the
    module's and the optimizer's state dicts with sbpflow.save, load them into a fresh
    module and optimizer (whose sampler has already drawn once) and train 3 more: the
    samples, the weight and the momentum buffer are bit-identical to 6 uninterrupted
    steps. Without the module's _extra_state (the sampler; a missing key for a strict
    load) they are not. Loading a
    sampler state of another number of ranks warns and reseeds as a fresh module; a
    state of the wrong shape raises ValueError."""
    for r in dist_run(2, _resume_body, str(tmp_path / "ckpt"), 3, 6, mode):
        exact = mode == "resume"
        assert r["same_samples"] is exact and r["same_weight"] is exact, r
        assert r["same_momentum"] is exact, r
        assert r["reseeded"] and len(r["warned"]) == 1, r
        assert "saved on 3 ranks, this module has 2" in r["warned"][0]


# ------------------------------------------------------------------ bad input
def _bad_labels_body():
    import sbpflow
    from sbpflow.sbp import split

    torch.set_num_threads(1)
    head, pl = _head(10, 4)
    x = sbpflow.tensor(torch.randn(4, 4), placement=pl, sbp=split(0))
    msgs = []
    for bad in (10, -1):
        y = sbpflow.tensor(torch.tensor([1, 2, bad, 3]), placement=pl, sbp=split(0))
        with pytest.raises(ValueError) as e:
            head(x, y)
        msgs.append(str(e.value))
    with pytest.raises(TypeError, match="integer"):
        head(x, sbpflow.tensor(torch.zeros(4), placement=pl, sbp=split(0)))
    return msgs


def test_partial_fc_bad_labels(dist_run):
    """A label outside [0, C) raises ValueError on every rank naming the label and C."""
    for msgs in dist_run(2, _bad_labels_body):
        assert "label 10 at position 2" in msgs[0] and "[0, 10)" in msgs[0]
        assert "label -1 at position 2" in msgs[1]


def test_bad_arguments():
    """sample_rate outside (0, 1], bad margins, heads and sparse_grad raise with the value
    named."""
    import sbpflow.nn as nn

    ml = nn.CombinedMarginLoss(64, 1.0, 0.5, 0.0)
    for r in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
            nn.PartialFC(ml, 8, 100, sample_rate=r)
    with pytest.raises(ValueError, match="s must be > 0"):
        nn.CombinedMarginLoss(0, 1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="m1 must be > 0"):
        nn.CombinedMarginLoss(64, 0.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="finite"):
        nn.CombinedMarginLoss(64, 1.0, float("inf"), 0.0)
    with pytest.raises(ValueError, match="interclass_filtering_threshold"):
        nn.CombinedMarginLoss(64, 1.0, 0.5, 0.0, interclass_filtering_threshold=0.4)
    with pytest.raises(TypeError, match="CombinedMarginLoss"):
        nn.PartialFC(lambda z, y: z, 8, 100)
    with pytest.raises(ValueError, match="embedding_size"):
        nn.PartialFC(ml, 0, 100)
    with pytest.raises(TypeError, match="sparse_grad must be None"):
        nn.PartialFC(ml, 8, 100, sample_rate=0.1, sparse_grad="yes")


# ------------------------------------------------------------------ the bench
def test_bench_partial_fc_tiny(tmp_path, capsys):
    """``sbpflow bench partial-fc`` in this process (one rank): every runner reports
    samples/s and memory; the head's state is counted exactly (weight, gradient, momentum:
    3 C d float32 on one rank; at r = 0.1 the gradient is sparse: 100 rows' values and
    int64 indices); past the memory cap the PyTorch peer is "does not fit"."""
    import json

    from sbpflow import cli

    C1, C2, d = 1000, 50_000, 16
    out = tmp_path / "pfc"
    assert cli.main(["bench", "partial-fc", "--classes", f"{C1},{C2}", "--embedding-size", str(d),
                       "--batch-size", "8", "--warmup", "1", "--steps", "1", "--repeats", "1",
                       "--mem-cap-gib", "0.01", "--out", str(out)]) == 0
    r = json.loads((out / "bench.json").read_text())
    assert r["synthetic_data"] is True
    small, big = r["runs"]
    assert list(small["runners"]) == ["sbpflow r=1", "sbpflow r=0.1", "torch-ddp"]
    assert small["torch"]["fits"] and not big["torch"]["fits"]
    assert "torch-ddp" not in big["runners"] and big["ratios"] is None
    for name, side in small["runners"].items():
        assert side["samples_per_s"] > 0 and side["step_peak_bytes"] > 0
        grad = 100 * (d * 4 + 8) if name == "sbpflow r=0.1" else C1 * d * 4
        assert side["head_state_bytes"] == 2 * C1 * d * 4 + grad, name
        # resident between steps: weight and momentum (one process: no DDP buckets)
        assert side["peak_bytes"] == 2 * C1 * d * 4 + side["step_peak_bytes"], name
        assert small["ratios"] is not None
    md = (out / "bench.md").read_text()
    assert "does not fit" in md and "synthetic" in md.lower()
    assert "samples/s" in capsys.readouterr().out
