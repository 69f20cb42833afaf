"""The model zoo (``sbpflow.models``): every named config builds (parameter counts of the
big ones from their torch twins on the meta device: GPT-2 124M/350M, BERT-base, torchvision's
ResNet-18/50); each model file run as sbpflow and as its plain-PyTorch twin holds the same
parameters and gives the same loss and gradients; GPT trains tensor parallel and data
parallel on 2 ranks with the one-process PyTorch losses; BERT's tensor-parallel forward and
backward equal one process; ResNet-18 data parallel equals one process (BatchNorm over the
global batch); a tensor-parallel GPT step runs all-reduces only, two per block each way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sbpflow
from sbpflow import models
from sbpflow.distributed import CommRecorder
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

# Small configs for the equality tests (the registered mini configs, shortened).
GPT_SMALL = dict(n_layer=2, block_size=32)
BERT_SMALL = dict(n_layer=2, max_position=32)


def _tokens(seed: int, vocab: int, shape=(4, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape,
                                                                      generator=g)


def _mlm_batch(seed: int, vocab: int, shape=(4, 16)):
    """Ids and labels: the original token at ~30% of positions, -100 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=g)
    labels = torch.where(torch.rand(shape, generator=g) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one label per row
    return ids, labels


def _images(seed: int, shape=(8, 1, 8, 8), classes: int = 10):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randint(0, classes, shape[:1], generator=g)


def _pair(name: str, **overrides):
    """(sbpflow model, torch twin) built from the same seed."""
    spec = models.get(name)
    sbpflow.manual_seed(0)
    sm = spec.build(**overrides)
    torch.manual_seed(0)
    tm = spec.build_torch(**overrides)
    return sm, tm


def _loss(task: str, model, x, y, F):
    if task == "image":
        return F.cross_entropy(model(x), y)
    return model(x, y)[1]


def _close(a, b, rtol=1e-5, atol=1e-6, what=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=what)


# ------------------------------------------------------------------ registry
def test_registry():
    assert {"gpt-mini", "gpt2", "gpt2-medium", "bert-mini", "bert-base", "resnet18",
            "resnet50", "resnet18-digits"} <= set(models.names())
    for name in models.names():
        spec = models.get(name)
        assert spec.task == {"gpt": "lm", "bert": "mlm", "resnet": "image", "dlrm": "ctr",
                             "wide_deep": "ctr", "face": "face"}[spec.family]
        # data parallel: all replicated, except a recommendation model's tables (by rows)
        assert (spec.plan("dp") == {}) == (spec.task != "ctr")
        assert spec.plan(spec.default_layout) is not None
    assert models.get("gpt-mini").default_layout == "tp"
    assert models.get("bert-mini").default_layout == "dp"
    assert models.get("resnet50").default_layout == "dp"
    with pytest.raises(ValueError, match="has no 'tp' plan"):
        models.get("resnet18").plan("tp")
    with pytest.raises(ValueError, match="no model 'gpt3'"):
        models.get("gpt3")
    with pytest.raises(TypeError, match=r"no config field\(s\) \['n_layers'\]"):
        models.get("gpt-mini").build(n_layers=2)
    with pytest.raises(ValueError, match="not divisible by n_head"):
        models.get("gpt-mini").build(n_head=3)


def test_arcface_is_insightfaces_margin_softmax():
    """The zoo's ArcFace job (sbpflow, one process) against InsightFace's formula written
    directly in torch: the target cosine replaced by cos(theta + 0.5) without gradient
    (``CombinedMarginLoss``'s ArcFace branch), scaled by 64, softmax cross entropy; the
    loss and the head's and backbone's gradients."""
    import sbpflow

    spec = models.get("arcface-1e4")
    sbpflow.manual_seed(0)
    m = spec.build(num_classes=300, in_features=16, embedding_size=8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 16, generator=g), torch.randint(0, 300, (12,), generator=g)
    W = torch.from_numpy(m.fc.weight.numpy()).requires_grad_(True)
    Wb = torch.from_numpy(m.backbone.weight.numpy()).requires_grad_(True)
    bb = torch.from_numpy(m.backbone.bias.numpy())
    emb = torch.nn.functional.normalize(x @ Wb.T + bb, dim=1)
    cos = (emb @ torch.nn.functional.normalize(W, dim=1).T).clamp(-1, 1)
    logits = cos.clone()
    with torch.no_grad():
        t = cos[torch.arange(12), y]
        # in place without gradient, as InsightFace: the target's gradient reaches cos
        logits[torch.arange(12), y] = torch.cos(torch.acos(t) + 0.5)
    want = torch.nn.functional.cross_entropy(64 * logits, y)
    want.backward()
    got = m(sbpflow.tensor(x), sbpflow.tensor(y))[1]
    got.backward()
    _close(got.item(), want.item(), what="loss")
    _close(m.fc.weight.grad.numpy(), W.grad, what="head gradient")
    _close(m.backbone.weight.grad.numpy(), Wb.grad, atol=1e-5, what="backbone gradient")


@pytest.mark.parametrize("name, count", [
    ("gpt2", 124_475_904),  # GPT-2 124M with the vocabulary padded to 50304
    ("gpt2-medium", 354_871_296),
    ("bert-base", 109_514_298),  # BertForMaskedLM (no pooler)
    ("resnet18", 11_689_512),  # torchvision's counts
    ("resnet50", 25_557_032),
])
def test_big_configs_parameter_counts(name, count):
    with torch.device("meta"):
        tm = models.get(name).build_torch()
    assert sum(p.numel() for p in tm.parameters()) == count


def test_resnet_structure_is_torchvision():
    spec = models.get("resnet50")
    with torch.device("meta"):
        tm = spec.build_torch()
    sd = tm.state_dict()
    assert sd["layer2.0.conv2.weight"].shape == (128, 128, 3, 3)  # v1.5: stride on the 3x3
    assert tm.layer2[0].conv2.stride == (2, 2) and tm.layer2[0].conv1.stride == (1, 1)
    assert sd["layer2.0.downsample.0.weight"].shape == (512, 256, 1, 1)
    assert sd["conv1.weight"].shape == (64, 3, 7, 7) and "bn1.num_batches_tracked" in sd
    assert isinstance(tm.maxpool, torch.nn.MaxPool2d) and sd["fc.weight"].shape == (1000, 2048)
    small = models.get("resnet18-digits").build_torch()
    assert small.conv1.weight.shape == (64, 1, 3, 3) and small.conv1.stride == (1, 1)
    assert isinstance(small.maxpool, torch.nn.Identity) and small.fc.out_features == 10
    out = small(torch.randn(2, 1, 8, 8))
    assert out.shape == (2, 10)
    # torchvision's init: kaiming normal (fan_out) convs, BN weight 1 and bias 0.
    w = small.layer3[0].conv1.weight
    assert abs(w.std().item() - (2 / (w.shape[0] * 9)) ** 0.5) < 0.1 * (2 / (w.shape[0] * 9)) ** 0.5
    assert torch.all(small.layer1[0].bn1.weight == 1) and torch.all(small.layer1[0].bn1.bias == 0)


# ------------------------------------------------------------------ sbpflow == torch twin
TWIN_CASES = {
    "gpt-mini": ({}, lambda: _tokens(1, 256, (4, 32))),
    "bert-mini": ({"dropout": 0.0}, lambda: _mlm_batch(1, 256)),
    "resnet18-digits-mini": ({}, lambda: _images(1)),
    # a bottleneck (ResNet-50 v1.5 structure) at small width on small images
    "resnet50": ({"width": 8, "in_channels": 1, "num_classes": 10, "layers": (1, 1, 2, 1),
                  "small_input": True}, lambda: _images(1, (4, 1, 8, 8))),
}


@pytest.mark.parametrize("name", list(TWIN_CASES))
def test_same_as_torch_twin(name):
    overrides, batch = TWIN_CASES[name]
    sm, tm = _pair(name, **overrides)
    assert isinstance(tm, torch.nn.Module) and not isinstance(sm, torch.nn.Module)
    ssd, tsd = sm.state_dict(), tm.state_dict()
    assert list(ssd) == list(tsd)  # names and order
    for k in tsd:
        assert torch.equal(ssd[k].to_torch(), tsd[k]), k  # identical initialisation
    task = models.get(name).task
    x, y = batch()
    sl = _loss(task, sm, sbpflow.tensor(x), sbpflow.tensor(y), sbpflow.nn.functional)
    tl = _loss(task, tm, x, y, torch.nn.functional)
    sl.backward()
    tl.backward()
    _close(sl.item(), tl.item(), what=name)
    for (n, p), q in zip(sm.named_parameters(), tm.parameters()):
        _close(p.grad.numpy(), q.grad.numpy(), rtol=1e-4, atol=1e-6, what=n)


def test_output_shapes():
    gpt = models.get("gpt-mini").build(**GPT_SMALL)
    idx, tgt = (sbpflow.tensor(t) for t in _tokens(0, 256, (3, 20)))
    logits, loss = gpt(idx, tgt)
    assert tuple(logits.shape) == (3, 20, 256) and loss.ndim == 0
    logits, loss = gpt(idx)
    assert tuple(logits.shape) == (3, 1, 256) and loss is None
    with pytest.raises(ValueError, match="longer than block_size 32"):
        gpt(sbpflow.zeros(1, 33, dtype=sbpflow.long))
    bert = models.get("bert-mini").build(**BERT_SMALL)
    ids, labels = (sbpflow.tensor(t) for t in _mlm_batch(0, 256, (3, 20)))
    logits, loss = bert(ids, labels)
    assert tuple(logits.shape) == (3, 20, 256) and loss.ndim == 0
    assert bert(ids)[1] is None


def test_bert_token_types_and_padding_mask_match_twin():
    sm, tm = _pair("bert-mini", dropout=0.0, **BERT_SMALL)
    ids, labels = _mlm_batch(2, 256, (2, 12))
    types = torch.cat([torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)],
                      1)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels[1, 9:] = -100
    sl = sm(*(sbpflow.tensor(t) for t in (ids, labels, types, mask)))[1]
    tl = tm(ids, labels, types, mask)[1]
    _close(sl.item(), tl.item())
    # a padded position does not change the others' logits
    ids2 = ids.clone()
    ids2[1, 10] = (ids2[1, 10] + 1) % 256
    tl2 = tm(ids2, labels, types, mask)[1]
    _close(tl2.item(), tl.item())


