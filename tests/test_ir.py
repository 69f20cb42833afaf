"""The logical graph (``graph.lower()``, :mod:`sbpflow.graph.ir`): a small MLP's step under
data and tensor parallelism, its ops, signatures and boxing bytes, built without moving
data; signature choice as a pass over it."""

from __future__ import annotations

import torch

import sbpflow
from sbpflow.distributed import CommRecorder
from sbpflow.graph import ir
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import partial_sum as P
from sbpflow.sbp import split as S


def _mlp_graph(layout: str, acc: int = 1):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pl = sbpflow.placement.all("cpu")
    m = sbpflow.nn.Sequential(sbpflow.nn.Linear(16, 32), sbpflow.nn.ReLU(),
                              sbpflow.nn.Linear(32, 4))
    if layout == "dp":
        m.to_global(pl, B)
    else:
        parallelize_module(m, pl, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = sbpflow.optim.SGD(m.parameters(), lr=0.1)

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.m = m
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(acc)

        def build(self, x, y):
            loss = sbpflow.nn.functional.mse_loss(self.m(x), y)
            loss.backward()
            return loss

    xs = S(0) if layout == "dp" else B
    x = sbpflow.randn(8, 16, placement=pl, sbp=xs)
    y = sbpflow.randn(8, 4, placement=pl, sbp=xs)
    return Step(), m, x, y


def _summary(g: ir.LogicalGraph):
    ops = [(n.op, tuple(n.signature.ins), n.signature.out, n.runner_up is not None,
            [(b.src, b.dst, b.collectives, b.bytes) for b in n.boxings]) for n in g.ops()]
    loose = [(b.phase, b.src, b.dst, b.collectives, b.bytes) for b in g.boxings(implied=False)]
    colls = [(c.phase, c.kind, c.bytes) for c in g.collectives()]
    return ops, loose, colls


def _lower(layout: str):
    step, m, x, y = _mlp_graph(layout)
    before = [(p._local, p._local.clone()) for p in m.parameters()]
    with CommRecorder() as rec:
        g = step.lower(x, y)
    untouched = all(p._local is t and torch.equal(t, c) and p.grad is None
                    for p, (t, c) in zip(m.parameters(), before))
    named = {v.name: (v.kind, v.shape, v.sbp) for v in g.values.values() if v.name}
    text = str(g)
    out = step(x, y)  # the graph still compiles and runs after lowering
    return (_summary(g), named, len(rec.records), untouched, ir.choose_greedy(g),
            "runner-up" in text and "signature" in text, float(out.to_local()))


def test_data_parallel_mlp_logical_graph(dist_run):
    """DP: every op keeps the batch split, nothing is boxed forward; backward is one
    bucketed all-reduce of all the gradients (2704 B: 676 float32 parameters)."""
    for summary, named, comms, untouched, changed, shown, loss in dist_run(2, _lower, "dp"):
        ops, loose, colls = summary
        assert [o[0] for o in ops] == ["nn.linear", "relu", "nn.linear", "nn.mse_loss", "mean"]
        assert ops[0][1:3] == (((S(0),), (B,), (B,)), (S(0),))
        assert ops[2][1:3] == (((S(0),), (B,), (B,)), (S(0),))
        assert ops[4][1:3] == (((S(0),),), (P,))  # the mean of a split batch: partial sums
        assert all(o[3] for o in ops) and all(not o[4] for o in ops)
        assert loose == []
        assert colls == [("backward", "all_reduce", (32 * 16 + 32 + 4 * 32 + 4) * 4)]
        assert named["x"] == ("input", (8, 16), (S(0),))
        assert named["m.0.weight"] == ("param", (32, 16), (B,))
        assert (comms, untouched, changed, shown) == (0, True, 0, True)
        assert loss == loss  # a real number: the graph ran


def test_tensor_parallel_mlp_logical_graph(dist_run):
    """TP (column then row parallel): the first linear's output is split on features, the
    second's a partial sum (its bias boxed B -> P, no bytes); the loss needs it whole, an
    all-reduce of the (8, 4) float32 output: 2 (n-1)/n * 128 B = 128 B on gloo. Backward:
    the dual all-reduce of that gradient and the row-parallel bias's (16 B)."""
    for summary, named, comms, untouched, changed, shown, _ in dist_run(2, _lower, "tp"):
        ops, loose, colls = summary
        assert [o[0] for o in ops] == ["nn.linear", "relu", "nn.linear", "nn.mse_loss", "mean"]
        assert ops[0][1:3] == (((B,), (S(0),), (S(0),)), (S(1),))
        assert ops[1][1:3] == (((S(1),),), (S(1),))
        assert ops[2][1:3] == (((S(1),), (S(1),), (P,)), (P,))
        assert ops[2][4] == [((B,), (P,), ["zero_fill"], 0)]
        assert loose == [("forward", (P,), (B,), ["all_reduce"], 128)]
        assert colls == [("backward", "all_reduce", 8 * 4 * 4), ("backward", "all_reduce", 16)]
        assert named["m.2.weight"] == ("param", (4, 32), (S(1),))
        assert (comms, untouched, changed, shown) == (0, True, 0, True)


def _rechoose():
    """Change a parameter's layout in the graph and rerun the chooser pass over it."""
    step, _, x, y = _mlp_graph("dp")
    g = step.lower(x, y)
    w = next(v for v in g.values.values() if v.name == "m.0.weight")
    w.sbp = (S(0),)  # as if the weight were stored split over its output features
    changed = ir.choose_greedy(g)
    first = g.ops()[0]
    return changed, first.in_sbps, first.signature.ins, first.signature.out


def test_choose_greedy_is_a_pass_over_the_graph(dist_run):
    """The pass takes each op's inputs' layouts from the graph. With the first weight laid
    out S(0) (over its 32 output features), gathering the (8, 16) float32 batch (256 B
    each rank sends) is cheaper than gathering the (32, 16) weight (1 KB): the linear
    turns column-parallel, its output split on features, and the ops after it follow."""
    for changed, in_sbps, ins, out in dist_run(2, _rechoose):
        assert in_sbps == ((S(0),), (S(0),), (B,))
        assert (ins, out) == (((B,), (S(0),), (S(0),)), (S(1),))
        assert changed >= 3  # the linear, the ReLU after it and the second linear


def _micro_batch_shapes():
    step, _, x, y = _mlp_graph("dp", acc=2)
    g = step.lower(x, y)
    return {v.name: v.shape for v in g.values.values() if v.kind == "input"}


def test_lowering_traces_one_micro_batch(dist_run):
    for shapes in dist_run(2, _micro_batch_shapes):
        assert shapes == {"x": (4, 16), "y": (4, 4)}


def _lower_zero(stage: int, called: bool):
    step, m, x, y = _mlp_graph("dp")
    step.config.enable_zero(True, stage=stage, shard_min_size=1)
    if called:
        step(x, y)
    g = step.lower(x, y)
    named = {v.name: v.sbp for v in g.values.values() if v.kind == "param"}
    gathers = [(b.src, b.dst, b.collectives) for b in g.boxings("forward", implied=False)]
    first = g.ops()[0].signature
    return named, gathers, (first.ins, first.out), [p.sbp for p in m.parameters()]


def test_lowered_zero_graph_shows_the_split_parameters_and_their_gathers(dist_run):
    """ZeRO in the logical graph, before and after the first call: the parameters are
    ``S(0)`` and gathered (stages 1/2: once for the step; stage 3: before the module),
    so the linears run data parallel on the gathered weights; lowering before the first
    call changes nothing of the model."""
    for stage in (2, 3):
        for called in (False, True):
            for named, gathers, first, real in dist_run(2, _lower_zero, stage, called):
                assert named["m.0.weight"] == (S(0),) and named["m.2.bias"] == (S(0),)
                assert gathers.count(((S(0),), (B,), ["all_gather"])) >= 4, gathers
                assert first == (((S(0),), (B,), (B,)), (S(0),)), first
                assert real == ([(S(0),)] * 4 if called else [(B,)] * 4)


def _memory_record(variant: str):
    """The saved-tensor and gathered-parameter record of a 2-rank data-parallel MLP step
    (16 samples per rank, hidden 64: an activation is 4 KiB), plain or under ZeRO-1,
    ZeRO-3 or activation checkpointing of the middle block."""
    from sbpflow.graph import GraphModule
    from sbpflow.planner.predict import predict_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = sbpflow.nn
    pl = sbpflow.placement.all("cpu")
    m = nn.Sequential(nn.Linear(16, 64), nn.Sequential(nn.GELU(), nn.Linear(64, 64), nn.GELU()),
                      nn.Linear(64, 8))
    m.to_global(pl, B)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.m = m
            self.add_optimizer(sbpflow.optim.AdamW(m.parameters(), lr=1e-3))
            if variant.startswith("zero"):
                self.config.enable_zero(True, stage=int(variant[-1]), shard_min_size=1)
            if variant == "ckpt":
                self.m[1].to(GraphModule).activation_checkpointing = True

        def build(self, x, y):
            loss = nn.functional.mse_loss(self.m(x), y)
            loss.backward()
            return loss

    x = sbpflow.randn(32, 16, placement=pl, sbp=S(0))
    y = sbpflow.randn(32, 8, placement=pl, sbp=S(0))
    g = Step().lower(x, y)
    regathers = sorted(g.values[b.output].shape for b in g.boxings("backward")
                       if b.collectives == ["all_gather"])
    return g.saved_bytes, g.gathered_bytes, regathers, predict_memory(g, 2.0)


def test_memory_record_sees_through_zero_and_checkpointing(dist_run):
    """What the forward keeps for backward is recorded whichever transform's own
    saved-tensor hooks run: ZeRO-1's gathered copies count as gathered parameters (all,
    held for the step), not activations; ZeRO-3's saves are the plain step's (its
    recipes re-gather only the weights backward reads: the second and third Linear's, the
    first's input needs no gradient), its gathered term the largest module's; a
    checkpointed block keeps its input only (two 4 KiB activations fewer than the plain
    step, whose block saved three)."""
    plain, zero1, zero3, ckpt = (dist_run(2, _memory_record, v)[0]
                                 for v in ("plain", "zero1", "zero3", "ckpt"))
    act = 16 * 64 * 4
    full = 4 * ((16 * 64 + 64) + (64 * 64 + 64) + (64 * 8 + 8))
    assert plain[0] >= 4 * act and plain[1] == 0 and plain[2] == []
    assert zero1[:2] == (plain[0], full), zero1
    assert zero1[3]["gathered"] == full and zero1[3]["parameters"] == full // 2
    assert zero3[:3] == (plain[0], 4 * (64 * 64 + 64), [(8, 64), (64, 64)]), zero3
    assert ckpt[0] == plain[0] - 2 * act, (ckpt, plain)
    assert ckpt[3]["activations"] < plain[3]["activations"]


def _attention_saves():
    """What the logical graph of one attention step on one CPU rank records as saved
    (batch 2, 4 heads, 256 tokens, head size 8) and what torch's CPU kernel saves."""
    torch.set_num_threads(1)
    pl = sbpflow.placement.all("cpu")
    nn = sbpflow.nn

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).split(8, dim=-1)
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    m = Attend()
    m.to_global(pl, B)

    class Step(nn.Graph):
        def __init__(self):
            super().__init__()
            self.m = m

        def build(self, x):
            loss = self.m(x).square().mean()
            loss.backward()
            return loss

    x = sbpflow.randn(2, 4, 256, 8, placement=pl, sbp=B)
    saved = []
    t = torch.randn(2, 4, 256, 24, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda a: saved.append(a) or a, lambda a: a):
        torch.nn.functional.scaled_dot_product_attention(*t.split(8, dim=-1), is_causal=True)
    real = sum(a.numel() * a.element_size() for a in
               {id(a._base if a._base is not None else a): a for a in saved}.values())
    return Step().lower(x).saved_bytes, real


