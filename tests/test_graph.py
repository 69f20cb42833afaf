"""nn.Graph: a compiled step gives the eager step's losses and parameters (and so the
one-process PyTorch run's), in every layout and with each pass; bad use raises a clear
error; the passes do what they say on the program. The default suite runs DP, ZeRO-3,
gradient accumulation and checkpointing; TP, DP x TP, ZeRO 1/2, AMP and the LR scheduler
run with ``-m exhaustive`` (each case costs a trace of the whole step).

The model is the nanoGPT-style file (2 layers, width 64) as in test_training.py; eager
sbpflow is the oracle for the graph (1e-5 relative on losses, parameters within 1e-5 of
their scale), plain torch on one process for both (test_training.py and here for DP).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from _models import GPT_TP_PLAN, load_gpt, world_placement
from test_training import _torch_curve

import sbpflow
from sbpflow.graph import GraphError, GraphModule, GraphTraceError, passes
from sbpflow.nn.parallel import parallelize_module
from sbpflow.sbp import broadcast as B
from sbpflow.sbp import split

STEPS = 5


def _model(dropout: float = 0.0):
    sbpflow.manual_seed(0)
    gpt = load_gpt("sbpflow")
    return gpt.GPT(gpt.GPTConfig(block_size=16, vocab_size=48, n_layer=2, n_head=4,
                                 n_embd=64, dropout=dropout))


def _batches(n=STEPS, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 48, (batch, 16), generator=g),
             torch.randint(0, 48, (batch, 16), generator=g)) for _ in range(n)]


_DATA = {"dp": split(0), "tp": B, "dp_tp": (split(0), B), "one": B}


def _setup(layout: str, dropout: float = 0.0):
    m = _model(dropout)
    pl = world_placement("dp" if layout == "one" else layout)
    parallelize_module(m, pl, GPT_TP_PLAN if layout in ("tp", "dp_tp") else {}, tp_axis=-1)
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    return m, pl, opt


def _lm_loss(m, x, y):
    """The language models' loss: ``model(x, y) -> (logits, loss)``."""
    return m(x, y)[1]


class _Train(sbpflow.nn.Graph):
    def __init__(self, m, opt, pl, sch=None, loss=_lm_loss):
        super().__init__()
        self.model = m
        self.pl = pl
        self.loss = loss  # (model, x, y) -> the loss
        self.add_optimizer(opt, lr_sch=sch)

    def build(self, x, y):
        with sbpflow.default_placement(self.pl):
            loss = self.loss(self.model, x, y)
        loss.backward()
        return loss


class GPTCase:
    """What :func:`_run` trains: the model in a layout with its optimizer (``setup``), the
    step's batches, the loss, the blocks activation checkpointing marks. This one is the
    GPT of this file; tests/test_graph_models.py defines BERT's and ResNet's."""

    def setup(self, layout: str, dropout: float = 0.0):
        return _setup(layout, dropout)

    def batches(self):
        return _batches()

    loss = staticmethod(_lm_loss)

    def blocks(self, m):
        return m.transformer.h


GPT = GPTCase()


def _params(m) -> dict:
    return {k: v.numpy() for k, v in m.state_dict().items()}


def _run(layout: str, mode: str, opts: dict | None = None, case=GPT):
    """Train ``case`` (default: this file's GPT, STEPS steps) on its batches; ``mode``
    "eager" or "graph"; ``opts``: acc, zero, ckpt, amp ("bf16"/"fp16"), dropout, sched.
    Returns (losses, state_dict as numpy: parameters and buffers, print(graph))."""
    torch.set_num_threads(1)
    o = opts or {}
    acc, zero, ckpt, amp = o.get("acc", 1), o.get("zero", 0), o.get("ckpt"), o.get("amp")
    dropout, sched = o.get("dropout", 0.0), o.get("sched", False)
    m, pl, opt = case.setup(layout, dropout)
    sch = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if sched else None
    data = _DATA[layout]
    scaler = sbpflow.amp.GradScaler("cpu", init_scale=2.0 ** 10) if amp == "fp16" else None
    g = None
    if mode == "graph":
        g = _Train(m, opt, pl, sch, case.loss)
        g.config.set_gradient_accumulation_steps(acc)
        if zero:
            g.config.enable_zero(True, stage=zero, shard_min_size=1)
        if amp:
            g.config.enable_amp(True, dtype=torch.float16 if amp == "fp16" else torch.bfloat16)
        if scaler is not None:
            g.set_grad_scaler(scaler)
        if o.get("compile"):
            g.config.enable_compile(True)
        if ckpt:
            for blk in case.blocks(m):
                blk.to(GraphModule).activation_checkpointing = True
    losses = []
    for x, y in case.batches():
        xs = sbpflow.tensor(x, placement=pl, sbp=data)
        ys = sbpflow.tensor(y, placement=pl, sbp=data)
        if g is not None:
            loss = g(xs, ys)
        elif acc > 1:  # eager gradient accumulation over the graph's micro-batches
            loss = _eager_accumulate(m, opt, pl, xs, ys, acc, case.loss)
        else:
            opt.zero_grad()
            with sbpflow.autocast("cpu", dtype=torch.float16 if amp == "fp16" else
                                  torch.bfloat16, enabled=amp is not None), \
                    sbpflow.default_placement(pl):
                loss = case.loss(m, xs, ys)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if sch is not None:
                sch.step()
        losses.append(loss.mean().item())  # a graph packs one loss per micro-batch
    text = str(g) if g is not None else ""
    return losses, _params(m), text


def _eager_accumulate(m, opt, pl, xs, ys, acc: int, loss_fn=_lm_loss):
    """Eager gradient accumulation over the micro-batches nn.Graph forms (each rank's
    shard cut into ``acc`` parts, no data moved), loss scaled by ``1/acc``."""
    opt.zero_grad()
    total = 0.0
    for k, (args, _) in enumerate(passes.micro_batches((xs, ys), {}, acc)):
        ctx = sbpflow.no_sync() if k < acc - 1 else contextlib.nullcontext()
        with ctx, sbpflow.default_placement(pl):
            loss = loss_fn(m, *args)
            (loss * (1.0 / acc)).backward()
        total += loss.item() / acc
    opt.step()
    return torch.tensor(total)