def test_gpt_generate_matches_twin():
    sm, tm = _pair("gpt-mini", n_layer=2, block_size=8)
    sm.eval()
    tm.eval()
    sbpflow.manual_seed(5)
    out = sm.generate(sbpflow.zeros(2, 1, dtype=sbpflow.long), 12, temperature=0.8, top_k=5)
    torch.manual_seed(5)
    ref = tm.generate(torch.zeros(2, 1, dtype=torch.long), 12, temperature=0.8, top_k=5)
    assert tuple(out.shape) == (2, 13)  # past block_size 8: the context is cropped
    assert np.array_equal(out.numpy(), ref.numpy())


# ------------------------------------------------------------------ parallel == one process
STEPS = 3


def _torch_gpt_losses() -> list[float]:
    _, tm = _pair("gpt-mini", **GPT_SMALL)
    opt = torch.optim.AdamW(tm.parameters(), lr=3e-3, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        x, y = _tokens(10 + step, 256)
        opt.zero_grad()
        loss = tm(x, y)[1]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _gpt_losses(layout: str) -> list[float]:
    spec = models.get("gpt-mini")
    sbpflow.manual_seed(0)
    m = spec.build(**GPT_SMALL)
    pl = sbpflow.placement("cpu", [[0, 1], [2, 3]]) if layout == "dp_tp" \
        else sbpflow.placement.all("cpu")
    parallelize_module(m, pl, spec.plan("dp" if layout == "dp" else "tp"))
    data_sbp = {"dp": split(0), "tp": B, "dp_tp": (split(0), B)}[layout]
    opt = sbpflow.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        x, y = (sbpflow.tensor(t, placement=pl, sbp=data_sbp) for t in _tokens(10 + step, 256))
        opt.zero_grad()
        loss = m(x, y)[1]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("layout", ["tp", "dp", pytest.param("dp_tp",
                                                             marks=pytest.mark.exhaustive)])
def test_gpt_parallel_follows_one_process(dist_run, layout):
    want = _torch_gpt_losses()
    got = dist_run(4 if layout == "dp_tp" else 2, _gpt_losses, layout, timeout=300)
    assert got[0] == got[1]
    _close(got[0], want, rtol=1e-5, atol=0, what=layout)


def _gpt_tp_comms(n_layer: int):
    spec = models.get("gpt-mini")
    sbpflow.manual_seed(0)
    m = spec.build(n_layer=n_layer, block_size=32)
    pl = sbpflow.placement.all("cpu")
    parallelize_module(m, pl, spec.plan("tp"))
    x, y = (sbpflow.tensor(t, placement=pl, sbp=B) for t in _tokens(3, 256))
    with CommRecorder() as fwd:
        logits, loss = m(x, y)
    with CommRecorder() as bwd:
        loss.backward()
    assert logits.sbp == (split(2),)  # the logits stay split on the vocabulary
    return fwd.kinds(), bwd.kinds()


def test_gpt_tensor_parallel_runs_only_all_reduces(dist_run):
    """Megatron's count: per block one all-reduce after attention and one after the MLP,
    forward and backward; plus the embedding (1 each way), the vocabulary-parallel cross
    entropy (2 forward: max and sum of exponentials; 1 backward) and the bucketed
    gradient sync of the replicated parameters. Nothing is gathered."""
    counts = {}
    for n_layer in (1, 3):
        fwd, bwd = dist_run(2, _gpt_tp_comms, n_layer)[0]
        assert set(fwd) == set(bwd) == {"all_reduce"}, (fwd, bwd)
        counts[n_layer] = (len(fwd), len(bwd))
    assert counts[1][0] == 2 * 1 + 3, counts
    assert counts[3][0] - counts[1][0] == 2 * 2, counts
    assert counts[3][1] - counts[1][1] in (4, 5), counts  # + maybe one more gradient bucket


def _gpt_tp_generate():
    spec = models.get("gpt-mini")
    sbpflow.manual_seed(0)
    m = spec.build(**GPT_SMALL)
    pl = sbpflow.placement.all("cpu")
    parallelize_module(m, pl, spec.plan("tp"))
    m.eval()
    sbpflow.manual_seed(5)
    out = m.generate(sbpflow.zeros(2, 1, dtype=sbpflow.long, placement=pl, sbp=B), 10,
                     temperature=0.8, top_k=5)
    return out.numpy()


def test_gpt_tensor_parallel_generate_matches_torch(dist_run):
    got = dist_run(2, _gpt_tp_generate)
    _, tm = _pair("gpt-mini", **GPT_SMALL)
    tm.eval()
    torch.manual_seed(5)
    ref = tm.generate(torch.zeros(2, 1, dtype=torch.long), 10, temperature=0.8, top_k=5)
    assert np.array_equal(got[0], ref.numpy()) and np.array_equal(got[1], ref.numpy())


def _bert_parallel(layout: str):
    spec = models.get("bert-mini")
    sbpflow.manual_seed(0)
    m = spec.build(dropout=0.0, **BERT_SMALL)
    pl = sbpflow.placement.all("cpu")
    parallelize_module(m, pl, spec.plan(layout))
    data_sbp = split(0) if layout == "dp" else B
    ids, labels = (sbpflow.tensor(t, placement=pl, sbp=data_sbp) for t in _mlm_batch(4, 256))
    with CommRecorder() as rec:
        loss = m(ids, labels)[1]
        loss.backward()
    grads = {n: p.grad.numpy() for n, p in m.named_parameters()}
    return loss.item(), grads, sorted(set(rec.kinds()))


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_bert_parallel_equals_one_process(dist_run, layout):
    _, tm = _pair("bert-mini", dropout=0.0, **BERT_SMALL)
    ids, labels = _mlm_batch(4, 256)
    tl = tm(ids, labels)[1]
    tl.backward()
    loss, grads, kinds = dist_run(2, _bert_parallel, layout)[0]
    _close(loss, tl.item())
    for n, p in tm.named_parameters():
        _close(grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6, what=n)
    assert kinds == ["all_reduce"], kinds


def _resnet_steps(world: int):
    spec = models.get("resnet18-digits-mini")
    sbpflow.manual_seed(0)
    m = spec.build()
    if world > 1:
        pl = sbpflow.placement.all("cpu")
        parallelize_module(m, pl, spec.plan("dp"))
    opt = sbpflow.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(2):
        x, y = _images(20 + step)
        if world > 1:
            x, y = (sbpflow.tensor(t, placement=pl, sbp=split(0)) for t in (x, y))
        else:
            x, y = sbpflow.tensor(x), sbpflow.tensor(y)
        opt.zero_grad()
        loss = sbpflow.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.numpy() for k, v in m.state_dict().items()}
    return losses, state