def test_planned_attention_saves_what_the_cpu_kernel_saves(dist_run):
    """On meta tensors torch's attention takes the math path, which saves the 256 x 256
    attention probabilities per head (2 MiB here); the logical graph of a CPU step calls
    the kernel torch chooses on CPU (flash attention), which saves the output and its
    log-sum-exp: the record is the CPU kernel's saves plus the Linear's and the loss's."""
    planned, real = dist_run(1, _attention_saves)[0]
    probs = 2 * 4 * 256 * 256 * 4
    assert planned < probs / 2, (planned, real)
    assert real <= planned <= real + 2 * (2 * 4 * 256 * 24 * 4), (planned, real)


def _lower_pipeline():
    from sbpflow.graph import GraphError

    torch.set_num_threads(1)
    pls = [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])]
    m = sbpflow.nn.Sequential(sbpflow.nn.Linear(4, 4), sbpflow.nn.Linear(4, 2))
    m.to_global(pls[0], B)
    from sbpflow.graph import GraphModule

    m[0].to(GraphModule).set_stage(0, pls[0])
    m[1].to(GraphModule).set_stage(1, pls[1])

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.m = m

        def build(self, x):
            return self.m(x)

    try:
        Step().lower(sbpflow.randn(2, 4, placement=pls[0], sbp=B))
    except GraphError as e:
        return str(e)
    return None