def _close(got, want, rtol=1e-5):
    """Losses within ``rtol``; each parameter within ``rtol`` of its largest entry. The
    attention key biases are left out: their gradient is zero in exact arithmetic (softmax
    ignores a shift of a query's scores), so AdamW turns rounding noise into lr-sized
    steps of either sign in any two runs that round differently."""
    lg, pg, _ = got
    lw, pw, _ = want
    for i, (a, b) in enumerate(zip(lg, lw)):
        assert abs(a - b) <= rtol * abs(b), (i, a, b)
    for k in pw:
        if k.endswith("attn.k.bias"):
            continue
        scale = max(float(np.abs(pw[k]).max()), 1e-3)
        assert float(np.abs(pg[k] - pw[k]).max()) <= rtol * scale, k


# ====================================================================== equivalence


@pytest.mark.parametrize("layout", ["dp", pytest.param("tp", marks=pytest.mark.exhaustive),
                                    pytest.param("dp_tp", marks=pytest.mark.exhaustive)])
def test_graph_gives_the_eager_losses_and_parameters(dist_run, layout):
    n = 4 if layout == "dp_tp" else 2
    eager = dist_run(n, _run, layout, "eager", timeout=600)[0]
    graph = dist_run(n, _run, layout, "graph", timeout=600)[0]
    _close(graph, eager)
    want = _torch_curve("gpt")[:STEPS]  # test_training's oracle: the same model and data
    for a, b in zip(graph[0], want):
        assert abs(a - b) <= 1e-4 * abs(b)
    text = graph[2]
    assert "logical graph" in text and "per rank: parameters" in text
    for section in ("-- forward --", "-- backward", "-- optimizer update"):
        assert section in text, section
    # DP: the gradient all-reduce is listed in the backward section
    assert "all_reduce" in text.split("-- backward")[1].split("-- optimizer update")[0]
    if layout == "tp":  # the Megatron all-reduces are in the program and printed
        assert "all_reduce axis 0" in text


def test_gradient_accumulation_gives_the_whole_batch_step(dist_run):
    """4 micro-batches inside the graph, one update: the eager accumulation loop's step
    (same micro-batches, same sums), and the whole batch's losses (the summation order
    differs there: losses within 1e-5; AdamW amplifies rounding in the parameters)."""
    whole = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    eager = dist_run(2, _run, "dp", "eager", dict(acc=4), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(acc=4), timeout=600)[0]
    _close(graph, eager)
    for a, b in zip(graph[0], whole[0]):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.exhaustive),
                                   pytest.param(2, marks=pytest.mark.exhaustive), 3])
def test_zero_stages_give_the_data_parallel_step(dist_run, stage):
    eager = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(zero=stage), timeout=600)[0]
    _close(graph, eager)


def _zero3_program(in_flight: int):
    """One traced ZeRO-3 step under prefetch depth ``in_flight``: (all-gathers in the
    program, ZeRO-3 parameters, the program's peak live bytes, the most all-gathers in
    flight at once)."""
    torch.set_num_threads(1)
    depth, passes.GATHERS_IN_FLIGHT = passes.GATHERS_IN_FLIGHT, in_flight
    try:
        return _zero3_program_at(in_flight)
    finally:  # this process runs later tests: the depth was left at 10 ** 6 for them
        passes.GATHERS_IN_FLIGHT = depth


def _zero3_program_at(in_flight: int):
    m, pl, opt = _setup("dp")
    g = _Train(m, opt, pl)
    g.config.enable_zero(True, stage=3, shard_min_size=1)
    x, y = _batches(1)[0]
    g(sbpflow.tensor(x, placement=pl, sbp=split(0)), sbpflow.tensor(y, placement=pl,
                                                                      sbp=split(0)))
    gm = next(iter(g._programs.values())).gm
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    flying, most, n = set(), 0, 0
    for node in gm.graph.nodes:
        if node.target is gather:
            flying.add(node)
            n += 1
            most = max(most, len(flying))
        elif node.target is torch.ops._c10d_functional.wait_tensor.default:
            flying.discard(node.args[0])
    from sbpflow.graph import show
    return n, len(g._zero3), show.peak_live_bytes(gm), most


def test_zero3_gathers_in_backward_again_and_prefetches_a_bounded_depth(dist_run):
    """Stage 3 frees a gathered parameter after its module: backward all-gathers what
    autograd needs again (more gathers than parameters), at most ``GATHERS_IN_FLIGHT``
    gathers are in flight, and the program's peak live bytes are below those of the same
    program with every gather started at the top."""
    n, params, peak, most = dist_run(2, _zero3_program, 2)[0]
    _, _, peak_unbounded, most_unbounded = dist_run(2, _zero3_program, 10 ** 6)[0]
    assert n > params, (n, params)
    assert most <= 2 < most_unbounded, (most, most_unbounded)
    assert peak < peak_unbounded, (peak, peak_unbounded)


def test_activation_checkpointing_recomputes_with_the_forward_dropout_masks(dist_run):
    """Dropout 0.1: the recomputed blocks draw the forward's masks (the generator state is
    replayed), so the losses and parameters are the eager ones."""
    eager = dist_run(2, _run, "tp", "eager", dict(dropout=0.1), timeout=600)[0]
    graph = dist_run(2, _run, "tp", "graph", dict(ckpt=True, dropout=0.1), timeout=600)[0]
    _close(graph, eager)


@pytest.mark.exhaustive
def test_amp_bf16_graph_follows_eager_autocast(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(amp="bf16"), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(amp="bf16"), timeout=600)[0]
    _close(graph, eager, rtol=2e-2)


@pytest.mark.exhaustive
def test_amp_fp16_with_loss_scaling_follows_eager(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(amp="fp16"), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(amp="fp16"), timeout=600)[0]
    _close(graph, eager, rtol=2e-2)


@pytest.mark.exhaustive
def _compiled_run(world: int, fn, *args) -> list:
    """``fn(*args)`` on fresh ranks whose collective timeout (600 s, the default) exceeds
    inductor's compile time: the first call of a compiled program compiles each piece
    between its collectives, and on a loaded 2-core machine one rank's piece took longer
    than the pool's 20 s, timing out its peer's collective (an exhaustive run, zero3)."""
    from _pool import run_isolated

    outcomes = run_isolated(world, fn, *args, timeout=1800, env={"SBPFLOW_TIMEOUT": "600"})
    for o in outcomes:
        assert o.status == "ok", o.describe()
    return [o.value for o in outcomes]