def test_resnet18_data_parallel_equals_one_process(dist_run):
    """BatchNorm over the global batch: losses, parameters and running statistics after
    two SGD steps on 2 ranks equal one process's."""
    want_losses, want_state = _resnet_steps(1)
    got_losses, got_state = dist_run(2, _resnet_steps, 2, timeout=300)[0]
    _close(got_losses, want_losses)
    for k, v in want_state.items():
        _close(got_state[k], v, rtol=1e-4, atol=1e-5, what=k)


def test_rank_processes_import_this_worktree(dist_run):
    import os

    here = os.path.dirname(os.path.abspath(sbpflow.__file__))
    assert dist_run(2, _sbpflow_dir) == [here, here]


def _sbpflow_dir():
    import os

    return os.path.dirname(os.path.abspath(sbpflow.__file__))


def test_reassigned_parameter_keeps_its_place():
    """Tying a weight (``decoder.weight = embedding.weight``) keeps the parameter's place
    in ``state_dict``/``parameters`` order, as torch.nn.Module does (sbpflow.nn.Module
    change made for the tied BERT decoder, whose bias follows its weight)."""
    orders = []
    for nn in (torch.nn, sbpflow.nn):
        lin, emb = nn.Linear(3, 5), nn.Embedding(5, 3)
        lin.weight = emb.weight
        orders.append(list(lin.state_dict()))
        assert lin.weight is emb.weight
    assert orders[0] == orders[1] == ["weight", "bias"]


