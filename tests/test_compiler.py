"""The compiler's structure (issue 22): the step transforms and program passes are listed
once and run from the lists, they share a compile context instead of module globals, and
compiling replaces no method of ``Tensor``, ``Module`` or a module instance."""

from __future__ import annotations

import collections
import importlib
import itertools
import random
import weakref

import pytest
import torch

import sbpflow
from sbpflow.graph import GraphModule, compiler
from sbpflow.nn.module import Module
from sbpflow.tensor import Tensor

_GRAPH_MODULES = ("graph", "passes", "compiler", "trace", "show", "verify", "ir", "config")
_MUTABLE = (dict, list, set, bytearray, collections.deque, weakref.WeakValueDictionary,
            weakref.WeakKeyDictionary, itertools.count, random.Random)


def test_graph_package_holds_no_module_level_mutable_state():
    """Module globals of ``sbpflow.graph`` are constants (tuples, frozensets, functions,
    classes, torch op handles): what a compilation needs lives in its CompileContext."""
    found = []
    for name in _GRAPH_MODULES:
        mod = importlib.import_module(f"sbpflow.graph.{name}")
        for k, v in vars(mod).items():
            if not k.startswith("__") and isinstance(v, _MUTABLE):
                found.append(f"sbpflow.graph.{name}.{k}: {type(v).__name__}")
    assert found == []


def test_transforms_and_passes_are_listed_once():
    names = [t.name for t in compiler.STEP_TRANSFORMS]
    assert len(set(names)) == len(names) and all(names)
    assert names[-1] == "update"  # the update runs after every other transform's finish
    passes = [p.name for p in compiler.PROGRAM_PASSES]
    assert len(set(passes)) == len(passes)


class _Net(Module):
    def __init__(self):
        super().__init__()
        self.a = sbpflow.nn.Linear(6, 8)
        self.b = sbpflow.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.a(x).relu())


def _class_attrs():
    return {cls: dict(vars(cls)) for cls in (Tensor, Module, sbpflow.nn.Linear)}