def _slow_first_compiled_call():
    """Rank 0's compiled program spends 6 s before running (as a long inductor compile
    of a piece would); the collective timeout is 2 s."""
    import time

    from sbpflow.graph import graph as graph_mod

    torch.set_num_threads(1)

    def slow_compile(gm, post_grad):
        def run(*args):
            if sbpflow.distributed.get_rank() == 0:
                time.sleep(6)
            return gm(*args)
        return run

    saved = graph_mod.passes.compile_program
    graph_mod.passes.compile_program = slow_compile
    try:
        m, pl, opt = _setup("dp")
        g = _Train(m, opt, pl)
        g.config.enable_compile(True)
        for x, y in _batches()[:2]:  # the first call traces (runs the step itself)
            g(sbpflow.tensor(x, placement=pl, sbp=split(0)),
              sbpflow.tensor(y, placement=pl, sbp=split(0)))
    finally:
        graph_mod.passes.compile_program = saved


@pytest.mark.exhaustive
def test_a_timeout_in_the_first_compiled_call_says_why():
    """A peer that compiles longer than SBPFLOW_TIMEOUT times out this rank's collective
    in the first call of a compiled program; the error says so and names the fix."""
    from _pool import run_isolated

    outcomes = run_isolated(2, _slow_first_compiled_call, timeout=120,
                            env={"SBPFLOW_TIMEOUT": "2"})
    o = outcomes[1]
    assert o.status == "raised", o.describe()
    assert "first call of a compiled program" in o.error and "SBPFLOW_TIMEOUT, 2s" in \
        o.error, o.error


@pytest.mark.exhaustive  # torch.compile: ~15 s; the default suite's budget (10 min) is full
def test_compiled_graph_follows_eager(dist_run):
    """torch.compile of the program (inductor fuses and reorders float sums: 1e-4)."""
    eager = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    graph = _compiled_run(2, _run, "dp", "graph", dict(compile=True))[0]
    _close(graph, eager, rtol=1e-4)


@pytest.mark.exhaustive
def test_lr_scheduler_steps_with_the_graph(dist_run):
    eager = dist_run(2, _run, "dp", "eager", dict(sched=True), timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(sched=True), timeout=600)[0]
    _close(graph, eager)


# ====================================================================== bad use


class _Reads(sbpflow.nn.Graph):
    def __init__(self, m, pl, how):
        super().__init__()
        self.model, self.pl, self.how = m, pl, how

    def build(self, x, y):
        with sbpflow.default_placement(self.pl):
            loss = self.model(x, y)[1]
        if self.how == "item":
            print(loss.item())
        elif self.how == "if":
            if loss > 0:
                loss = loss * 2
        elif self.how == "numpy":
            loss.numpy()
        return loss


class _Eval(sbpflow.nn.Graph):
    def __init__(self, m, pl):
        super().__init__()
        self.model, self.pl = m, pl

    def build(self, x, y):
        with sbpflow.default_placement(self.pl):
            return self.model(x, y)[1]


def _bad_use_body():
    """Each misuse, caught on every rank; returns the messages."""
    torch.set_num_threads(1)
    m, pl, opt = _setup("dp")
    x, y = _batches(1)[0]
    xs, ys = (sbpflow.tensor(t, placement=pl, sbp=split(0)) for t in (x, y))
    out = {}
    for how in ("item", "if", "numpy"):
        with pytest.raises(GraphTraceError) as e:
            _Reads(m, pl, how)(xs, ys)
        out[how] = str(e.value)
    g = _Train(m, opt, pl)
    one = sbpflow.placement("cpu", [0])
    with pytest.raises(GraphError) as e:
        g(xs.to_global(one, B), ys.to_global(one, B))
    out["placement"] = str(e.value)
    with pytest.raises(GraphError) as e:
        g(sbpflow.from_torch(x), sbpflow.from_torch(y))
    out["local"] = str(e.value)
    # an evaluation graph (no optimizer, no backward) gives the eager forward's loss
    ev = _Eval(m, pl)
    with sbpflow.no_grad(), sbpflow.default_placement(pl):
        want = m(xs, ys)[1].item()
    out["eval"] = (ev(xs, ys).item(), ev(xs, ys).item(), want)
    # a new signature compiles again, the same one is cached
    g(xs, ys)
    g(xs, ys)
    small = [sbpflow.tensor(t[:4], placement=pl, sbp=split(0)) for t in (x, y)]
    g(*small)
    out["compiles"] = g.compiles
    return out


def test_bad_use_raises_naming_the_cause(dist_run):
    out = dist_run(2, _bad_use_body, timeout=600)[0]
    for how, what in (("item", "item()"), ("if", "bool()"), ("numpy", "numpy()")):
        assert what in out[how] and "test_graph.py:" in out[how], out[how]
        assert "read it outside the graph" in out[how]
    assert "lives on" in out["placement"] and "to_global" in out["placement"]
    assert "local tensor" in out["local"]
    assert out["compiles"] == 2
    traced, replayed, eager = out["eval"]
    assert abs(traced - eager) <= 1e-6 * eager and abs(replayed - eager) <= 1e-6 * eager


def _diverged_signature_body():
    rank = sbpflow.distributed.get_rank()
    m, pl, opt = _setup("dp")
    n = 4 if rank == 0 else 6  # the ranks disagree on the global batch
    x = sbpflow.from_torch(torch.zeros(n, 16, dtype=torch.long)).to_global(
        pl, split(0), check_meta=False)
    return _Train(m, opt, pl)(x, x)


def _diverged_mode_body():
    """Found by the fresh-user trial: rank 1 puts the model in eval mode before the
    second call; the ranks' signatures agree, their programs do not."""
    m, pl, opt = _setup("dp")
    g = _Train(m, opt, pl)
    x = sbpflow.tensor(torch.zeros(4, 16, dtype=torch.long), placement=pl, sbp=split(0))
    g(x, x)
    if sbpflow.distributed.get_rank() == 1:
        m.eval()
    return g(x, x)