def _resnet_per_rank_bn_steps(steps: int):
    """ResNet-18 (the digits-mini width: 20 BatchNorm layers) data parallel on the world
    with per-rank BatchNorm statistics (``sync_stats=False``, as ``sbpflow bench``): per
    step the collectives (kind, axis, bytes) of zero_grad, forward, backward and the SGD
    step; the losses; this rank's local parameters and buffers."""
    spec = models.get("resnet18-digits-mini")
    sbpflow.manual_seed(0)
    m = spec.build()
    for mod in m.modules():
        if isinstance(mod, sbpflow.nn.BatchNorm2d):
            mod.sync_stats = False
    pl = sbpflow.placement.all("cpu")
    parallelize_module(m, pl, spec.plan("dp"))
    opt = sbpflow.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses, steps_colls = [], []
    for step in range(steps):
        x, y = (sbpflow.tensor(t, placement=pl, sbp=split(0)) for t in _images(20 + step))
        with CommRecorder() as rec:
            opt.zero_grad()
            loss = sbpflow.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
        steps_colls.append([(r.kind, r.axis, r.bytes) for r in rec.records])
        losses.append(loss.item())
    state = {k: v.to_local().to_torch().detach().numpy() for k, v in m.state_dict().items()}
    return losses, steps_colls, state


