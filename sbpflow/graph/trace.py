"""Tracing one training or evaluation step of an ``nn.Graph`` into a per-rank program.

The first call with an input signature runs the step once, for real, through sbpflow's
one dispatcher, inside ``torch.fx``'s ``make_fx`` (real tensors, so the call's results are
the real results): the chooser and the boxing planner decide every layout and collective
once, and what each rank executes (local torch kernels, forward, backward and the
optimizer's update, with the collectives as functional collectives) is recorded as
that rank's ``torch.fx`` program. Later calls replay the program: no sbpflow dispatch, no
autograd engine, no Python hooks, only torch ops in sequence (an optimizer not built with
``fused=True`` steps as one op that runs its own torch ``step()``, the kernels of eager
mode: :meth:`sbpflow.optim.Optimizer.program_step`).

What the step consists of is decided by the step transforms it is traced under
(:data:`sbpflow.graph.compiler.STEP_TRANSFORMS`, in that order): micro-batches, autocast,
activation checkpointing, ZeRO gathers, tied parameters, loss scaling, then the
optimizers' update.

Everything that changes between calls is an input of the program, never a constant:
parameters, buffers, optimizer state (step counts included), learning rates (a 0-d tensor
per parameter group, filled from ``param_group["lr"]`` before each call, so LR schedulers
work), the loss scale and the user's inputs. Values are not read while tracing: a read
raises :class:`GraphTraceError` naming what read and where (it would be frozen into the
program).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed import _comm
from ..distributed._state import _state as _dstate
from ..tensor import Tensor

__all__ = ["GraphError", "GraphTraceError", "Slot", "Tracer", "mark", "trace_program"]


class GraphError(ValueError):
    """An ``nn.Graph`` used in a way it cannot run (inputs on another placement than the
    graph's, ranks calling it with different input signatures, unsupported settings)."""


class GraphTraceError(RuntimeError):
    """Something in ``build()`` needs a tensor's value while the graph is traced (an
    ``.item()``, ``numpy()``, ``if tensor:``, a data-dependent op): a graph records
    operations, not values."""


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_site() -> str:
    """``file:line`` of the innermost frame outside sbpflow and torch."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith((_PKG, _TORCH, "<")):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class Tracer:
    """Installed in ``sbpflow.distributed``'s state while a graph traces: sbpflow's value
    reads call :meth:`value_read`, which raises."""

    planning = False  # sbpflow.graph.ir.Planner: a logical graph, no data moves

    def __init__(self, graph_name: str, context=None):
        self.graph_name = graph_name
        self.events = None  # the logical graph being recorded (see trace_program)
        self.context = context  # the compile context (sbpflow.graph.compiler)

    def mark(self, text: str) -> None:
        """A section heading in the logical graph (``print(graph)``)."""
        if self.events is not None:
            self.events.append(text)

    def unsupported(self, what: str) -> GraphError:
        """The error for a layer that cannot run inside a graph (its collectives have
        data-dependent sizes: a sharded embedding lookup); the layer raises it."""
        return GraphError(f"{self.graph_name}.build(): {what} (at {_user_site()})")

    def value_read(self, what: str, site: str) -> None:
        raise GraphTraceError(
            f"{self.graph_name}.build(): {what} at {site} reads a tensor's value while the "
            f"graph is traced. A graph records operations, not values: the value would be "
            f"frozen into every later call. Return the tensor from build() and read it "
            f"outside the graph (loss = graph(x); print(loss.item())); for a data-dependent "
            f"choice use tensor ops (sbpflow.where, masks) instead of Python control flow")


class _NoValueReads(TorchDispatchMode):
    """Catches value reads inside torch itself (``aten._local_scalar_dense``: a torch
    optimizer's ``.item()``, a data-dependent op) during a trace."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _dstate.untraced:
            self.tracer.value_read(f"a value read inside torch ({func})", _user_site())
        return func(*args, **(kwargs or {}))


@dataclass
class Slot:
    """One tensor the program takes as input at every call: ``get()`` returns the current
    torch tensor (the parameter's shard, the optimizer state...)."""

    kind: str  # param, buffer, master, opt_state, lr, scaler, input
    name: str
    get: Callable[[], torch.Tensor]


@dataclass
class Traced:
    """What tracing gives: the program and how to call it."""

    gm: torch.fx.GraphModule
    slots: list[Slot]
    out_spec: object  # pytree spec of build()'s return
    out_meta: list  # per output leaf: None (a constant: out_consts) or (placement, sbp, shape)
    out_consts: list
    events: list = field(default_factory=list)  # the logical graph (ops and collectives)
    outputs: list = field(default_factory=list)  # the traced call's results (real values)


class _Events:
    """The logical graph as it is traced: dispatched ops and collectives, in order."""

    def __init__(self):
        self.items: list = []

    def append(self, rec) -> None:  # a CommRecorder-style sink and an observer both
        self.items.append(rec)


def mark(text: str) -> None:
    """A section heading in the logical graph of the trace in progress (none: nothing)."""
    tracer = _dstate.tracer
    if isinstance(tracer, Tracer):
        tracer.mark(text)


@contextlib.contextmanager
def installed(tracer: Tracer) -> Iterator[None]:
    """Install ``tracer``: value reads raise, collectives become functional ones."""
    if _dstate.tracer is not None:
        raise GraphError("an nn.Graph is called while another one is being traced (a graph "
                         "inside build()); call the inner graph's modules directly instead")
    _dstate.tracer = tracer
    try:
        yield
    finally:
        _dstate.tracer = None


def _one_fake_mode():
    """One ``FakeTensorMode`` for the whole trace. ``make_fx(tracing_mode="real")``
    records each value's metadata (``node.meta["val"]``) as a fake tensor made in the
    fake mode it detects, else in a new ``FakeTensorMode``, whose construction captures a
    Python stack (``traceback.extract_stack``): once per traced value, about a fifth of
    a pipelined GPT's trace time. A tracing context holding one mode is what
    ``torch._guards.detect_fake_mode`` finds first."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    return tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True)))


def trace_program(name: str, step: Callable, slots: list[Slot], inputs: list[Tensor],
                  events: bool = True, node_meta: bool = False,
                  stack_traces: bool = False, anchors=(), context=None) -> Traced:
    """Trace ``step(*inputs)`` (returns build()'s output) into a program of
    ``(*slot tensors, *input locals) -> output locals``. Runs the step for real.
    ``node_meta``: keep ``torch.fx.traceback`` annotations on the nodes (the pipeline's
    task labels); ``stack_traces``: record each node's Python stack (``meta["stack_trace"]``,
    which the verifier's messages quote): torch keeps the frames of modules' ``forward``
    and of the functions in ``anchors`` (the graph's ``build``)."""
    from torch.fx import proxy as fx_proxy
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    from ..ops.dispatch import observe

    flat = [s.get() for s in slots] + [x._local for x in inputs]
    if stack_traces:
        for fn in anchors:
            fx_proxy._register_stack_trace_anchor(fn)
    tracer = Tracer(name, context)
    box: dict = {}
    log = _Events()
    if events:
        tracer.events = log

    def run(*_locals):
        out = step(*inputs)
        leaves, spec = pytree.tree_flatten(out)
        box["spec"] = spec
        meta, consts, tensors = [], [], []
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                meta.append((leaf.placement, leaf.sbp, leaf.shape) if leaf.is_global else
                            ("local", None, None))
                tensors.append(leaf._local.detach())
            elif isinstance(leaf, torch.Tensor):
                meta.append(("torch", None, None))
                tensors.append(leaf.detach())
            else:
                meta.append(None)
                consts.append(leaf)
        box["meta"], box["consts"], box["tensors"] = meta, consts, tensors
        return tensors

    recorder = _comm.CommRecorder(records=log) if events else contextlib.nullcontext()
    observer = observe(log.append) if events else contextlib.nullcontext()
    keep = fx_traceback.preserve_node_meta() if node_meta else contextlib.nullcontext()
    with installed(tracer), _NoValueReads(tracer), recorder, observer, keep, \
            _one_fake_mode():
        gm = make_fx(run, tracing_mode="real", record_stack_traces=stack_traces)(*flat)
    return Traced(gm, slots, box["spec"], box["meta"], box["consts"],
                  events=log.items, outputs=box["tensors"])