def test_ranks_calling_with_different_shapes_raise_on_every_rank():
    """Ranks calling with different batch shapes, or with the model in different train/
    eval modes, raise CollectiveMismatchError at once (not after the timeout)."""
    from _pool import run_isolated

    env = {"SBPFLOW_TIMEOUT": "40", "SBPFLOW_CHECK": "fast"}
    outcomes = run_isolated(2, _diverged_signature_body, timeout=90, env=env)
    for o in outcomes:
        assert o.status == "raised", o.describe()
        msg = str(o.exception)
        assert isinstance(o.exception, sbpflow.distributed.CollectiveMismatchError), msg
        assert "(8, 16)" in msg and "(12, 16)" in msg and "nn.Graph _Train" in msg, msg
        assert o.elapsed < 30, o.describe()
    for o in run_isolated(2, _diverged_mode_body, timeout=90, env=env):
        assert o.status == "raised", o.describe()
        msg = str(o.exception)
        assert isinstance(o.exception, sbpflow.distributed.CollectiveMismatchError), msg
        assert "modules training / 0 in eval" in msg and " in eval" in msg, msg
        assert o.elapsed < 30, o.describe()


def test_a_module_in_two_stages_is_refused():
    lin = sbpflow.nn.Linear(2, 2)
    lin.to(GraphModule).set_stage(0)
    assert lin.to(GraphModule) is lin.to(GraphModule)
    with pytest.raises(ValueError, match="already in stage 0"):
        lin.to(GraphModule).set_stage(1)


def test_config_rejects_bad_values():
    cfg = sbpflow.nn.Graph().config
    with pytest.raises(ValueError, match="integer >= 1"):
        cfg.set_gradient_accumulation_steps(0)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        cfg.enable_zero(True, stage=4)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        cfg.enable_amp(True, dtype=torch.float32)
    with pytest.raises(GraphError, match="an sbpflow.optim optimizer"):
        sbpflow.nn.Graph().add_optimizer(torch.optim.SGD([torch.zeros(1)], lr=0.1))
    lin = sbpflow.nn.Linear(2, 2)
    with pytest.raises(GraphError, match="SGD with momentum and dampening"):
        sbpflow.nn.Graph().add_optimizer(sbpflow.optim.SGD(lin.parameters(), lr=0.1,
                                                           momentum=0.9, dampening=0.1))


# ====================================================================== passes alone


def _program(order):
    """A hand-built program: x -> relu -> all_reduce start/wait, an independent mm, add."""
    C = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    nodes = {"x": x}
    for name, target, args in order:
        nodes[name] = g.create_node("call_function", target, tuple(
            nodes[a] if isinstance(a, str) and a in nodes else a for a in args), name=name)
    g.output(nodes[order[-1][0]])
    del C
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_overlap_moves_waits_to_first_use_and_keeps_collective_order():
    C = torch.ops._c10d_functional
    aten = torch.ops.aten
    gm = _program([
        ("a", aten.relu.default, ("x",)),
        ("r1", C.all_reduce.default, ("a", "sum", "0")),
        ("w1", C.wait_tensor.default, ("r1",)),
        ("b", aten.mm.default, ("x", "x")),
        ("c", aten.mm.default, ("b", "b")),
        ("r2", C.all_reduce.default, ("x", "sum", "0")),
        ("w2", C.wait_tensor.default, ("r2",)),
        ("d", aten.add.Tensor, ("w1", "c")),
        ("e", aten.add.Tensor, ("d", "w2")),
    ])
    passes.overlap(gm)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert [n for n in order if n.startswith("r")] == ["r1", "r2"]  # collective order kept
    # the second all-reduce (input x) starts right after the first, before the mms
    assert order.index("r2") < order.index("b")
    # each wait sits just before its first user, after the independent compute
    assert order.index("w1") == order.index("d") - 1
    assert order.index("c") < order.index("w1")


def test_overlap_moves_nothing_across_an_in_place_update():
    C = torch.ops._c10d_functional
    aten = torch.ops.aten
    gm = _program([
        ("a", aten.relu.default, ("x",)),
        ("u", aten.add_.Tensor, ("a", "x")),
        ("r1", C.all_reduce.default, ("a", "sum", "0")),
        ("w1", C.wait_tensor.default, ("r1",)),
        ("v", aten.mul_.Tensor, ("x", 2.0)),
        ("d", aten.add.Tensor, ("w1", "x")),
    ])
    passes.overlap(gm)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index("u") < order.index("r1")
    assert order.index("w1") < order.index("v")


def test_dead_code_keeps_updates_collectives_and_rng():
    C = torch.ops._c10d_functional
    aten = torch.ops.aten
    gm = _program([
        ("dead", aten.relu.default, ("x",)),
        ("u", aten.add_.Tensor, ("x", 1.0)),
        ("r", C.all_reduce.default, ("x", "sum", "0")),
        ("s", torch.ops.sbpflow.rng_get.default, ("cpu",)),
        ("out", aten.neg.default, ("x",)),
    ])
    passes.dead_code(gm)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert "dead" not in names
    assert {"u", "r", "s", "out"} <= set(names)