def _torch_replicas(steps: int, world: int = 2):
    """DDP without SyncBatchNorm written out in plain torch on one process: a replica per
    rank on its part of the batch, gradients summed (the global mean's), one SGD step,
    then rank 0's parameters and buffers copied to the other replicas."""
    import copy

    spec = models.get("resnet18-digits-mini")
    torch.manual_seed(0)
    reps = [spec.build_torch()]
    reps += [copy.deepcopy(reps[0]) for _ in range(world - 1)]
    opt = torch.optim.SGD(reps[0].parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _images(20 + step)
        n = len(y) // world
        for r in reps:
            r.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(r(x[i * n:(i + 1) * n]),
                                                     y[i * n:(i + 1) * n])
                   for i, r in enumerate(reps)) / world
        loss.backward()
        for r in reps[1:]:
            for p, q in zip(reps[0].parameters(), r.parameters()):
                p.grad += q.grad
        opt.step()
        for r in reps[1:]:
            r.load_state_dict(reps[0].state_dict())
        losses.append(loss.item())
    return losses, {k: v.numpy() for k, v in reps[0].state_dict().items()}


def test_resnet18_per_rank_batchnorm_one_coalesced_broadcast(dist_run):
    """Per-rank BatchNorm statistics (DDP without SyncBatchNorm): one training step runs one
    gradient all-reduce and ONE broadcast of all 20 layers' running statistics (rank 0's
    win; it was one broadcast per layer, 20), and losses, parameters and buffers equal DDP's
    semantics written out in plain torch, on both ranks."""
    want_losses, want_state = _torch_replicas(2)
    out = dist_run(2, _resnet_per_rank_bn_steps, 2, timeout=300)
    spec = models.get("resnet18-digits-mini")
    stats = [b for n, b in spec.build_torch().named_buffers() if n.endswith(("_mean", "_var"))]
    assert len(stats) == 40
    stat_bytes = sum(b.numel() * b.element_size() for b in stats)
    for losses, steps_colls, state in out:
        _close(losses, want_losses, rtol=1e-5)
        for colls in steps_colls:
            assert [c for c in colls if c[0] == "broadcast"] == [("broadcast", 0, stat_bytes)], \
                colls
            # the gradient bucket (2.8 MB < 25 MiB) and the loss's mean over the batch
            assert sum(c[0] == "all_reduce" for c in colls) == 2 and len(colls) == 3, colls
        for k, v in want_state.items():
            _close(state[k], v, rtol=1e-4, atol=1e-5, what=k)