def test_lowering_a_pipeline_is_refused_with_a_clear_error(dist_run):
    for msg in dist_run(2, _lower_pipeline):
        assert msg is not None and "pipeline" in msg and "set_stage" in msg


def test_each_op_names_the_module_that_ran_it():
    """``OpNode.module``: the innermost module whose forward ran the op, as the graph
    names it (gpt-mini: the token embedding first, each block's ops under its block, the
    loss in the model's own forward); the pipeline predictor gives ops to stages by it."""
    import sbpflow
    from sbpflow.planner import here

    lg, _ = here._lower(sbpflow.models.get("gpt-mini"), "dp", 1, 2, 16, 32)
    ops = lg.ops("forward")
    assert (ops[0].op, ops[0].module) == ("nn.embedding", "model.transformer.wte")
    blocks = [int(n.module.split(".")[3]) for n in ops
              if n.module.startswith("model.transformer.h.")]
    assert blocks == sorted(blocks) and set(blocks) == {0, 1, 2, 3}
    assert any(n.module == "model.transformer.h.2.mlp.c_fc" and n.op == "nn.linear"
               for n in ops)
    assert ops[-1].module == "model" and "model.lm_head" in {n.module for n in ops}
    assert all(n.module == "" for n in lg.ops("backward"))  # no recomputation here