def test_strip_removes_detach():
    gm = _program([("d", torch.ops.aten.detach.default, ("x",)),
                   ("n", torch.ops.aten.neg.default, ("d",))])
    passes.strip(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == \
        [torch.ops.aten.neg.default]


def test_micro_batches_cut_each_shard_and_refuse_uneven_cuts():
    x = sbpflow.from_torch(torch.arange(12).reshape(6, 2))
    parts = passes.micro_batches((x, 3), {"y": x}, 3)
    assert [p[0][0].to_torch()[:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(p[0][1] == 3 for p in parts) and parts[1][1]["y"].shape == (2, 2)
    with pytest.raises(ValueError, match="cannot be cut into 4 equal parts"):
        passes.micro_batches((x,), {}, 4)


def test_overlap_runs_independent_work_while_a_collective_is_in_flight():
    """A weight-gradient-like matmul that precedes the all-reduce of another value but
    does not feed it moves after the all-reduce's start, before its wait."""
    C = torch.ops._c10d_functional
    aten = torch.ops.aten
    gm = _program([
        ("g", aten.relu.default, ("x",)),         # the input gradient
        ("wg", aten.mm.default, ("x", "x")),      # a weight gradient, independent
        ("r", C.all_reduce.default, ("g", "sum", "0")),
        ("w", C.wait_tensor.default, ("r",)),
        ("nxt", aten.mm.default, ("w", "x")),     # the next layer's backward
        ("out", aten.add.Tensor, ("nxt", "wg")),
    ])
    passes.overlap(gm)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order.index("g") < order.index("r") < order.index("wg") < order.index("w")
    assert order.index("w") < order.index("nxt")


class _Local(sbpflow.nn.Graph):
    def __init__(self, m, opt, sch):
        super().__init__()
        self.model = m
        self.add_optimizer(opt, lr_sch=sch)

    def build(self, x, y):
        loss = sbpflow.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _local_steps(mode: str, fused, ckpt: bool = False, steps: int = 4):
    """A local MLP with BatchNorm trained ``steps`` AdamW steps eagerly or as a graph
    (``ckpt``: its first block checkpointed); its state dict and the program's ops."""
    sbpflow.manual_seed(0)
    nn = sbpflow.nn
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.GELU()),
                      nn.Linear(8, 2))
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    gen = torch.Generator().manual_seed(0)
    data = [(sbpflow.from_torch(torch.randn(6, 4, generator=gen)),
             sbpflow.from_torch(torch.randn(6, 2, generator=gen))) for _ in range(steps)]
    g = _Local(m, opt, None) if mode == "graph" else None
    if ckpt:
        m[0].to(GraphModule).activation_checkpointing = True
    for x, y in data:
        if g is not None:
            g(x, y)
        else:
            opt.zero_grad()
            sbpflow.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    ops = {str(n.target) for p in (g._programs.values() if g else ()) for n in p.gm.graph.nodes}
    return {k: v.numpy().copy() for k, v in m.state_dict().items()}, ops


@pytest.mark.parametrize("fused", [None, True])
def test_update_runs_the_kernels_of_the_eager_step(fused):
    """The graph's update is the eager step's arithmetic, bit for bit: torch's fused
    kernel for a fused=True optimizer, else the optimizer's own step (torch's for-loop
    kernels, which round differently from the fused one) as one program op."""
    eager, _ = _local_steps("eager", fused)
    graph, ops = _local_steps("graph", fused)
    for k in eager:
        assert np.array_equal(graph[k], eager[k]), k
    assert ("sbpflow.optimizer_step.default" in ops) == (not fused), ops
    assert any("_fused_adamw_" in op for op in ops) == bool(fused), ops


def test_checkpointed_batchnorm_updates_its_statistics_once():
    """A checkpointed block's recomputation in backward leaves its buffers as the forward
    left them: BatchNorm's running statistics and batch count as in eager mode (they were
    updated twice per step)."""
    eager, _ = _local_steps("eager", None)
    graph, _ = _local_steps("graph", None, ckpt=True)
    assert int(graph["0.1.num_batches_tracked"]) == 4
    for k in eager:
        assert np.array_equal(graph[k], eager[k]), k


def test_load_state_dict_into_a_compiled_graph_takes_effect(tmp_path):
    """Reloading a checkpoint into a graph that has compiled already (torch's optimizer
    load replaces its state dicts) replays the same steps, and later checkpoints see the
    state the program updates. One process, local tensors; also under no_grad."""
    sbpflow.manual_seed(0)
    m = sbpflow.nn.Sequential(sbpflow.nn.Linear(4, 8), sbpflow.nn.GELU(), sbpflow.nn.Linear(8, 2))
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2)
    g = _Local(m, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    gen = torch.Generator().manual_seed(0)
    data = [(sbpflow.from_torch(torch.randn(6, 4, generator=gen)),
             sbpflow.from_torch(torch.randn(6, 2, generator=gen))) for _ in range(5)]
    with sbpflow.no_grad():  # the caller's grad mode does not reach the traced step
        for x, y in data[:2]:
            g(x, y)
    sbpflow.save(g.state_dict(), str(tmp_path / "ck"))
    sched_state = g._optimizers[0][1].state_dict()
    first = [g(x, y).item() for x, y in data[2:]]
    g.load_state_dict(sbpflow.load(str(tmp_path / "ck")))
    g._optimizers[0][1].load_state_dict(sched_state)
    again = [g(x, y).item() for x, y in data[2:]]
    assert again == first
    steps = {float(v["step"]) for v in g.state_dict()["_optimizers"][0]["state"].values()}
    assert steps == {5.0}


def test_empty_values_drop_what_computes_nothing():
    """The program pass empty_values: a pure value without elements (what a rank computes
    for a pipeline stage it is not in) becomes a fresh empty tensor and dead_code drops
    its computation; sums over it still give zeros; an in-place update that writes no
    element (an empty shard's gradient accumulated) goes too, so what fed it dies. A
    non-empty in-place update stays. The program's results are unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def f(x, e, buf):
        a = (e * 2 + 1).exp()  # (0, 4): pure and empty
        buf[:, :2].add_(e[:, :2] * 3)  # writes no element of buf: dropped
        x.mul_(2)  # writes x: stays
        return x + a.sum(0), a

    x = torch.randn(4)

    def fresh():
        return x.clone(), torch.empty(0, 4), torch.empty(0, 4)

    gm = make_fx(f)(*fresh())
    want = gm(*fresh())
    gm = passes.dead_code(passes.empty_values(gm))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.exp.default not in targets and aten.mul.Tensor not in targets
    assert aten.add_.Tensor not in targets and aten.slice.Tensor not in targets
    assert aten.mul_.Tensor in targets
    assert targets.count(aten.empty_strided.default) == 1  # a
    args = fresh()
    got = gm(*args)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(args[0], 2 * x)  # the in-place update ran
    assert got[1].shape == want[1].shape == (0, 4) and got[1].dtype == want[1].dtype


def test_keyword_arguments_are_part_of_the_signature():
    """Found by the fresh-user trial: g(x, add=t) then g(x, mul=t) replayed the first."""

    class Eval(sbpflow.nn.Graph):
        def build(self, x, add=None, mul=None):
            return x + add if add is not None else x * mul

    g = Eval()
    x = sbpflow.from_torch(torch.full((3,), 2.0))
    t = sbpflow.from_torch(torch.full((3,), 5.0))
    assert g(x, add=t).numpy().tolist() == [7.0] * 3
    assert g(x, mul=t).numpy().tolist() == [10.0] * 3
    assert g.compiles == 2


def test_zero3_with_checkpointing_updates_the_modules_parameters(dist_run):
    """Found by the fresh-user trial: torch's checkpoint stopped the recomputation early,
    skipping the ZeRO-3 post-hook of a block's last module, whose gathered tensor then
    stayed in the module while the optimizer updated the shard (right losses, stale
    parameters). The parameters are compared here, not only the losses."""
    eager = dist_run(2, _run, "dp", "eager", timeout=600)[0]
    graph = dist_run(2, _run, "dp", "graph", dict(zero=3, ckpt=True), timeout=600)[0]
    _close(graph, eager)


def _zero3_ckpt_replays(steps: int):
    """Train the GPT ``steps`` steps eagerly, then with a ZeRO-3 + activation-checkpointing
    graph (``steps`` - 1 replays of one program) with every gather in flight at once (the
    most buffers in flight); returns (eager losses, graph losses, the heap-check
    environment this rank runs under)."""
    import os

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 48, (8, 16), generator=g),
                torch.randint(0, 48, (8, 16), generator=g)) for _ in range(steps)]
    out = []
    depth, passes.GATHERS_IN_FLIGHT = passes.GATHERS_IN_FLIGHT, 10 ** 6
    try:
        for mode in ("eager", "graph"):
            m, pl, opt = _setup("dp")
            step = _Train(m, opt, pl) if mode == "graph" else None
            if step is not None:
                step.config.enable_zero(True, stage=3, shard_min_size=1)
                for blk in m.transformer.h:
                    blk.to(GraphModule).activation_checkpointing = True
            losses = []
            for x, y in batches:
                xs = sbpflow.tensor(x, placement=pl, sbp=split(0))
                ys = sbpflow.tensor(y, placement=pl, sbp=split(0))
                if step is None:
                    opt.zero_grad()
                    with sbpflow.default_placement(pl):
                        loss = _lm_loss(m, xs, ys)
                    loss.backward()
                    opt.step()
                else:
                    loss = step(xs, ys)
                losses.append(loss.item())
            out.append(losses)
            if step is not None:
                assert step.compiles == 1 and next(iter(step._programs.values())).calls == \
                    steps - 1
    finally:
        passes.GATHERS_IN_FLIGHT = depth
    return out[0], out[1], (os.environ.get("MALLOC_CHECK_"), os.environ.get("LD_PRELOAD"))


def _check_replays(results, steps: int) -> None:
    for eager, graph, _ in results:
        assert len(graph) == steps
        for i, (a, b) in enumerate(zip(graph, eager)):
            assert abs(a - b) <= 1e-5 * abs(b), (i, a, b)


def test_zero3_with_checkpointing_replays_50_steps(dist_run):
    """Issue 20: this configuration's replay once aborted with a corrupted heap ("malloc():
    unaligned tcache chunk detected", and a segfault in CI) after the suite's earlier
    files had run in the same rank processes. Here, in those processes (the pool), 49
    replays with every ZeRO-3 gather in flight at once give the eager losses."""
    _check_replays(dist_run(2, _zero3_ckpt_replays, 50, timeout=900), 50)


@pytest.mark.exhaustive
def test_zero3_with_checkpointing_replays_50_steps_under_heap_checks():
    """The same in fresh rank processes under glibc's full heap checks (``MALLOC_CHECK_=3``
    with ``libc_malloc_debug`` preloaded: a write into a freed or overrun chunk aborts)."""
    from _pool import heap_check_env, run_isolated

    want = heap_check_env()
    outcomes = run_isolated(2, _zero3_ckpt_replays, 50, timeout=900, env=want)
    for o in outcomes:
        assert o.status == "ok", o.describe()
        assert o.value[2] == (want["MALLOC_CHECK_"], want.get("LD_PRELOAD")), o.value[2]
    _check_replays([o.value for o in outcomes], 50)


def _reload(ck: str, stage: int, when: str):
    """Train the GPT 2 steps eagerly and checkpoint it, then continue 3 steps three ways:
    the eager run itself; a fresh ZeRO-``stage`` graph that loads the checkpoint
    ``when`` ("before" its first call, or "after" a first call on other data); a fresh
    eager model whose gradients are laid out as ZeRO's, loaded after its optimizer was
    made. Returns the three (losses, parameters)."""
    torch.set_num_threads(1)
    pl, data = world_placement("dp"), _DATA["dp"]
    batches = [(sbpflow.tensor(x, placement=pl, sbp=data), sbpflow.tensor(y, placement=pl,
                                                                          sbp=data))
               for x, y in _batches()]

    def eager_steps(m, opt, part):
        out = []
        for x, y in part:
            opt.zero_grad()
            with sbpflow.default_placement(pl):
                loss = _lm_loss(m, x, y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    m, _, opt = _setup("dp")
    eager_steps(m, opt, batches[:2])
    sbpflow.save({"model": m.state_dict(), "_optimizers": [opt.state_dict()]}, ck)
    ref = eager_steps(m, opt, batches[2:]), _params(m), ""

    m2, _, opt2 = _setup("dp")
    g = _Train(m2, opt2, pl)
    g.config.enable_zero(True, stage=stage, shard_min_size=1)
    if when == "after":
        g(*batches[4])
    g.load_state_dict(sbpflow.load(ck))
    graph = [g(x, y).item() for x, y in batches[2:]], _params(m2), ""

    m3, _, _ = _setup("dp")
    for p in m3.parameters():
        p.set_grad_sbp(split(0))
    opt3 = sbpflow.optim.AdamW(m3.parameters(), lr=1e-2, weight_decay=0.1)
    eager_steps(m3, opt3, batches[4:])  # the masters now hold other values
    ck_state = sbpflow.load(ck)
    m3.load_state_dict(ck_state["model"])
    opt3.load_state_dict(ck_state["_optimizers"][0])
    zero_eager = eager_steps(m3, opt3, batches[2:]), _params(m3), ""
    return ref, graph, zero_eager


@pytest.mark.parametrize("stage,when", [(1, "after"), (2, "before"), (3, "after")])
def test_checkpoint_loaded_into_a_zero_graph_is_what_trains(dist_run, tmp_path, stage, when):
    """Found by the fresh-user trial: a checkpoint loaded into a ZeRO-1/2 graph that had
    compiled was overwritten at its next step from the optimizer's old master shard
    (parameters 0.35 off), and one loaded before the first call raised torch's error from
    the optimizer's relayout. The same held for eager ZeRO layouts: a module loaded after
    its optimizer was made trained from the old values. The loaded runs continue as the
    run that wrote the checkpoint."""
    ref, graph, zero_eager = dist_run(2, _reload, str(tmp_path / "ck"), stage, when,
                                      timeout=600)[0]
    _close(graph, ref)
    _close(zero_eager, ref)


def _edited_run(mode: str, fused: bool = False):
    """A local MLP, 6 AdamW steps, with what users change mid-run (found by the
    fresh-user trial, each silently ignored by a compiled graph before): weight decay
    after step 2, a param group added after step 3 (the first layer was frozen until
    then), the last layer's bias replaced after step 4. Returns the losses and the
    parameters."""
    sbpflow.manual_seed(0)
    nn = sbpflow.nn
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    first = list(m[0].parameters())
    opt = sbpflow.optim.AdamW(list(m[2].parameters()), lr=1e-2, weight_decay=0.0, fused=fused)
    g = _Local(m, opt, None) if mode == "graph" else None
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(6):
        x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
        x, y = sbpflow.from_torch(x), sbpflow.from_torch(y)
        if step == 2:
            opt.param_groups[0]["weight_decay"] = 0.5
        if step == 3:
            opt.add_param_group({"params": first, "weight_decay": 0.0})
        if step == 4:
            m[2].bias = nn.Parameter(sbpflow.from_torch(torch.full((2,), 0.25)))
            opt.add_param_group({"params": [m[2].bias]})
        losses.append(_mse_step(g, m, opt, x, y))
    return losses, {k: v.numpy().copy() for k, v in m.state_dict().items()}, g


def _mse_step(g, m, opt, x, y) -> float:
    """One step of ``_Local``'s MSE training: the graph ``g``, or eagerly when None."""
    if g is not None:
        return g(x, y).item()
    opt.zero_grad()
    loss = sbpflow.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_changes_after_the_first_call_take_effect():
    """A graph follows eager mode through a changed hyper-parameter (read at every call),
    an added param group and a replaced parameter (each compiles again)."""
    want, want_p, _ = _edited_run("eager")
    got, got_p, g = _edited_run("graph")
    assert got == want
    for k in want_p:
        assert np.array_equal(got_p[k], want_p[k]), k
    assert g.compiles == 3  # first call, add_param_group, the replaced bias


