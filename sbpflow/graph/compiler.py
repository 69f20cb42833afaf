"""How an ``nn.Graph`` compiles, stage by stage, with every transform and pass listed once.

1. **Layouts** (once per graph, before the first trace): each step transform's
   :meth:`StepTransform.prepare` (ZeRO re-lays out parameters).
2. **The logical graph** (optional, :meth:`sbpflow.nn.Graph.lower`): ``build()`` on meta
   stand-ins (:mod:`sbpflow.graph.ir`).
3. **The traced step** (:func:`traced_step`): ``build()`` run once per micro-batch, for
   real, inside ``make_fx`` (:func:`sbpflow.graph.trace.trace_program`), under the
   :data:`STEP_TRANSFORMS` in list order (the first is outermost), then each transform's
   :meth:`StepTransform.finish` in list order (the update last).
4. **Program passes** (:func:`run_program_passes`): :data:`PROGRAM_PASSES` in list order
   on the per-rank ``torch.fx`` program.
5. **Compilation** (optional): ``torch.compile`` of the program
   (:func:`sbpflow.graph.passes.compile_program`).

The transforms and passes share one :class:`CompileContext` (what is compiled and the
state of the trace in progress), never module globals or keys in ``Module.__dict__``, and
no class's methods are replaced: the step reaches the code it changes through two
declared extension points, both consulted only while a graph traces, through the
tracer (``sbpflow.distributed``'s state):

* ``Module.__call__`` calls ``ctx.forward_wrappers[id(module)]`` around a module's
  forward when one is set (activation checkpointing);
* ``Tensor.backward`` runs under ``ctx.backward_scope`` (loss scaling, the micro-batch
  average, the pipeline's task label).

A new step transform is a :class:`StepTransform` subclass and a place in
:data:`STEP_TRANSFORMS`; a new program pass a function ``(gm, ctx) -> gm`` and a place in
:data:`PROGRAM_PASSES`. README's "nn.Graph" section lists both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from . import passes
from .trace import mark

__all__ = ["PROGRAM_PASSES", "STEP_TRANSFORMS", "CompileContext", "ProgramPass",
           "StepTransform", "context", "run_program_passes", "traced_step"]


@dataclass(eq=False)
class CompileContext:
    """What one compilation of a graph's step shares between its transforms and passes.

    Set when the compilation starts: ``graph`` (the :class:`sbpflow.nn.Graph`), its
    ``config``, ``modules`` (every module, submodules included), ``device`` (the
    parameters' device type), ``scaler`` (the float16 loss scale's ``(scale,
    growth_tracker)`` tensors, or None), ``actions``/``stage_of``/``neighbours``/
    ``pipe_rank`` (a pipeline's action list for this rank and its maps, or None). Filled
    by the transforms while the step traces: ``micro_batch`` (the one being traced),
    ``foreign`` (a pipeline's copies of parameters used on another stage),
    ``forward_wrappers`` and ``backward_scopes`` (the extension points), ``zero12``/
    ``zero3`` (ZeRO's parameter layouts to gather to), ``zero3_hooks``/``zero3_swapped``
    (ZeRO-3's per-module state), ``zero_full`` (ZeRO-1/2's gathered copies: id(param) ->
    its full leaf). ``on_saved``: set by :func:`sbpflow.graph.ir.build` only, called with
    each torch tensor the forward keeps for backward that a transform's own saved-tensor
    hooks would hide from an outer hook (ZeRO-3's, checkpointing's block inputs)."""

    graph: object
    config: object
    modules: list
    device: str
    scaler: tuple | None = None
    actions: list | None = None
    stage_of: dict | None = None
    neighbours: frozenset = frozenset()
    pipe_rank: dict | None = None
    micro_batch: int = 0
    foreign: object = None
    forward_wrappers: dict = field(default_factory=dict)  # id(module) -> fn(fwd, args, kw)
    backward_scopes: list = field(default_factory=list)  # fn(tensor) -> cm yielding tensor
    zero12: dict = field(default_factory=dict)  # id(param) -> gathered nd-SBP, ZeRO 1/2
    zero3: dict = field(default_factory=dict)  # the same, ZeRO-3
    zero3_hooks: dict = field(default_factory=dict)  # id(module) -> (pre, post)
    zero3_swapped: dict = field(default_factory=dict)  # id(module) -> {name: shard}
    zero_full: dict = field(default_factory=dict)  # id(param) -> gathered leaf, ZeRO 1/2
    on_saved: object = None  # fn(torch.Tensor): what the forward keeps (ir.build's record)
    replication: passes.Replication | None = None  # micro-batches left out of the trace

    @property
    def labelled(self) -> bool:
        """The program's nodes carry task labels: a pipeline, or a step traced with
        micro-batches left out (:attr:`replication`)."""
        return self.actions is not None or self.replication is not None

    @property
    def micro_batches(self) -> int:
        return self.config.grad_acc_steps

    @contextlib.contextmanager
    def backward_scope(self, tensor) -> Iterator[object]:
        """``Tensor.backward`` inside a traced step: each registered scope in turn may
        replace the tensor backpropagated from (a scaled loss); yields the last."""
        with contextlib.ExitStack() as stack:
            for scope in self.backward_scopes:
                tensor = stack.enter_context(scope(tensor))
            yield tensor


def context():
    """The :class:`CompileContext` of the step being traced now, or None."""
    from ..distributed._state import _state

    return getattr(_state.tracer, "context", None)


# ============================================================================ transforms


class StepTransform:
    """One transform of the traced step. Override what applies:

    * :meth:`enabled` - whether it takes part in this compilation;
    * :meth:`prepare` - once per compilation, before tracing (layouts);
    * :meth:`scope` - a context around the whole traced step (every micro-batch's forward
      and backward);
    * :meth:`micro_batch` - a context around micro-batch ``k``'s forward and backward;
    * :meth:`finish` - after the last micro-batch, inside the update task.
    """

    name = ""

    def enabled(self, ctx: CompileContext) -> bool:
        return True

    def prepare(self, ctx: CompileContext) -> None:
        pass

    def scope(self, ctx: CompileContext):
        return contextlib.nullcontext()

    def micro_batch(self, ctx: CompileContext, k: int, last: bool):
        return contextlib.nullcontext()

    def finish(self, ctx: CompileContext) -> None:
        pass

    def __repr__(self) -> str:
        return f"<step transform {self.name}>"


class GradientAccumulation(StepTransform):
    """``set_gradient_accumulation_steps(m)``: the inputs cut into ``m`` micro-batches
    (:func:`sbpflow.graph.passes.micro_batches`, done by :func:`traced_step`), the
    data-parallel gradient reductions deferred to the last one (``no_sync``); the loss
    scaled by ``1/m`` is :class:`LossScaling`'s."""

    name = "gradient accumulation"

    def enabled(self, ctx):
        return ctx.micro_batches > 1

    def micro_batch(self, ctx, k, last):
        from ..autograd import no_sync

        return no_sync() if not last and ctx.graph._optimizers else contextlib.nullcontext()


class Autocast(StepTransform):
    """``enable_amp(True, dtype=)``: ``torch.autocast`` around forward and backward."""

    name = "autocast"

    def enabled(self, ctx):
        return ctx.config.amp_dtype is not None

    def scope(self, ctx):
        return passes.autocast(ctx.device, ctx.config.amp_dtype)


class ActivationCheckpointing(StepTransform):
    """``GraphModule.activation_checkpointing``: each marked module's forward is
    recomputed in backward (:func:`sbpflow.graph.passes.checkpointing`)."""

    name = "activation checkpointing"

    @staticmethod
    def marked(ctx) -> list:
        return [m for m in ctx.modules if m.__dict__.get("_graph_module") is not None and
                m.__dict__["_graph_module"].activation_checkpointing]

    def enabled(self, ctx):
        return bool(self.marked(ctx))

    def scope(self, ctx):
        return passes.checkpointing(ctx, self.marked(ctx))


class ZeroSharding(StepTransform):
    """``enable_zero(True, stage=)``: parameters re-laid out ``S(0)`` once
    (:func:`sbpflow.graph.passes.zero_layouts`), gathered per step (stages 1/2) or per
    module (stage 3) while the step traces."""

    name = "ZeRO"

    def enabled(self, ctx):
        return bool(ctx.config.zero_stage) or ctx.graph._zero is not None

    def prepare(self, ctx):
        from .trace import GraphError

        g, cfg = ctx.graph, ctx.config
        want = (cfg.zero_stage, cfg.zero_min_size) if cfg.zero_stage else None
        if g._zero is None and want is not None and g._optimizers:
            g._zero12, g._zero3 = self.relayout(
                (p for m in ctx.modules for p in m._parameters.values() if p is not None), cfg)
            g._zero = want
        elif g._zero is not None and want != g._zero:
            raise GraphError(f"enable_zero: the ZeRO settings changed from {g._zero} to "
                             f"{want} after the graph compiled; build a new graph")
        ctx.zero12, ctx.zero3 = g._zero12, g._zero3

    @staticmethod
    def relayout(params, cfg) -> tuple[dict, dict]:
        """Re-lay out ``params`` for ZeRO (:func:`sbpflow.graph.passes.zero_layouts`);
        returns ``(stage 1/2 layouts, stage 3 layouts)``, id(param) -> the nd-SBP to
        gather to (one of the two empty)."""
        layouts = {id(p): sbp for p, sbp in passes.zero_layouts(
            passes.unique(params), cfg.zero_stage, cfg.zero_min_size)}
        return ({}, layouts) if cfg.zero_stage >= 3 else (layouts, {})

    def scope(self, ctx):
        stack = contextlib.ExitStack()
        stack.enter_context(passes.zero_step_gathers(
            ctx.modules, ctx.zero12, ctx.zero_full if ctx.on_saved is not None else None))
        stack.enter_context(passes.zero3_gathers(ctx, ctx.zero3))
        return stack


class TiedParameters(StepTransform):
    """Pipelines: a parameter used on another stage than its own (a tied embedding) is
    sent there once per step and its gradient, summed over the micro-batches, sent back
    once (:class:`sbpflow.graph.passes.ForeignParams`)."""

    name = "tied parameters"

    def enabled(self, ctx):
        return ctx.labelled

    @contextlib.contextmanager
    def scope(self, ctx):
        ctx.foreign = passes.ForeignParams()
        yield

    def finish(self, ctx):
        ctx.foreign.flush()
        ctx.foreign = None


class LossScaling(StepTransform):
    """``loss.backward()`` backpropagates ``loss / m`` (the micro-batch average) times the
    float16 loss scale; in a pipeline the backward is labelled as micro-batch ``k``'s
    backward task. Linear, so valid under any SBP."""

    name = "loss scaling"

    @contextlib.contextmanager
    def scope(self, ctx):
        m = ctx.micro_batches

        def factor():
            f = None if m == 1 else 1.0 / m
            if ctx.scaler is not None:
                f = ctx.scaler[0] if f is None else ctx.scaler[0] * f
            return f

        @contextlib.contextmanager
        def scaled(t):
            from ..tensor import Tensor

            mark("backward (torch autograd: local kernels; the boxing duals and gradient "
                 "reductions below)")
            with passes.task("B", ctx.micro_batch, ctx.labelled):
                f = factor()
                if f is not None and t.numel() == 1:
                    t = Tensor(t._local * f, t.placement, t.sbp, t.shape) if t.is_global \
                        else Tensor(t._local * f)
                yield t

        ctx.backward_scopes.append(scaled)
        try:
            yield
        finally:
            ctx.backward_scopes.remove(scaled)


class Update(StepTransform):
    """The optimizers' update inside the program (the graph's ``_update``: unscale and
    agree on inf/nan under float16, clip, each optimizer's step with eager mode's kernels,
    ``zero_grad``, the loss scale's update)."""

    name = "update"

    def enabled(self, ctx):
        return bool(ctx.graph._optimizers)

    def finish(self, ctx):
        mark("optimizer update (unscale, clip, the optimizers' steps, zero_grad)")
        ctx.graph._update(ctx.scaler)


STEP_TRANSFORMS: tuple[StepTransform, ...] = (
    GradientAccumulation(), Autocast(), ActivationCheckpointing(), ZeroSharding(),
    TiedParameters(), LossScaling(), Update())


def traced_step(ctx: CompileContext, build: Callable, args: tuple, kwargs: dict,
                params: list) -> Callable:
    """The step :func:`sbpflow.graph.trace.trace_program` traces: ``build`` per
    micro-batch under the enabled :data:`STEP_TRANSFORMS` (first outermost), then their
    ``finish`` in list order; returns the outputs combined over the micro-batches
    (:func:`sbpflow.graph.passes.combine`). ``.grad`` of ``params`` lives inside the
    program: cleared before and after.

    With ``ctx.replication`` only micro-batches ``0``, ``1`` and ``m - 1`` run ``build``
    (each cut of the inputs is traced, and stand-ins of the left-out micro-batches'
    outputs); :func:`sbpflow.graph.passes.replicate_micro_batches` copies micro-batch 1
    into the others afterwards, with the transfer numbers recorded here."""
    from ..distributed._state import _state as dstate

    active = [t for t in STEP_TRANSFORMS if t.enabled(ctx)]
    m = ctx.micro_batches
    rep = ctx.replication
    traced = range(m) if rep is None else rep.traced

    def drop_grads():
        for p in params:
            p.grad = None

    def step(*_inputs):
        outs = []
        drop_grads()
        with contextlib.ExitStack() as stack:
            for t in active:
                stack.enter_context(t.scope(ctx))
            for k in range(m):
                with passes.task("I", k, ctx.labelled):
                    a, kw = passes.micro_batch(args, kwargs, m, k)
                if k not in traced:
                    with passes.task("O", k, ctx.labelled):
                        outs.append(passes.stand_in(outs[1]))
                    continue
                if rep is not None and k == 1:
                    rep.seq_before = dstate.p2p_seq
                mark("forward" + (f" of micro-batch {k + 1}/{m}" if m > 1 else ""))
                ctx.micro_batch = k
                with contextlib.ExitStack() as per:
                    for t in active:
                        per.enter_context(t.micro_batch(ctx, k, k == m - 1))
                    per.enter_context(passes.task("F", k, ctx.labelled))
                    outs.append(build(*a, **kw))
                if rep is not None and k == 1:
                    rep.seq_after = dstate.p2p_seq
        # the scopes are closed (autocast off, ZeRO's gathered copies gone and their
        # gradients moved to the parameters): the update task
        with passes.task("U", 0, ctx.labelled):
            for t in active:
                t.finish(ctx)
            out = passes.combine(outs)
        drop_grads()
        if rep is not None:  # the copies' transfers are numbered after the whole trace's
            rep.seq_end = dstate.p2p_seq
        return out

    return step


# ============================================================================ program passes


@dataclass(frozen=True)
class ProgramPass:
    """A pass over the traced per-rank program: ``run(gm, ctx) -> gm`` where
    ``enabled(ctx)``."""

    name: str
    run: Callable
    enabled: Callable = lambda ctx: True


def _pipeline(gm, ctx):
    return passes.pipeline(gm, ctx.actions, ctx.stage_of, ctx.neighbours, ctx.pipe_rank,
                           recompile=False)


def _settle(gm, ctx):
    from . import verify

    return verify.hold(verify.settle(gm, recompile=False), recompile=False)


PROGRAM_PASSES: tuple[ProgramPass, ...] = (
    ProgramPass("replicate micro-batches",
                lambda gm, ctx: passes.replicate_micro_batches(gm, ctx.replication,
                                                               recompile=False),
                lambda ctx: ctx.replication is not None),
    ProgramPass("strip", lambda gm, ctx: passes.strip(gm, recompile=False)),
    ProgramPass("empty values", lambda gm, ctx: passes.empty_values(gm, recompile=False)),
    ProgramPass("dead code", lambda gm, ctx: passes.dead_code(gm, recompile=False)),
    ProgramPass("pipeline", _pipeline, lambda ctx: ctx.actions is not None),
    ProgramPass("overlap", lambda gm, ctx: passes.overlap(gm, recompile=False),
                lambda ctx: ctx.config.overlap),
    ProgramPass("settle and hold", _settle),
)


def run_program_passes(gm: torch.fx.GraphModule, ctx: CompileContext) -> torch.fx.GraphModule:
    """:data:`PROGRAM_PASSES`, in order, those enabled for ``ctx``; the program's Python
    code is generated once, after the last (each pass edits the graph only: generating
    the code of a pipelined GPT's 20,000 nodes took about 0.2 s a pass)."""
    for p in PROGRAM_PASSES:
        if p.enabled(ctx):
            gm = p.run(gm, ctx)
    gm.recompile()
    return gm
