"""``sbpflow.nn.Graph``: compile a training or evaluation step once per input signature,
then run it as each rank's ``torch.fx`` program (OneFlow's ``nn.Graph`` API).

Example::

    class TrainGraph(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, lr_sch=scheduler)
            self.config.set_gradient_accumulation_steps(4)

        def build(self, x, y):
            loss = self.model(x, y)
            loss.backward()
            return loss

    g = TrainGraph()
    loss = g(x, y)          # first call: traced (runs the step for real), later: replayed
    loss.mean()             # under accumulation a 0-d output is packed, one value per
                            # micro-batch (shape (4,) here), as OneFlow's nn.Graph packs it

See ARCHITECTURE "Graph mode" for the design, :mod:`sbpflow.graph.trace` for what is
traced and :mod:`sbpflow.graph.passes` for the passes and their order.
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from dataclasses import dataclass, field

import torch

from ..distributed import _comm, get_world_size, timeout_s
from ..nn.module import Module
from ..tensor import Tensor
from . import compiler, passes, show, verify
from .config import GraphConfig, GraphModule
from .trace import GraphError, Slot, trace_program

__all__ = ["Graph"]

log = logging.getLogger("sbpflow.graph")


def _first_compiled_call_note(seconds: float) -> str:
    """Added to an error raised in the first call of a compiled program (multi-rank)."""
    return (f"(sbpflow: this was the first call of a compiled program, which compiles its "
            f"pieces as it reaches them, between its collectives: {seconds:.1f}s on this "
            f"rank. A rank that compiles a piece for longer than the collective timeout "
            f"(SBPFLOW_TIMEOUT, {timeout_s():g}s) makes its peers' collectives time "
            f"out; raise SBPFLOW_TIMEOUT above the compile time if this is a timeout)")


@dataclass
class Program:
    """One compiled signature: the per-rank program and how to feed it."""

    fn: object  # the fx GraphModule, or its torch.compile'd form
    gm: torch.fx.GraphModule
    slots: list[Slot]
    out_spec: object
    out_meta: list
    out_consts: list
    signature: str
    agreement: str  # what every rank checks at each call
    events: list = field(default_factory=list)
    trace_s: float = 0.0
    verify_s: float = 0.0  # the verifier's seconds at compile time (verify + order check)
    compile_s: float | None = None
    calls: int = 0


def _leaves(tree) -> list:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(tree)


def _describe_leaf(x) -> str:
    if isinstance(x, Tensor):
        dt = str(x.dtype).replace("torch.", "")
        if x.is_global:
            from ..sbp import format_nd_sbp

            return f"{tuple(x.shape)}:{dt}@{x.placement.ranks.tolist()}{format_nd_sbp(x.sbp)}"
        return f"{tuple(x.shape)}:{dt}@local"
    if isinstance(x, torch.Tensor):
        raise GraphError(f"nn.Graph inputs are sbpflow tensors; got a torch.Tensor of shape "
                         f"{tuple(x.shape)}: wrap it with sbpflow.from_torch(t) (local) or make "
                         f"it global with sbpflow.tensor(t, placement=..., sbp=...)")
    return repr(x)


class Graph:
    """A compiled step (OneFlow's ``nn.Graph``). Subclass it, assign modules as
    attributes, optionally :meth:`add_optimizer`, and define :meth:`build`.

    Calling the graph compiles ``build`` for the input signature (the global shapes,
    dtypes, placements and nd-SBPs of the tensor arguments, the values of the others, the
    modules' train/eval modes and ``config``) on first sight, then replays. The first call
    runs the step for real while it is traced; a new signature compiles again (logged on
    ``sbpflow.graph`` at INFO, counted in :attr:`compiles`). Every rank of the world
    calls the graph, with the same signature.

    A training graph (one with an optimizer) runs, per call: forward and backward of
    ``build`` (once per micro-batch), the gradient reductions, gradient clipping of the
    parameter groups that set ``clip_grad_max_norm`` (OneFlow's option, see
    :func:`_clip`), the optimizers' update
    (the kernels an eager ``step()`` runs: torch's fused kernels for optimizers built
    with ``fused=True``, else the for-loop or foreach ones; learning rates read from
    ``param_group["lr"]`` at each call),
    ``zero_grad``, then each LR scheduler's ``step()`` (outside the program). ``.grad`` is
    not kept between calls (it lives inside the program).

    Raises (at call time):
        GraphError: inputs on another placement than the graph's parameters, local and
            global mixed, ranks calling with different signatures, unsupported optimizer.
        GraphTraceError: ``build`` reads a tensor's value (``.item()``, ``if loss > 0:``,
            ``numpy()``).
    """

    def __init__(self) -> None:
        self.config = GraphConfig()
        self._optimizers: list[tuple[object, object]] = []
        self._scaler = None
        self._programs: dict[tuple, Program] = {}
        self._lr: dict[int, list[torch.Tensor]] = {}
        self._zero: tuple | None = None  # (stage, min size) once applied
        self._zero3: dict[int, tuple] = {}  # id(param) -> gathered nd-SBP (ZeRO-3)
        self._zero12: dict[int, tuple] = {}  # the same for ZeRO-1/2 (gathered per step)
        self._built_for: tuple = ()  # _structure() when the programs were compiled
        self._fused_hparams: dict[int, list[dict]] = {}  # id(optimizer) -> group settings
        self._debug = 0
        self.compiles = 0
        self._auto = None  # sbpflow.planner.auto.AutoPlan once searched

    # ------------------------------------------------------------------ OneFlow's API
    def build(self, *args, **kwargs):
        """The step: forward (and ``loss.backward()`` in a training graph); returns
        tensors (and constants). Override it."""
        raise NotImplementedError(f"{type(self).__name__} must define build(self, ...)")

    def add_optimizer(self, optim, *, lr_sch=None, is_sparse: bool = False) -> None:
        """Make this a training graph stepping ``optim`` (an sbpflow optimizer: SGD, Adam
        or AdamW) after each call's backward, and ``lr_sch.step()`` after each call.

        Raises:
            GraphError: not an sbpflow optimizer, or ``is_sparse`` (no sparse updates in
                graphs yet).
        """
        from ..optim import Optimizer

        if not isinstance(optim, Optimizer):
            raise GraphError(f"add_optimizer: expected an sbpflow.optim optimizer (SGD, Adam, "
                             f"AdamW), got {type(optim).__name__}")
        if is_sparse:
            raise GraphError("add_optimizer(is_sparse=True): sparse updates are not supported "
                             "in nn.Graph")
        if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise GraphError("add_optimizer(lr_sch=ReduceLROnPlateau): the graph steps its "
                             "scheduler without a metric; pass lr_sch=None and call "
                             "scheduler.step(val_loss) yourself (the graph reads the learning "
                             "rates at every call)")
        _check_optimizer(optim)
        self._optimizers.append((optim, lr_sch))

    def set_grad_scaler(self, grad_scaler) -> None:
        """Loss scaling for float16 AMP: a ``sbpflow.amp.GradScaler`` (dynamic: the scale
        halves after a step with inf/nan gradients, which is skipped on every rank, and
        doubles after ``growth_interval`` good steps) or OneFlow's ``StaticGradScaler`` /
        ``DynamicGradScaler``. Inside the program: the loss is multiplied by the scale,
        the gradients unscaled, the inf/nan verdict all-reduced (MAX) over the world, the
        fused update skipped where it is set, and the scale updated
        (``torch._amp_update_scale_``)."""
        self._scaler = grad_scaler

    @property
    def training(self) -> bool:
        """Whether this is a training graph (it has an optimizer)."""
        return bool(self._optimizers)

    def debug(self, v_level: int = 0, *, ranks=None, max_py_stack_depth: int = 2,
              only_user_py_stack: bool = True, op_repr_with_py_stack: bool = False) -> None:
        """Verbosity (OneFlow's API): at level >= 1, rank 0 (or ``ranks``) prints each
        compilation, the torch.compile time and the logical graph when compiled; every
        level logs compilations on the ``sbpflow.graph`` logger (INFO). The other
        arguments are accepted for OneFlow compatibility."""
        from ..distributed import get_rank

        if ranks is None:
            ranks = [0]
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        self._debug = v_level if get_rank() in ranks else -1

    def state_dict(self) -> dict:
        """The modules' and optimizers' state, as eager checkpoints hold it:
        ``{attribute name: module.state_dict(), "_optimizers": [optim.state_dict(),
        ...]}`` (global tensors; ``sbpflow.save`` writes it and eager code loads it)."""
        sd = {name: m.state_dict() for name, m in self._modules().items()}
        sd["_optimizers"] = [o.state_dict() for o, _ in self._optimizers]
        return sd

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Load :meth:`state_dict`'s form (from a graph or from eager modules and
        optimizers saved under the same names)."""
        mods = self._modules()
        for name, m in mods.items():
            if name in state_dict:
                m.load_state_dict(state_dict[name], strict=strict)
            elif strict:
                raise KeyError(f"load_state_dict: no state for module {name!r}")
        for (o, _), st in zip(self._optimizers, state_dict.get("_optimizers", [])):
            o.load_state_dict(st)
            _check_optimizer(o)
            if self._programs:
                _init_state(o)  # the compiled programs read the new state at their next call

    # ------------------------------------------------------------------ call
    @property
    def auto_parallel_plan(self):
        """The layouts automatic parallelism chose (:class:`sbpflow.planner.auto.AutoPlan`:
        ``print()`` it for the explanation, ``to_dict()`` for the data), or None before
        the first call or without ``config.enable_auto_parallel()``."""
        return self._auto

    def __call__(self, *args, **kwargs):
        if self.config.auto_parallel and self._auto is None:
            self._auto_parallel(args, kwargs)
        args, kwargs = self._planned_inputs(args, kwargs)
        leaves = list(args) if not kwargs and all(type(a) is Tensor for a in args) else \
            _leaves((args, kwargs))
        if self._programs:
            self._check_unchanged()
        key = self._key(leaves, kwargs)
        program = self._programs.get(key)
        if program is None:
            sig = ", ".join(_describe_leaf(x) for x in leaves)
            self._check_placements(leaves)
            # one agreement check per call replaces the per-collective checks of eager
            # mode: the same program on every rank issues the same collectives
            _comm.check_agreement(self._agreement(sig, key))
            # a training step needs autograd while it is traced, whatever the caller's mode
            with torch.enable_grad() if self.training else contextlib.nullcontext():
                out = self._compile(key, sig, args, kwargs)
        else:
            _comm.check_agreement(program.agreement)
            out = self._run(program, leaves)
        for _, sch in self._optimizers:
            if sch is not None:
                sch.step()
        return out

    def lower(self, *args, **kwargs):
        """The logical graph of this graph's step on inputs like ``args``/``kwargs``
        (:class:`sbpflow.graph.ir.LogicalGraph`; one micro-batch under gradient
        accumulation): every global op with its chosen SBP signature, the runner-up and
        their costs, every boxing with its plan and bytes, the backward's reductions.
        ``print()`` it. Built from meta stand-ins: no data moves, no parameter, buffer or
        optimizer state changes, nothing is compiled. Call it on every rank (as the graph).

        Raises:
            GraphError: called while another graph traces; a pipeline graph (modules put
                in stages with ``set_stage``): not built yet.
            GraphTraceError: ``build()`` reads a tensor's value.
        """
        from . import ir

        args, kwargs = self._planned_inputs(args, kwargs)
        self._check_placements(_leaves((args, kwargs)))
        modules = [m for mod in self._modules().values() for m in mod.modules()]
        if _stages(modules):
            raise GraphError(f"{type(self).__name__}.lower(): the logical graph of a pipeline "
                             f"(modules put in stages with set_stage) is not built yet; lower "
                             f"the graph without set_stage to see its ops and layouts")
        with torch.enable_grad() if self.training else contextlib.nullcontext():
            return ir.build(self, args, kwargs, _device_of(modules))

    def _planned_inputs(self, args, kwargs):
        """The call's inputs boxed to the layouts automatic parallelism chose (as given
        without a plan)."""
        if self._auto is None:
            return args, kwargs
        from ..planner import auto

        return auto.box_inputs(self._auto, args, kwargs)

    def _auto_parallel(self, args, kwargs) -> None:
        """Search the free layouts (:mod:`sbpflow.planner.auto`) and apply them to the
        parameters; the inputs are boxed at every call."""
        from ..planner import auto

        name = type(self).__name__
        modules = [m for mod in self._modules().values() for m in mod.modules()]
        if _stages(modules):
            raise GraphError(f"{name}: enable_auto_parallel with pipeline stages (set_stage) "
                             f"is not supported; lay the stages out by hand or drop "
                             f"set_stage")
        params = [p for m in modules for p in m._parameters.values() if p is not None]
        pls = {p.placement for p in params if p.is_global}
        if not params or any(not p.is_global for p in params) or len(pls) != 1:
            raise GraphError(
                f"{name}: enable_auto_parallel searches layouts on the parameters' placement;"
                f" lay the model out on one placement first, e.g. model.to_global("
                f"placement, sbpflow.sbp.broadcast) (found {len(pls)} placement(s), "
                f"{sum(not p.is_global for p in params)} local parameter(s))")
        pl = next(iter(pls))
        self._check_placements(_leaves((args, kwargs)))
        device = _device_of(modules)
        hw = auto.resolve_hardware(self.config.auto_parallel_hardware, device)
        ranks = sorted(int(r) for r in pl.ranks.flatten().tolist())
        given = self.config.auto_parallel_plan
        with torch.enable_grad() if self.training else contextlib.nullcontext():
            plan = auto.search(self, args, kwargs, pl, hw, device, ranks) if given is None \
                else auto.given(self, args, kwargs, pl, hw, device, ranks, given)
        auto.apply(self, plan)
        self._auto = plan
        self._log(str(plan))

    def _agreement(self, sig: str, key: tuple) -> str:
        """What every rank compares before a call: the graph, its input signature, and a
        checksum of the rest of the cache key (keyword names, the modules' train/eval
        modes, the config), so ranks that would run different programs stop at once."""
        rest = zlib.crc32(repr(key[1:]).encode())
        modes = key[2]
        return (f"nn.Graph {type(self).__name__}({sig}) [keywords {list(key[1])}, "
                f"{sum(modes)} modules training / {len(modes) - sum(modes)} in eval, "
                f"config and modes checksum {rest:08x}]")

    def _structure(self) -> tuple:
        """What the compiled programs were built over and a call cannot take in without
        tracing again: the modules themselves (a replaced submodule), their parameter
        objects, ``requires_grad`` flags and layouts (placement and nd-SBP: another
        graph's automatic parallelism, or ``to_global``, may re-lay a shared model out),
        the optimizers with their param groups and clipping settings, the grad scaler.
        (Learning rates, optimizer state and buffers are read at every call.)"""
        mods = [m for mod in self._modules().values() for m in mod.modules()]
        params = (tuple(map(id, mods)),
                  tuple((id(p), p.requires_grad, p._placement, p._sbp)
                        for m in mods for p in m._parameters.values() if p is not None))
        opts = tuple((id(opt), tuple((tuple(map(id, g["params"])),
                                      g.get("clip_grad_max_norm"),
                                      g.get("clip_grad_norm_type")) for g in opt.param_groups))
                     for opt, _ in self._optimizers)
        return params, opts, id(self._scaler)

    def _check_unchanged(self) -> None:
        """Before a call of a compiled graph: trace again (all signatures) if
        :meth:`_structure` changed since the programs were built (a parameter replaced,
        ``add_param_group``, ``add_optimizer``, ``set_grad_scaler``, clipping settings),
        and refuse a change that a program bakes in (hyper-parameters of torch's fused
        kernels)."""
        now = self._structure()
        if now != self._built_for:
            what = [w for w, a, b in zip(("the modules or their parameters", "the "
                                          "optimizers or their param groups",
                                          "the grad scaler"),
                                         now, self._built_for) if a != b]
            self._log(f"{type(self).__name__}: {' and '.join(what)} changed since the "
                      f"graph compiled; compiling again")
            self._programs.clear()
            self.__dict__.pop("_all_modules", None)  # the key reads the modules' modes
            return
        for opt, _ in self._optimizers:
            if not _all_fused(opt):
                continue  # the optimizer's own step reads its groups at every call
            for g, before in zip(opt.param_groups, self._fused_hparams[id(opt)]):
                changed = {k: (before[k], g.get(k)) for k in before if g.get(k) != before[k]}
                if changed:
                    k, (was, now_v) = next(iter(changed.items()))
                    raise GraphError(
                        f"{type(opt).__name__}(fused=True): param group setting {k!r} changed "
                        f"from {was!r} to {now_v!r} after the graph compiled; torch's fused "
                        f"kernel takes it as a constant of the program. Use fused=False (the "
                        f"default: the graph runs the optimizer's own step, which reads its "
                        f"settings at every call), or build a new graph")

    def _key(self, leaves, kwargs=None) -> tuple:
        """The cache key: each leaf's (global shape, dtype, placement, nd-SBP) or value,
        the modules' train/eval modes, the settings. A float (or complex) is keyed by its
        bits (``float.hex``), not by ``==``: -0.0 is not 0.0 (a program compiled for one
        gives ``1 / (x * s)`` of the wrong sign for the other) and NaN is NaN (by ``==``
        a NaN argument never found its program and compiled again at every call)."""
        parts = []
        for x in leaves:
            if type(x) is Tensor or isinstance(x, Tensor):
                parts.append((x._shape, x._local.dtype, x._placement, x._sbp))
            elif isinstance(x, (float, complex)):
                parts.append((type(x), float(x.real).hex(), float(x.imag).hex()))
            else:
                try:
                    hash(x)
                    parts.append((type(x), x))
                except TypeError:
                    parts.append((type(x), repr(x)))
        mods = self.__dict__.get("_all_modules")
        if mods is None:
            mods = [m for mod in self._modules().values() for m in mod.modules()]
        names = tuple(kwargs) if kwargs else ()  # g(x, add=t) is not g(x, mul=t)
        return (tuple(parts), names, tuple(m.training for m in mods), self.config.key())

    def _run(self, program: Program, leaves):
        self._fill_lr()
        for opt, _ in self._optimizers:  # parameters written since (load_state_dict)
            opt.sync_masters()
        inputs = [x._local for x in leaves if isinstance(x, Tensor)]
        flat = [s.get() for s in program.slots] + inputs
        t0 = time.perf_counter() if program.compile_s is None and \
            program.fn is not program.gm else None
        try:
            with torch.no_grad():
                outs = program.fn(*flat)
        except Exception as e:
            if t0 is not None and get_world_size() > 1:
                e.add_note(_first_compiled_call_note(time.perf_counter() - t0))
            raise
        if t0 is not None:
            program.compile_s = time.perf_counter() - t0
            self._log(f"{type(self).__name__}: torch.compile of the program took "
                      f"{program.compile_s:.1f}s (first compiled call)")
        program.calls += 1
        for opt, _ in self._optimizers:
            opt.sync_masters(written=True)
        return _unflatten(program, outs)

    # ------------------------------------------------------------------ compile
    def _modules(self) -> dict[str, Module]:
        return {k: v for k, v in vars(self).items() if isinstance(v, Module)}

    def _check_placements(self, leaves) -> None:
        if _stages(m for mod in self._modules().values() for m in mod.modules()):
            return  # pipeline stages: each staged module boxes its inputs to its placement
        params = [p for m in self._modules().values() for p in m.parameters()]
        pls = {p.placement for p in params if p.is_global}
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        if len(pls) != 1:
            return  # local graph, or parameters on several placements (stages)
        pl = next(iter(pls))
        for i, x in enumerate(tensors):
            if x.is_local:
                raise GraphError(
                    f"{type(self).__name__}: input {i} is a local tensor but the graph's "
                    f"parameters are global on {pl!r}; make it global first, e.g. "
                    f"x.to_global(placement, sbpflow.sbp.split(0))")
            if x.placement != pl:
                raise GraphError(
                    f"{type(self).__name__}: input {i} lives on {x.placement!r} but the "
                    f"graph's parameters on {pl!r}; move it with x.to_global(placement="
                    f"{pl!r}, sbp=...) before calling the graph")

    def _compile(self, key, sig: str, args, kwargs, replicate: bool = True):
        name = type(self).__name__
        self._log(f"{name}: compiling for inputs ({sig})")
        mods = self._modules()
        all_modules = [m for mod in mods.values() for m in mod.modules()]
        self._all_modules = all_modules
        self._stages = _stages(all_modules)
        actions = self._plan() if self._stages else None
        self._actions = actions
        scaler = _scaler_tensors(self._scaler) if self.config.amp_dtype is torch.float16 \
            else None
        ctx = compiler.CompileContext(
            self, self.config, all_modules, _device_of(all_modules), scaler, actions,
            self._stage_of if actions is not None else None,
            self._neighbours if actions is not None else frozenset(),
            self._pipe_rank if actions is not None else None)
        m = self.config.grad_acc_steps
        if replicate and self.config.replicate_micro_batches and m >= 4:
            ctx.replication = passes.Replication(m)
        self._prepare(ctx)
        slots = self._slots(mods)
        leaves = _leaves((args, kwargs))
        inputs = [x for x in leaves if isinstance(x, Tensor)]
        params = passes.unique(p for mod in all_modules for p in mod._parameters.values()
                               if p is not None)
        step = compiler.traced_step(ctx, self.build, args, kwargs, params)
        saved = _snapshot([s.get() for s in slots] + [x._local for x in inputs]) \
            if ctx.replication is not None else None
        t0 = time.perf_counter()
        traced = trace_program(name, step, slots, inputs, node_meta=ctx.labelled,
                               stack_traces=self.config.record_stack_traces,
                               anchors=[type(self).build], context=ctx)
        trace_s = time.perf_counter() - t0
        try:
            gm = compiler.run_program_passes(traced.gm, ctx)
            failed = None
        except passes.NotReplicable as e:
            failed = e
        if ctx.replication is not None:
            from ..distributed import _state as dstate

            _restore(saved)  # the trace ran 3 of the m micro-batches: undo its update
            world = list(range(get_world_size()))
            if any(f for (f,) in _comm.all_gather_meta([failed is not None], world)):
                why = failed or "on another rank"
                log.warning(
                    f"{name}: micro-batch 1 cannot stand for the others ({why}); tracing "
                    f"all {m} micro-batches (build() runs again: if it keeps Python state "
                    f"between micro-batches, set config.enable_micro_batch_replication("
                    f"False))")
                return self._compile(key, sig, args, kwargs, replicate=False)
            dstate._state.p2p_seq = ctx.replication.seq_final
            traced.events = _replicated_events(traced.events, m)
        verify_s = 0.0
        if self.config.verify:
            t0 = time.perf_counter()
            rep = verify.verify(gm, what=f"program of {name}")
            verify.check_order(gm, what=f"program of {name}")
            verify_s = time.perf_counter() - t0
            self._log(f"{name}: verifier: {rep.collectives} collectives and {rep.transfers} "
                      f"transfers over {rep.nodes} nodes checked in {verify_s * 1e3:.1f} ms")
        fn = passes.compile_program(gm, verify.post_grad_check(self.config.verify)) \
            if self.config.compile else gm
        program = Program(fn, gm, slots, traced.out_spec, traced.out_meta, traced.out_consts,
                          sig, self._agreement(sig, key), traced.events, trace_s, verify_s)
        self._programs[key] = program
        self._built_for = self._structure()
        self._fused_hparams = {
            id(opt): [{k: v for k, v in g.items() if k not in _READ_EACH_CALL}
                      for g in opt.param_groups] for opt, _ in self._optimizers}
        self.compiles += 1
        if self._debug >= 1:
            print(show.describe(self, program))
        if ctx.replication is not None:  # the call's results: the whole step, replayed
            return self._run(program, leaves)
        return _unflatten(program, traced.outputs)

    def _plan(self) -> list:
        """Pipeline: check the stages, build every pipeline rank's actions
        (:func:`sbpflow.runtime.schedules.build`: compute, sends and receives, the update
        last), check them by :func:`~sbpflow.runtime.schedules.simulate` before any rank
        runs (``self._timeline``: its timeline with unit task times) and return this
        rank's list of :class:`~sbpflow.runtime.schedules.Action`.

        Raises:
            GraphError: stages that cannot form a pipeline (placements, ids, ranks).
            ScheduleError: a plan that deadlocks or does not match up (a bug in a
                schedule's generator), raised on every rank alike, before any transfer.
        """
        from ..distributed import get_rank
        from ..runtime import schedules

        cfg = self.config
        by_id: dict[int, object] = {}
        for _mod, pl, sid in self._stages:
            if by_id.setdefault(sid, pl) != pl:
                raise GraphError(f"set_stage: stage {sid} is given two placements, "
                                 f"{by_id[sid]!r} and {pl!r}; one stage has one placement")
        ids = sorted(by_id)
        if ids != list(range(len(ids))):
            raise GraphError(f"set_stage: stage ids must be 0, 1, ..., n-1; got {ids}")
        v = _virtual_stages(cfg, ids, by_id)
        if len(ids) % v:
            raise GraphError(f"set_pipeline_schedule('interleaved', virtual_stages={v}): the "
                             f"{len(ids)} stages must be {v} per rank, a multiple of {v}")
        p = len(ids) // v
        for sid in ids[p:]:  # interleaved: stage s runs on the ranks of stage s % p
            if by_id[sid] != by_id[sid % p]:
                raise GraphError(
                    f"set_pipeline_schedule('interleaved', virtual_stages={v}): stage {sid} "
                    f"runs on the ranks of stage {sid % p} ({by_id[sid % p]!r}), got "
                    f"{by_id[sid]!r}; with {p} ranks' stages, stage s goes where stage s % "
                    f"{p} is")
        world = get_world_size()
        seen: dict[int, int] = {}
        for sid in ids[:p]:
            for r in by_id[sid].ranks.flatten().tolist():
                if r in seen:
                    raise GraphError(f"set_stage: rank {r} is in stage {seen[r]} and stage "
                                     f"{sid}; stages run on disjoint placements")
                seen[r] = sid
        missing = sorted(set(range(world)) - set(seen))
        if missing:
            raise GraphError(f"set_stage: rank(s) {missing} of the world of {world} are in no "
                             f"stage; give every rank a stage (or launch fewer ranks)")
        if not self._optimizers:
            raise GraphError("pipeline stages need a training graph (add_optimizer); an "
                             "evaluation runs the stages one after another eagerly")
        for opt, _ in self._optimizers:  # state made before set_stage moved the parameters
            opt.relayout()
        self._stage_of = {r: ", ".join(str(s) for s in range(sid, len(ids), p))
                          for r, sid in seen.items()}
        me = seen[get_rank()]
        self._neighbours = frozenset(r for r, sid in seen.items() if abs(sid - me) == 1)
        self._pipe_rank = dict(seen)  # global rank -> pipeline rank (an action's peer)
        try:
            plan = schedules.build(cfg.pipeline_schedule, p, cfg.grad_acc_steps, v)
        except ValueError as e:
            raise GraphError(f"set_pipeline_schedule({cfg.pipeline_schedule!r}) with {p} "
                             f"pipeline ranks: {e}") from e
        self._timeline = schedules.simulate(plan)  # ScheduleError: deadlock, mismatch
        return plan[me]

    def _prepare(self, ctx) -> None:
        """Once per compilation, before the trace: the step transforms' layouts (ZeRO),
        optimizer state."""
        for t in compiler.STEP_TRANSFORMS:
            if t.enabled(ctx):
                t.prepare(ctx)
        if self._zero is not None:
            for opt, _ in self._optimizers:  # the new layouts, or a param group added since
                opt.relayout()
        for opt, _ in self._optimizers:
            opt.sync_masters()
            _init_state(opt)
            self._lr.setdefault(id(opt), [torch.tensor(float(g["lr"]), dtype=torch.float64)
                                          for g in opt.param_groups])
        self._fill_lr()

    def _fill_lr(self) -> None:
        for opt, _ in self._optimizers:
            for t, g in zip(self._lr[id(opt)], opt.param_groups):
                lr = g["lr"]
                t.fill_(float(lr) if not isinstance(lr, torch.Tensor) else lr.item())

    def _slots(self, mods: dict[str, Module]) -> list[Slot]:
        slots, seen = [], set()

        def add(kind, name, get):
            t = get()
            if t is None or id(t) in seen:
                return
            seen.add(id(t))
            slots.append(Slot(kind, name, get))

        for mname, mod in mods.items():
            for pname, p in mod.named_parameters():
                add("param", f"{mname}.{pname}", lambda p=p: p._local)
            for m_name, m in mod.named_modules():
                for bname, b in m._buffers.items():
                    if b is not None:
                        add("buffer", f"{mname}.{m_name}.{bname}".replace("..", "."),
                            lambda m=m, bname=bname: m._buffers[bname]._local)
        # Looked up at every call, not captured: the optimizer's load_state_dict replaces
        # its param groups and state dicts (and so the tensors the program must update).
        for k, (opt, _) in enumerate(self._optimizers):
            for gi, group in enumerate(opt.param_groups):
                for i in range(len(group["params"])):
                    add("master", f"optimizer{k}.group{gi}.param{i}",
                        lambda opt=opt, gi=gi, i=i: opt.param_groups[gi]["params"][i])
                    st = opt.state[group["params"][i]]
                    for sk in list(st):
                        if isinstance(st[sk], torch.Tensor):
                            add("opt_state", f"optimizer{k}.group{gi}.param{i}.{sk}",
                                lambda opt=opt, gi=gi, i=i, sk=sk:
                                opt.state[opt.param_groups[gi]["params"][i]][sk])
            for gi, t in enumerate(self._lr[id(opt)]):
                add("lr", f"optimizer{k}.group{gi}.lr", lambda t=t: t)
        sc = _scaler_tensors(self._scaler)
        if sc is not None:
            add("scaler", "grad_scaler.scale", lambda: sc[0])
            add("scaler", "grad_scaler.growth_tracker", lambda: sc[1])
        return slots

    def _update(self, scaler) -> None:
        """The optimizers' update inside the program: unscale and agree on inf/nan
        (float16), clip, each optimizer's step with the kernels eager mode uses (torch's
        fused kernels with tensor learning rates where every param group sets
        ``fused=True``, else the optimizer's own step as one program op:
        :func:`sbpflow.graph.passes.optimizer_step`), zero_grad, the loss scale's update."""
        if not any(p.grad is not None for opt, _ in self._optimizers
                   for p in opt.sbpflow_params):
            raise GraphError(
                f"{type(self).__name__}.build produced no gradient for any parameter of its "
                f"optimizers: a training graph (add_optimizer) must call loss.backward() in "
                f"build; an evaluation graph has no optimizer")
        found = None
        if scaler is not None:
            scale, growth = scaler
            found = torch.zeros((), dtype=torch.float32, device=scale.device)
            inv = scale.double().reciprocal().float()
            for opt, _ in self._optimizers:
                opt.load_grads()
                grads = [t.grad for g in opt.param_groups for t in g["params"]
                         if t.grad is not None]
                by_dtype: dict = {}
                for gr in grads:
                    by_dtype.setdefault((gr.dtype, gr.device), []).append(gr)
                for group in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
            world = tuple(range(get_world_size()))
            if len(world) > 1:
                found = _comm.all_reduce(found, world, op="max")
        for opt, _ in self._optimizers:
            _clip(opt)
            if _all_fused(opt):  # torch's fused kernels, as eager runs them
                with _fused(opt, self._lr[id(opt)], found):
                    opt.step()
            else:  # the for-loop or foreach kernels, as eager runs them
                passes.optimizer_step(opt, found)
            opt.zero_grad(set_to_none=True)
        if scaler is not None and _dynamic(self._scaler):
            sc = self._scaler
            torch._amp_update_scale_(scale, growth, found, sc.get_growth_factor(),
                                     sc.get_backoff_factor(), sc.get_growth_interval())

    def _log(self, msg: str) -> None:
        log.info(msg)
        if self._debug > 0:
            print(msg)

    def __repr__(self) -> str:
        if not self._programs:
            mods = ", ".join(self._modules())
            return (f"{type(self).__name__}(not compiled yet: call it once; modules: {mods}; "
                    f"{self.config!r})")
        plan = [str(self._auto)] if self._auto is not None else []
        return "\n\n".join(plan + [show.describe(self, p) for p in self._programs.values()])


# ---------------------------------------------------------------------- helpers


def _stages(modules) -> list[tuple[Module, object, int]]:
    """``(module, placement, stage id)`` of the modules put in a pipeline stage; a module
    set without a placement (OneFlow's ``set_stage(k)``) takes the placement of another
    module of its stage.

    Raises:
        GraphError: a stage none of whose modules has a placement."""
    staged = []
    for mod in modules:
        gmod = mod.__dict__.get("_graph_module")
        if gmod is not None and gmod.stage_id is not None:
            staged.append((mod, gmod))
    known = {g.stage_id: g.stage_placement for _, g in staged if g.stage_placement is not None}
    out = []
    for mod, gmod in staged:
        pl = gmod.stage_placement
        if pl is None:
            pl = known.get(gmod.stage_id)
            if pl is None:
                raise GraphError(
                    f"set_stage({gmod.stage_id}) of {type(mod).__name__}: no module of stage "
                    f"{gmod.stage_id} has global parameters to take a placement from; lay "
                    f"the stage's modules out with to_global(placement, ...) or give it: "
                    f"set_stage(stage_id, placement)")
            gmod.stage_placement = pl
            from ..runtime.stages import place_stage

            place_stage(mod, gmod)
        out.append((mod, pl, gmod.stage_id))
    return out


def _virtual_stages(cfg, ids: list, by_id: dict) -> int:
    """Model chunks per rank: 1 outside the interleaved schedule; else the explicit
    ``virtual_stages``, or inferred from the placements (``p`` distinct placements in
    stage order, stage ``s`` on stage ``s % p``'s: ``len(ids) / p``).

    Raises:
        GraphError: an explicit ``virtual_stages`` that the placements contradict."""
    if cfg.pipeline_schedule != "interleaved":
        return 1
    distinct = []
    for sid in ids:
        if by_id[sid] in distinct:
            break
        distinct.append(by_id[sid])
    p = len(distinct)
    inferred = len(ids) // p if len(ids) % p == 0 and all(
        by_id[sid] == by_id[sid % p] for sid in ids) else None
    v = cfg.virtual_stages
    if v is None:
        if inferred is None:
            raise GraphError(
                f"set_pipeline_schedule('interleaved'): the {len(ids)} stages' placements do "
                f"not repeat with a period: stage s must be placed where stage s % p is, "
                f"for the p = {p} distinct placements of stages 0..{p - 1}")
        return inferred
    if inferred is not None and inferred != v:
        raise GraphError(
            f"set_pipeline_schedule('interleaved', virtual_stages={v}): the stages' "
            f"placements give {inferred} per rank ({len(ids)} stages on {p} placements); "
            f"drop virtual_stages to use the placements, or place the stages for {v}")
    return v


def _device_of(modules) -> str:
    for m in modules:
        for p in m._parameters.values():
            if p is not None:
                return p.device.type
    return "cpu"


def _snapshot(tensors: list) -> tuple:
    """Copies of ``tensors`` (on the CPU) and of the generators' states, for
    :func:`_restore`."""
    cuda = any(t.is_cuda for t in tensors)
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
    return [(t, t.detach().to("cpu", copy=True)) for t in tensors], rng


def _restore(saved: tuple) -> None:
    """Write back what :func:`_snapshot` copied (in place: the same tensors)."""
    pairs, (cpu, cuda) = saved
    with torch.no_grad():
        for t, v in pairs:
            t.copy_(v)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _replicated_events(events: list, m: int) -> list:
    """The logical graph of a step traced with micro-batches left out
    (:class:`sbpflow.graph.passes.Replication`): micro-batch 1's events (from its
    heading to micro-batch ``m``'s) repeated as micro-batches ``2 .. m - 2``."""
    heads = [i for i, e in enumerate(events) if isinstance(e, str) and
             e.startswith("forward of micro-batch ")]
    if len(heads) < 3:
        return events
    one = events[heads[1]:heads[2]]
    copies = [f"forward of micro-batch {k + 1}/{m}" if isinstance(e, str) and
              e == f"forward of micro-batch 2/{m}" else e
              for k in range(2, m - 1) for e in one]
    return events[:heads[2]] + copies + events[heads[2]:]


def _unflatten(program: Program, outs):
    from torch.utils import _pytree as pytree

    leaves, consts = [], iter(program.out_consts)
    outs = iter(outs)
    for meta in program.out_meta:
        if meta is None:
            leaves.append(next(consts))
        elif meta[0] == "local":
            leaves.append(Tensor(next(outs)))
        elif meta[0] == "torch":
            leaves.append(next(outs))
        else:
            pl, sbp, shape = meta
            leaves.append(Tensor(next(outs), pl, sbp, shape))
    return pytree.tree_unflatten(leaves, program.out_spec)


def _check_optimizer(opt) -> None:
    """The optimizers a graph runs (torch's fused kernels with tensor learning rates, or
    the optimizer's own step as one program op)."""
    if not isinstance(opt, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
        raise GraphError(f"nn.Graph runs SGD, Adam and AdamW; got "
                         f"{type(opt).__name__}")
    for g in opt.param_groups:
        if isinstance(opt, torch.optim.SGD) and g.get("momentum", 0) and g.get("dampening", 0):
            raise GraphError("nn.Graph: SGD with momentum and dampening != 0 is not supported "
                             "(torch's first step skips the dampening); use dampening=0")
        if g.get("differentiable"):
            raise GraphError("nn.Graph: differentiable=True optimizers are not supported")


#: Param-group keys a compiled program reads at every call (or never).
_READ_EACH_CALL = frozenset({"params", "lr", "initial_lr", "max_lr", "min_lr", "base_lr",
                             "param_names"})


def _all_fused(opt) -> bool:
    """Whether every param group of ``opt`` runs torch's fused kernel (``fused=True``)."""
    return all(g.get("fused") for g in opt.param_groups)


def _init_state(opt) -> None:
    """Create the optimizer state torch would create at its first step, so that the
    program updates it in place (torch creates it lazily, which a replay would not
    repeat). SGD's momentum buffer starts at zeros: with dampening 0 the first update
    ``0 * momentum + grad`` equals torch's ``buf = grad``. Step counts live where torch
    keeps them: on the parameter's device for the fused kernels, else on the CPU."""
    for group in opt.param_groups:
        for t in group["params"]:
            st = opt.state[t]
            if isinstance(opt, torch.optim.SGD):
                if group.get("momentum", 0) and st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(t, memory_format=torch.
                                                             preserve_format)
                continue
            on = t.device if group.get("fused") or group.get("capturable") else \
                torch.device("cpu")
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device=on)
                st["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(
                        t, memory_format=torch.preserve_format)
            elif not isinstance(st["step"], torch.Tensor):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32,
                                          device=on)
            elif st["step"].device != on:
                st["step"] = st["step"].to(on)