def test_changes_a_graph_cannot_take_in_are_refused():
    """torch's fused kernel takes hyper-parameters as program constants: a change is
    refused, naming the setting and the fix; so are a build without backward and a
    scheduler that needs a metric."""
    with pytest.raises(GraphError, match="'weight_decay' changed from 0.0 to 0.5.*fused=False"):
        _edited_run("graph", fused=True)

    class NoBackward(_Local):
        def build(self, x, y):
            return sbpflow.nn.functional.mse_loss(self.model(x), y)

    m = sbpflow.nn.Linear(4, 2)
    opt = sbpflow.optim.SGD(m.parameters(), lr=0.1)
    x = sbpflow.from_torch(torch.randn(3, 4))
    with pytest.raises(GraphError, match="must call loss.backward"):
        NoBackward(m, opt, None)(x, sbpflow.from_torch(torch.randn(3, 2)))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(GraphError, match="scheduler.step\\(val_loss\\)"):
        _Local(m, opt, plateau)


def _zero3_owner_ckpt(mode: str):
    """Found by the fresh-user trial: ZeRO-3 with activation checkpointing on a module
    that owns its parameters (a Linear) recomputed with the parameter's shard and
    raised torch's CheckpointError. 4 AdamW steps of an MLP, DP over 2 ranks."""
    torch.set_num_threads(1)
    nn = sbpflow.nn
    pl = world_placement("dp")
    sbpflow.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                      nn.Linear(16, 4))
    parallelize_module(m, pl, {})
    opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2)
    g = None
    if mode == "graph":
        g = _Local(m, opt, None)
        g.config.enable_zero(True, stage=3, shard_min_size=1)
        for i in (0, 2):
            m[i].to(GraphModule).activation_checkpointing = True
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(4):
        x = sbpflow.tensor(torch.randn(8, 16, generator=gen), placement=pl, sbp=split(0))
        y = sbpflow.tensor(torch.randn(8, 4, generator=gen), placement=pl, sbp=split(0))
        losses.append(_mse_step(g, m, opt, x, y))
    return losses, _params(m), ""