def test_planning_a_cuda_step_saves_attention_as_the_fused_kernels_do(monkeypatch):
    """Planning a CUDA step on meta stand-ins, attention is recorded as the kernel torch
    takes on a GPU saves it (flash or memory-efficient: the output and its log-sum-exp),
    not as the math path (L x S probabilities: gpt2 at 8 x 1024 tokens was predicted
    1.64x its measured peak on an H200); the rules without a GPU here are torch's."""
    import torch

    from sbpflow.ops import nn as ops_nn

    monkeypatch.setattr(ops_nn, "_planned_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def saved_by(dtype, head, mask=None):
        q = torch.empty(2, 3, 128, head, dtype=dtype, device="meta", requires_grad=True)
        shapes = []  # each saved tensor's shape, a view's as its storage's (the mask's)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: shapes.append(tuple((t._base if t._base is not None else t).shape))
                or t, lambda t: t):
            out = ops_nn._sdpa(q, q, q, attn_mask=mask, is_causal=mask is None)
        assert tuple(out.shape) == (2, 3, 128, head)
        return shapes

    choice = ops_nn._cuda_sdpa_choice
    q16 = torch.empty(2, 3, 128, 64, dtype=torch.bfloat16, device="meta")
    q32 = q16.float()
    mask = torch.empty(128, 128, dtype=torch.bool, device="meta")
    assert choice(q16, q16, q16, None, 0.0, True, None) == 1  # flash
    assert choice(q32, q32, q32, None, 0.0, True, None) == 2  # memory-efficient
    assert choice(q16, q16, q16, mask, 0.0, False, None) == 2
    q60 = torch.empty(2, 3, 128, 60, dtype=torch.bfloat16, device="meta")
    assert choice(q60, q60, q60, None, 0.0, True, None) == 0  # math
    for dtype, m in ((torch.bfloat16, None), (torch.float32, None),
                     (torch.bfloat16, mask)):
        shapes = saved_by(dtype, 64, m)
        assert (2, 3, 128) in shapes and (2, 3, 128, 128) not in shapes, shapes
    assert (2, 3, 128, 128) in saved_by(torch.bfloat16, 60)  # the math path's probabilities