def test_compiling_replaces_no_method_and_runs_the_lists_in_order(monkeypatch):
    """While the step traces (checkpointing, gradient accumulation, the update), the
    classes' attributes and the modules' instance dictionaries are what they were before;
    the program passes that run are the list's, in its order."""
    torch.manual_seed(0)
    net = _Net()
    opt = sbpflow.optim.SGD(net.parameters(), lr=0.1)
    before_cls = _class_attrs()
    seen = {}

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.net = net
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(2)
            self.net.a.to(GraphModule).activation_checkpointing = True

        def build(self, x):
            seen["cls"] = _class_attrs()
            seen["inst"] = {id(m): set(vars(m)) for m in net.modules()}
            loss = self.net(x).square().mean()
            loss.backward()
            return loss

    ran = []
    listed = tuple(compiler.ProgramPass(p.name, lambda gm, ctx, p=p: ran.append(p.name) or
                                        p.run(gm, ctx), p.enabled)
                   for p in compiler.PROGRAM_PASSES)
    monkeypatch.setattr(compiler, "PROGRAM_PASSES", listed)
    step = Step()
    before_inst = {id(m): set(vars(m)) for m in net.modules()}  # GraphModule settings set
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for t, s in zip(ref.parameters(), net.parameters()):
            t.copy_(s.to_torch())
    x = torch.randn(4, 6)
    loss = step(sbpflow.tensor(x))
    assert seen["cls"] == before_cls
    assert seen["inst"] == before_inst
    assert ran == [n for n in (p.name for p in listed)  # 2 micro-batches: none left out
                   if n not in ("pipeline", "replicate micro-batches") and
                   (n != "overlap" or step.config.overlap)]
    want = [ref(h).square().mean().item() for h in x.chunk(2)]  # one value per micro-batch
    assert torch.allclose(loss.to_torch(), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _staged_losses(compiled: bool, steps: int = 3):
    """Two stages (a linear on each rank) as a 1F1B pipeline of 4 micro-batches."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pls = [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])]
    net = _Net()
    net.to_global(pls[0], sbpflow.sbp.broadcast)
    net.a.to(GraphModule).set_stage(0, pls[0])
    net.b.to(GraphModule).set_stage(1, pls[1])
    opt = sbpflow.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.net = net
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(4)
            self.config.set_pipeline_schedule("1f1b")
            self.config.enable_compile(compiled)

        def build(self, x, y):
            loss = (self.net(x) - y).square().mean()
            loss.backward()
            return loss

    step = Step()
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        loss = step(sbpflow.tensor(x, placement=pls[0], sbp=sbpflow.sbp.broadcast),
                    sbpflow.tensor(y, placement=pls[1], sbp=sbpflow.sbp.broadcast))
        out.append(loss.to_global(pls[1], sbpflow.sbp.broadcast).to_local().tolist()
                   if loss.placement.coord() is not None else None)
    return out


@pytest.mark.exhaustive  # torch.compile of two programs: about 30 s
def test_compiled_pipeline_equals_the_uncompiled_graph(dist_run):
    """``enable_compile`` with pipeline stages (the transfers run outside the compiled
    pieces): the same per-micro-batch losses as the uncompiled pipeline."""
    plain = dist_run(2, _staged_losses, False)
    compiled = dist_run(2, _staged_losses, True, timeout=600)
    assert plain[1] is not None and len(plain[1]) == 3
    for a, b in zip(plain, compiled):
        assert a == b or torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-6,
                                        atol=1e-7), (a, b)


# ------------------------------------------------------------ micro-batch replication


def _labelled(g, node, kind, k):
    node.meta["custom"] = {"pp": (kind, k)}
    return node


def _four_micro_batches(last_reads_first: bool, update_reads_template: bool = False):
    """A hand-made step of 4 micro-batches traced as :func:`compiler.traced_step` traces
    one with micro-batches left out: ``x`` cut per micro-batch (``I``), micro-batches 0,
    1 and 3 traced (``F``: ``h0 = x0 * 2``, then ``h_k = h0 + x_k``; micro-batch 3
    reads micro-batch 1's ``h1`` when not ``last_reads_first``: a value passed from one
    micro-batch to the next), a stand-in of micro-batch 2's output (``O``), and the
    outputs stacked in the update (``U``); ``update_reads_template``: the update also
    reads micro-batch 1's ``h1 * 3``, which is not an output."""
    import torch.fx as fx

    from sbpflow.graph import passes

    g = fx.Graph()
    x = g.placeholder("x")
    def cut(k):
        return _labelled(g, g.call_function(torch.ops.aten.slice.Tensor, (x, 0, k, k + 1)),
                         "I", k)

    h0 = _labelled(g, g.call_function(torch.ops.aten.mul.Tensor, (cut(0), 2)), "F", 0)
    h1 = _labelled(g, g.call_function(torch.ops.aten.add.Tensor, (h0, cut(1))), "F", 1)
    side = _labelled(g, g.call_function(torch.ops.aten.mul.Tensor, (h1, 3)), "F", 1)
    cut(2)
    o2 = _labelled(g, g.call_function(torch.ops.aten.clone.default, (h1,)), "O", 2)
    c3 = cut(3)
    h3 = _labelled(g, g.call_function(torch.ops.aten.add.Tensor,
                                      (h0 if last_reads_first else h1, c3)), "F", 3)
    outs = [h0, h1, o2, h3]
    if update_reads_template:
        outs.append(side)
    _labelled(g, g.call_function(torch.ops.aten.cat.default, (outs,)), "U", 0)
    g.output(list(g.nodes)[-1])
    return fx.GraphModule(torch.nn.Module(), g), passes.Replication(4)


def test_replication_copies_micro_batch_one_with_its_own_input_cut():
    """Micro-batch 2 becomes micro-batch 1's nodes on its own cut of the input; its
    output stand-in is replaced by the copy's output."""
    from sbpflow.graph import passes

    gm, rep = _four_micro_batches(last_reads_first=True)
    passes.replicate_micro_batches(gm, rep)
    x = torch.arange(4.0)
    assert gm(x).tolist() == [0.0, 1.0, 2.0, 3.0]  # h0 = 0; h_k = h0 + x_k
    assert not any(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)


@pytest.mark.parametrize("case", ["passed on", "read by the update"])
def test_replication_refuses_what_a_copy_cannot_tell(case):
    """A value passed from micro-batch 0 to 1 that the last micro-batch does not read
    (the next micro-batch would need micro-batch 1's, which a copy cannot know), or a
    value of micro-batch 1 that the update reads: NotReplicable (the graph then traces
    every micro-batch)."""
    from sbpflow.graph import passes

    gm, rep = _four_micro_batches(last_reads_first=case != "passed on",
                                  update_reads_template=case == "read by the update")
    with pytest.raises(passes.NotReplicable, match="micro-batch"):
        passes.replicate_micro_batches(gm, rep)


class _BnNet(Module):
    def __init__(self):
        super().__init__()
        self.a = sbpflow.nn.Linear(6, 8)
        self.bn = sbpflow.nn.BatchNorm1d(8)
        self.drop = sbpflow.nn.Dropout(0.2)
        self.b = sbpflow.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(self.drop(self.bn(self.a(x)).relu()))


def _accumulated(layout: str, replicate: bool, m: int = 8, steps: int = 3,
                 refuse_on: int | None = None, checkpoint_bn: bool = False):
    """``_BnNet`` (batch norm: running statistics updated in place per micro-batch;
    dropout: a draw per micro-batch) trained ``steps`` steps of ``m`` micro-batches, as a
    pipeline of two stages (``layout`` "1f1b" or "zero_bubble": ``a``, ``bn``, ``drop`` on
    rank 0, ``b`` on rank 1) or data-parallel over both ranks (``"dp"``). ``refuse_on``:
    that rank's replication raises NotReplicable; ``checkpoint_bn``: the batch norm's
    activations recomputed in backward (its statistics saved and restored around the
    recomputation, per micro-batch). Returns (losses, parameters and buffers, build()
    calls, the program's transfer tags)."""
    from sbpflow.graph import passes

    torch.set_num_threads(1)
    sbpflow.manual_seed(0)
    net = _BnNet()
    if layout == "dp":
        pls = [sbpflow.placement("cpu", [0, 1])] * 2
        net.to_global(pls[0], sbpflow.sbp.broadcast)
        data = sbpflow.sbp.split(0)
    else:
        pls = [sbpflow.placement("cpu", [0]), sbpflow.placement("cpu", [1])]
        net.to_global(pls[0], sbpflow.sbp.broadcast)
        for mod in (net.a, net.bn, net.drop):
            mod.to(GraphModule).set_stage(0, pls[0])
        net.b.to(GraphModule).set_stage(1, pls[1])
        data = sbpflow.sbp.broadcast
    if checkpoint_bn:
        net.bn.to(GraphModule).activation_checkpointing = True
    opt = sbpflow.optim.AdamW(net.parameters(), lr=0.01)

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.net = net
            self.calls = 0
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(m)
            self.config.enable_micro_batch_replication(replicate)
            if layout != "dp":
                self.config.set_pipeline_schedule(layout)

        def build(self, x, y):
            self.calls += 1
            loss = (self.net(x) - y).square().mean()
            loss.backward()
            return loss

    real = passes.replicate_micro_batches
    if refuse_on == sbpflow.distributed.get_rank():
        def refuse(gm, rep, recompile=True):
            raise passes.NotReplicable("refused by the test on this rank")
        passes.replicate_micro_batches = refuse
    try:
        step = Step()
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x, y = torch.randn(2 * m, 6, generator=gen), torch.randn(2 * m, 3, generator=gen)
            loss = step(sbpflow.tensor(x, placement=pls[0], sbp=data),
                        sbpflow.tensor(y, placement=pls[1], sbp=data))
            losses.append(loss.to_global(pls[1], sbpflow.sbp.broadcast).numpy().tolist())
    finally:
        passes.replicate_micro_batches = real
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    gm = next(iter(step._programs.values())).gm
    tags = [t for n in gm.graph.nodes if n.target is passes._P2P for t in n.args[2]]
    return losses, state, step.calls, tags


@pytest.mark.parametrize("layout", ["1f1b", pytest.param("zero_bubble",
                                                         marks=pytest.mark.exhaustive), "dp"])
def test_replicated_micro_batches_give_the_fully_traced_step(dist_run, layout):
    """8 micro-batches, micro-batches 0, 1 and 7 traced and 1 copied as 2..6: the
    losses, parameters and batch-norm statistics of 3 steps are the fully traced
    program's to the bit (dropout masks and in-place statistics included; the first call
    runs the program after undoing the trace's update), build() ran 3 times, not 8, and
    every transfer of the pipeline has its own tag."""
    rep = dist_run(2, _accumulated, layout, True)
    full = dist_run(2, _accumulated, layout, False)
    for r in range(2):
        assert rep[r][0] == full[r][0], (rep[r][0], full[r][0])
        for k, v in full[r][1].items():
            assert (rep[r][1][k] == v).all(), k
        assert (rep[r][2], full[r][2]) == (3, 8)
        if layout != "dp":  # per micro-batch one activation and one gradient
            assert len(rep[r][3]) == len(full[r][3]) == 16
            assert len(set(rep[r][3])) == 16, rep[r][3]


def test_replication_of_a_checkpointed_batch_norm(dist_run):
    """A checkpointed BatchNorm reads its statistics as the previous micro-batch's
    recomputation restored them: the copies read the previous copy's (no fallback: 3
    build() calls) and the step is the fully traced one to the bit."""
    rep = dist_run(2, _accumulated, "dp", True, 8, 3, None, True)
    full = dist_run(2, _accumulated, "dp", False, 8, 3, None, True)
    for r in range(2):
        assert rep[r][2] == 3 and rep[r][0] == full[r][0]
        for k, v in full[r][1].items():
            assert (rep[r][1][k] == v).all(), k


def test_a_rank_that_cannot_replicate_makes_every_rank_trace_all(dist_run):
    """Replication refused on rank 1 only: both ranks trace again with every micro-batch
    (3 + 8 build() calls each: their programs keep one collective order) and give the
    fully traced step's losses."""
    got = dist_run(2, _accumulated, "1f1b", True, 8, 2, 1)
    full = dist_run(2, _accumulated, "1f1b", False, 8, 2)
    for r in range(2):
        assert got[r][2] == 3 + 8
        assert got[r][0] == full[r][0]