def test_zero3_checkpointing_a_module_that_owns_its_parameters(dist_run):
    eager = dist_run(2, _zero3_owner_ckpt, "eager", timeout=600)[0]
    graph = dist_run(2, _zero3_owner_ckpt, "graph", timeout=600)[0]
    _close(graph, eager)


def test_replaced_modules_and_frozen_parameters_compile_again():
    """Found by the fresh-user trial: a submodule replaced after the first call (GELU by
    ReLU, no parameters) and a parameter frozen later were ignored by the compiled
    program. Each compiles again and the graph follows eager mode."""

    def run(mode):
        sbpflow.manual_seed(0)
        nn = sbpflow.nn
        m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
        opt = sbpflow.optim.AdamW(m.parameters(), lr=1e-2)
        g = _Local(m, opt, None) if mode == "graph" else None
        gen = torch.Generator().manual_seed(0)
        losses = []
        for step in range(5):
            x = sbpflow.from_torch(torch.randn(6, 4, generator=gen))
            y = sbpflow.from_torch(torch.randn(6, 2, generator=gen))
            if step == 2:
                m[1] = nn.ReLU()
            if step == 3:
                m[0].weight.requires_grad_(False)
            losses.append(_mse_step(g, m, opt, x, y))
        return losses, {k: v.numpy().copy() for k, v in m.state_dict().items()}, g

    want, want_p, _ = run("eager")
    got, got_p, g = run("graph")
    assert got == want
    for k in want_p:
        assert np.array_equal(got_p[k], want_p[k]), k
    assert g.compiles == 3