def _clip(opt) -> None:
    """OneFlow's gradient clipping option: parameter groups with ``clip_grad_max_norm``
    (and ``clip_grad_norm_type``, default 2) have their gradients scaled so that their
    norm is at most that (:func:`sbpflow.nn.utils.clip_grad_norm_`, over every rank's
    shards) before the update. Groups with the same settings are clipped together, by
    their joint norm (as one ``clip_grad_norm_`` over all their parameters)."""
    from ..nn.utils import clip_grad_norm_

    sets: dict = {}
    for g in opt.param_groups:
        max_norm = g.get("clip_grad_max_norm")
        if max_norm is None or max_norm <= 0:
            continue
        key = (float(max_norm), float(g.get("clip_grad_norm_type", 2.0)))
        sets.setdefault(key, []).extend(opt.param_of(t) for t in g["params"])
    for (max_norm, norm_type), params in sets.items():
        clip_grad_norm_(params, max_norm, norm_type)


@contextlib.contextmanager
def _fused(opt, lrs: list[torch.Tensor], found_inf):
    """Inside the trace: the optimizer's groups use torch's fused kernel with the graph's
    learning-rate tensors (and the AMP inf/nan flag); restored after."""
    saved = [(g["lr"], g.get("fused"), g.get("foreach")) for g in opt.param_groups]
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"], g["fused"], g["foreach"] = lr, True, False
    opt.grad_scale, opt.found_inf = None, found_inf
    try:
        yield
    finally:
        for g, (lr, fused, foreach) in zip(opt.param_groups, saved):
            g["lr"], g["fused"], g["foreach"] = lr, fused, foreach
        del opt.grad_scale, opt.found_inf


def _scaler_tensors(scaler):
    """(scale, growth tracker) tensors of a torch-style GradScaler, created if needed."""
    if scaler is None:
        return None
    if getattr(scaler, "_scale", None) is None:
        scaler._lazy_init_scale_growth_tracker(torch.device(getattr(scaler, "_device",
                                                                    "cpu")))
    return scaler._scale, scaler._growth_tracker


def _dynamic(scaler) -> bool:
    return getattr(scaler, "dynamic", True)


# OneFlow's GraphModule lives in sbpflow.nn.graph with the Graph
__all__ += ["GraphModule"]
