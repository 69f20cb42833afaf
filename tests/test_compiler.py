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
    assert ran == [n for n in (p.name for p in listed)
                   if n != "pipeline" and (n != "overlap" or step.config.overlap)]
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