def test_gradient_accumulation_packs_outputs_as_oneflow():
    """OneFlow's packing under gradient accumulation: a 0-d output (the loss) becomes one
    value per micro-batch, shape (n,), in order; other outputs are concatenated along dim
    0 (found by the fresh-user trial: a batch-shaped output was averaged like a loss)."""

    class Out(_Local):
        def build(self, x, y):
            pred = self.model(x)
            loss = sbpflow.nn.functional.mse_loss(pred, y)
            loss.backward()
            return loss, pred[:, :1]

    sbpflow.manual_seed(0)
    m = sbpflow.nn.Linear(3, 2)
    g = Out(m, sbpflow.optim.SGD(m.parameters(), lr=0.0), None)
    g.config.set_gradient_accumulation_steps(4)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    loss, pred = g(sbpflow.from_torch(x), sbpflow.from_torch(y))
    with torch.no_grad():
        want = torch.nn.functional.linear(x, m.weight.to_torch(), m.bias.to_torch())
        per_micro = torch.stack([torch.nn.functional.mse_loss(want[i:i + 2], y[i:i + 2])
                                 for i in range(0, 8, 2)])
    assert tuple(pred.shape) == (8, 1) and tuple(loss.shape) == (4,)
    torch.testing.assert_close(pred.to_torch(), want[:, :1])
    torch.testing.assert_close(loss.to_torch(), per_micro)


def test_per_shard_random_in_a_graph_is_refused():
    """Per-shard draws are seeded on the host: a graph refuses them naming the fix (the
    trial got a 'value read' error blaming the user's line)."""

    class Drop(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.drop = sbpflow.nn.Dropout(0.5)

        def build(self, x):
            with sbpflow.random.per_shard():
                return self.drop(x)

    pl = world_placement("dp")
    x = sbpflow.ones(4, 4, placement=pl, sbp=split(0))
    with pytest.raises(GraphError, match="per_shard\\(\\) inside nn.Graph.*default"):
        Drop()(x)


def _gpt_mini_clipped(layout: str, compiled: bool, steps: int = 10):
    """gpt-mini (its TP plan: vocabulary-parallel embedding and cross entropy; block 16)
    trained ``steps`` steps by a graph with AdamW in two groups (decay / no decay) and
    OneFlow's ``clip_grad_max_norm`` 1.0; ``layout`` "tp" (TP(2)) or "zero3" (ZeRO-3 over
    2 ranks). Returns (losses, parameters as numpy)."""
    import dataclasses

    torch.set_num_threads(1)
    spec = sbpflow.models.get("gpt-mini")
    sbpflow.manual_seed(0)
    m = spec.builder(dataclasses.replace(spec.config, vocab_size=85, block_size=16))
    pl = world_placement("dp")
    parallelize_module(m, pl, spec.plan("tp") if layout == "tp" else {}, tp_axis=-1)
    groups = [{"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = sbpflow.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    for group in opt.param_groups:
        group["clip_grad_max_norm"] = 1.0
    g = _Train(m, opt, pl)
    if layout == "zero3":
        g.config.enable_zero(True, stage=3, shard_min_size=1)
    g.config.enable_compile(compiled)
    data = split(0) if layout == "zero3" else B
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = (torch.randint(0, 85, (8, 16), generator=gen) for _ in range(2))
        losses.append(g(sbpflow.tensor(x, placement=pl, sbp=data),
                        sbpflow.tensor(y, placement=pl, sbp=data)).item())
    return losses, _params(m)


@pytest.mark.exhaustive
@pytest.mark.parametrize("layout", ["tp", "zero3"])
def test_compile_with_clipping_of_split_parameters_equals_the_uncompiled_graph(dist_run,
                                                                              layout):
    """Issue 20: the compiled program of gpt-mini TP(2) with gradient clipping gave other
    losses than the uncompiled one (1.8e-4 at step 2) and was refused. Ten steps, losses
    within 1e-5 relative, each parameter within 1e-5 of its norm (``|a - b| / |a|``;
    elementwise, AdamW turns inductor's reassociated float sums into 1e-4 of the largest
    entry of the attention q/k weights). The attention key biases are left out as in
    :func:`_close` (zero gradient in exact arithmetic)."""
    plain = dist_run(2, _gpt_mini_clipped, layout, False, timeout=900)[0]
    comp = _compiled_run(2, _gpt_mini_clipped, layout, True)[0]
    for i, (a, b) in enumerate(zip(comp[0], plain[0])):
        assert abs(a - b) <= 1e-5 * abs(b), (i, a, b)
    for k, want in plain[1].items():
        if k.endswith("attn.k.bias"):
            continue
        err = float(np.linalg.norm(comp[1][k] - want)) / max(float(np.linalg.norm(want)), 1e-12)
        assert err <= 1e-5, (k, err)


def test_float_arguments_are_keyed_by_their_bits():
    """Issue 20, item 6: the cache keyed Python floats by ``==``, so g(x, -0.0) replayed
    the program compiled for 0.0 (1 / (x * s) gave inf where torch gives -inf), and a NaN
    argument (never == itself) compiled anew at every call."""

    class Scale(sbpflow.nn.Graph):
        def build(self, x, s):
            return 1 / (x * s)

    inf = float("inf")
    g = Scale()
    x = sbpflow.from_torch(torch.ones(2))
    assert g(x, 0.0).numpy().tolist() == [inf, inf]
    assert g(x, -0.0).numpy().tolist() == [-inf, -inf]  # torch: 1 / (1 * -0.0) = -inf
    assert g.compiles == 2
    assert g(x, 0.0).numpy().tolist() == [inf, inf]  # each sign replays its own program
    assert g(x, -0.0).numpy().tolist() == [-inf, -inf]
    for _ in range(3):
        assert np.isnan(g(x, float("nan")).numpy()).all()
    assert g.compiles == 3  # one program for NaN, however many calls
