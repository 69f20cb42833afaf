"""``nn.Graph``'s settings: :class:`GraphConfig` (``graph.config``) and the per-module
:class:`GraphModule` (``module.to(GraphModule)``), OneFlow's API.

Settings are read when a graph compiles (its first call with an input signature);
changing one afterwards compiles again at the next call (the settings are part of the
cache key).
"""

from __future__ import annotations

import torch

__all__ = ["GraphConfig", "GraphModule"]


#: ``enable_zero``'s default ``shard_min_size`` (OneFlow's): smaller parameters stay whole.
ZERO_MIN_SIZE = 1024


class GraphConfig:
    """What ``self.config`` of an :class:`sbpflow.nn.Graph` turns on. Each setting is one
    pass of the compiler (see :mod:`sbpflow.graph.passes`, in the order listed there).

    Attributes (read-only views of the settings):
        grad_acc_steps: micro-batches per call (1: none).
        amp_dtype: ``torch.float16``/``torch.bfloat16`` when AMP is on, else None.
        zero_stage: 0 (off), 1, 2 or 3.
        compile: hand the per-rank program to ``torch.compile``.
    """

    def __init__(self) -> None:
        self.grad_acc_steps = 1
        self.amp_dtype: torch.dtype | None = None
        self.zero_stage = 0
        self.zero_min_size = 1
        self.compile = False
        self.overlap = True
        self.verify = True  # the compile-time verifier (sbpflow.graph.verify)
        # Record each program node's Python stack while tracing (the verifier's messages
        # then name the user's source line); off by default: it slows tracing.
        self.record_stack_traces = False
        self.pipeline_schedule = "1f1b"
        self.virtual_stages = 1
        self.replicate_micro_batches = True
        self.hints: dict[str, object] = {}
        # automatic parallelism (sbpflow.planner.auto)
        self.auto_parallel = False
        self.auto_parallel_ignore_user_sbp = False
        self.auto_parallel_compute_ratio = 1.0
        self.auto_parallel_wait_time = 0.0
        self.auto_parallel_memory_limit: int | None = None
        self.auto_parallel_search_time = 10.0
        self.auto_parallel_hardware = None
        self.auto_memory = 0
        self.auto_parallel_plan = None

    def set_gradient_accumulation_steps(self, value: int) -> None:
        """Split each call's inputs into ``value`` micro-batches along dim 0 inside the
        graph: forward and backward run once per micro-batch, gradients are summed and
        reduced across ranks once, the optimizer steps once. Each micro-batch's loss is
        scaled by ``1 / value`` before backward, so the gradient is that of the mean
        micro-batch loss (the whole batch's gradient for a mean loss; a sum-reduced loss
        gets ``1 / value`` of its gradient, as in OneFlow, DeepSpeed and Megatron). The
        call packs the outputs as OneFlow does: each 0-d output becomes a 1-D tensor of
        ``value`` entries, one per micro-batch (``loss.mean()`` is the step's loss), and
        the micro-batches' other outputs are concatenated along dim 0. OneFlow's API.

        Raises:
            ValueError: ``value`` is not an integer >= 1.
        """
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"set_gradient_accumulation_steps: expected an integer >= 1, "
                             f"got {value!r}")
        self.grad_acc_steps = value

    def enable_amp(self, mode: bool = True, *, dtype: torch.dtype = torch.float16) -> None:
        """Automatic mixed precision: the step runs under ``torch.autocast`` with ``dtype``
        (torch's op lists decide what runs in low precision). With ``float16`` give the
        graph a loss scaler (:meth:`sbpflow.nn.Graph.set_grad_scaler`). OneFlow's API
        (OneFlow's default dtype is float16 too).

        Raises:
            ValueError: a dtype other than float16 or bfloat16.
        """
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"enable_amp: dtype must be torch.float16 or torch.bfloat16, got "
                             f"{dtype}")
        self.amp_dtype = dtype if mode else None

    def enable_zero(self, mode: bool = True, *, stage: int = 2,
                    shard_min_size: int = ZERO_MIN_SIZE, shard_restore_level: int = 1) -> None:
        """ZeRO (Rajbhandari et al. 2020) as layout rewrites, over every mesh axis on
        which a parameter is broadcast (the data-parallel axes):

        * stage 1 and 2: optimizer state and an fp32 master shard laid out ``S(0)``;
          gradients reduce-scattered (``P -> S(0)``) instead of all-reduced, the updated
          shards all-gathered back into the parameter. sbpflow's stage 1 also keeps
          gradients sharded (the reduce-scatter moves half an all-reduce's bytes; OneFlow
          stage 1 all-reduces);
        * stage 3: parameters themselves stored ``S(0)``, all-gathered just before the
          module that uses them, not kept for backward (gathered again there), gradients
          arrive reduce-scattered by the dual rule.

        Parameters with fewer than ``shard_min_size`` elements stay unsharded (OneFlow's
        default 1024). ``shard_restore_level`` is accepted for OneFlow compatibility.

        Raises:
            ValueError: ``stage`` not 1, 2 or 3, or a negative ``shard_min_size``.
        """
        if stage not in (1, 2, 3):
            raise ValueError(f"enable_zero: stage must be 1, 2 or 3, got {stage!r}")
        if shard_min_size < 0:
            raise ValueError(f"enable_zero: shard_min_size must be >= 0, got {shard_min_size}")
        self.zero_stage = stage if mode else 0
        self.zero_min_size = int(shard_min_size)

    def enable_compile(self, mode: bool = True) -> None:
        """Hand each rank's program to ``torch.compile`` (inductor: fused kernels on CPU,
        and CUDA graphs on GPU). Off by default; the compile time is reported by
        ``print(graph)``. sbpflow's addition (OneFlow fuses by its own passes)."""
        self.compile = bool(mode)

    def enable_micro_batch_replication(self, mode: bool = True) -> None:
        """With 4 or more micro-batches (gradient accumulation, a pipeline), trace only
        micro-batches 0, 1 and the last, and copy micro-batch 1's forward and backward as
        the others (default on): the first call takes about 3/m of the trace time. The
        copies are exact when ``build()`` does the same thing for every micro-batch, as a
        training step does; a step whose Python code branches on the call count or
        keeps Python state per micro-batch should turn it off. Micro-batch 1's values
        used elsewhere than by the next micro-batch or as outputs (checked) make the
        graph trace every micro-batch instead. The traced micro-batches' effects
        (parameters, optimizer state, buffers, generators) are undone and the whole
        step then runs once from the program; meanwhile a copy of that state is held in
        host memory (once per compilation). sbpflow's addition."""
        self.replicate_micro_batches = bool(mode)

    def enable_overlap(self, mode: bool = True) -> None:
        """Start each collective as early as its inputs allow and wait for it only where
        its result is first used (default on); off keeps the traced order."""
        self.overlap = bool(mode)

    def set_pipeline_schedule(self, schedule: str = "1f1b", *,
                              virtual_stages: int | None = None) -> None:
        """The order of the pipeline stages' forward and backward tasks when modules are
        put in stages (``GraphModule.set_stage``); the micro-batches are the gradient
        accumulation steps. ``"1f1b"`` (default: stage ``s`` holds at most
        ``stages - s`` micro-batches' activations), ``"gpipe"`` (all forwards, then all
        backwards: activations of every micro-batch at once), ``"interleaved"`` with
        ``virtual_stages`` model chunks per rank (the bubble shrinks by that factor),
        ``"zero_bubble"`` (ZB-H1, Qi et al. 2024: each backward split into the input
        gradient ``B``, which the previous stage waits for, and the weight gradient ``W``,
        run later to fill the bubble; 1F1B's activations in flight, a third of its bubble
        with equal task times). Each schedule is a generator of per-rank action lists in
        :mod:`sbpflow.runtime.schedules`, checked by its simulator when the graph compiles
        and run as listed (:func:`sbpflow.graph.passes.pipeline`).

        Raises:
            ValueError: an unknown schedule, ``virtual_stages`` < 1, or > 1 without
                ``"interleaved"``.
        """
        from ..runtime.schedules import SCHEDULES

        if schedule not in SCHEDULES:
            raise ValueError(f"set_pipeline_schedule: schedule must be one of "
                             f"{sorted(SCHEDULES)}, got {schedule!r}")
        if virtual_stages is not None and (
                isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or
                virtual_stages < 1):
            raise ValueError(f"set_pipeline_schedule: virtual_stages must be an integer >= 1,"
                             f" got {virtual_stages!r}")
        if virtual_stages is not None and virtual_stages > 1 and schedule != "interleaved":
            raise ValueError(f"set_pipeline_schedule: virtual_stages={virtual_stages} needs "
                             f"schedule='interleaved', got {schedule!r}")
        self.pipeline_schedule, self.virtual_stages = schedule, virtual_stages

    # ------------------------------------------------------------------ auto-parallel
    def enable_auto_parallel(self, mode: bool = True) -> None:
        """Let sbpflow choose the layouts (OneFlow's API): at the first call, before the
        trace, every layout left free is searched on the graph's placement by pricing
        each candidate's logical graph (:func:`sbpflow.planner.auto.search`); the chosen
        layouts are then applied to the parameters (in place, as OneFlow does: the same
        Parameter objects, the optimizers' state re-laid out) and to the inputs at every
        call, and every op's signature follows from them. Free: a parameter or input laid
        out broadcast on every mesh axis (the layout ``to_global(placement, B)`` gives);
        any other layout the user gave is kept unless
        :meth:`enable_auto_parallel_ignore_user_sbp_config`. ``print(graph)`` and
        ``graph.auto_parallel_plan`` explain the choice. Needs global parameters on one
        placement; pipeline stages are not searched.

        Raises:
            TypeError: ``mode`` not a bool (``enable_auto_parallel("no")`` would be on).
        """
        self.auto_parallel = _flag("enable_auto_parallel", mode)

    def enable_auto_parallel_ignore_user_sbp_config(self, mode: bool = True) -> None:
        """With auto-parallel: search every parameter's and input's layout, also those
        the user gave another layout than broadcast (OneFlow's API; ``to_global`` calls
        inside ``build()`` are kept either way)."""
        self.auto_parallel_ignore_user_sbp = _flag(
            "enable_auto_parallel_ignore_user_sbp_config", mode)

    def set_auto_parallel_computation_cost_ratio(self, ratio: float) -> None:
        """Weight of the predicted compute seconds against the communication seconds in
        the search's objective (OneFlow's API; default 1.0: both are seconds of the
        calibrated or named hardware profile, so OneFlow's default 0.05 for its own units
        does not carry over).

        Raises:
            ValueError: ``ratio`` not a finite number >= 0.
        """
        self.auto_parallel_compute_ratio = _non_negative("set_auto_parallel_computation_"
                                                         "cost_ratio", ratio)

    def set_auto_parallel_wait_time(self, seconds: float) -> None:
        """Extra seconds charged per collective in the search's objective, on top of the
        profile's latency (OneFlow's API: its fixed cost per transfer; default 0).

        Raises:
            ValueError: ``seconds`` not a finite number >= 0.
        """
        self.auto_parallel_wait_time = _non_negative("set_auto_parallel_wait_time", seconds)

    def set_auto_parallel_memory_limit(self, bytes_per_rank: int | None) -> None:
        """Refuse layouts predicted to need more than ``bytes_per_rank`` bytes on a rank
        (parameters, gradients, optimizer state and activations; see
        :func:`sbpflow.planner.predict.predict_memory`). None (default): on CUDA the
        device's free memory at the search, on CPU no limit. sbpflow's addition. When no
        layout fits, the first call raises GraphError naming the smallest memory found.

        Raises:
            ValueError: not a positive integer or None.
        """
        import numbers

        if bytes_per_rank is not None and (isinstance(bytes_per_rank, bool) or
                                           not isinstance(bytes_per_rank, numbers.Integral) or
                                           bytes_per_rank <= 0):
            raise ValueError(f"set_auto_parallel_memory_limit: expected a positive number of "
                             f"bytes per rank or None, got {bytes_per_rank!r}")
        self.auto_parallel_memory_limit = None if bytes_per_rank is None else \
            int(bytes_per_rank)

    def set_auto_parallel_search_time(self, seconds: float) -> None:
        """Stop improving the layout after ``seconds`` of search (default 10; the best
        layout found so far is taken, and the explanation says the search was cut). Time
        spent timing ops on this machine (a measured profile's: each new op and shape
        once per process) is not search and is left out; the explanation reports it.
        sbpflow's addition.

        Raises:
            ValueError: ``seconds`` not a finite number > 0.
        """
        v = _non_negative("set_auto_parallel_search_time", seconds)
        if v == 0:
            raise ValueError("set_auto_parallel_search_time: expected seconds > 0, got 0")
        self.auto_parallel_search_time = v

    def set_auto_parallel_hardware(self, hardware) -> None:
        """The hardware profile the search prices layouts on: a
        :class:`sbpflow.planner.Hardware`, a profile name (``"h100"``) or a JSON file
        (``sbpflow calibrate``'s). None (default): on CUDA the named profile of the device
        where one matches its name, else (and on CPU) this machine's calibration for the
        world size, measured once (a few seconds, ``--quick`` sizes) and cached when
        none is. sbpflow's addition.

        Raises:
            ValueError: a name or file that is no readable profile (names the known ones).
        """
        from ..planner.hardware import Hardware, load

        if hardware is not None and not isinstance(hardware, Hardware):
            load(str(hardware))  # raises now rather than at the first call
        self.auto_parallel_hardware = hardware

    def set_auto_parallel_plan(self, plan) -> None:
        """Run a plan instead of searching: ``plan`` is a JSON file written by
        ``graph.auto_parallel_plan.save(path)`` or ``sbpflow plan`` (edited by hand or
        not), or its dict. At the first call it is checked against the graph (its mesh,
        parameter names, input indices, each layout against its tensor; GraphError
        naming the entry otherwise), priced for the explanation, and applied as given;
        parameters and inputs it does not name keep their layouts. Turns
        :meth:`enable_auto_parallel` on; None turns the plan off (the search runs).
        sbpflow's addition.

        Raises:
            ValueError: a file that cannot be read or a plan of the wrong form
                (:func:`sbpflow.planner.plan_file.read_plan`: unknown keys, a mesh that is not
                a list, layouts that are not strings, nothing named).
        """
        if plan is not None:
            from ..planner.plan_file import read_plan

            read_plan(plan)  # its form now; whether it fits the graph at the first call
        self.auto_parallel_plan = plan
        if plan is not None:
            self.auto_parallel = True

    def enable_auto_memory(self, mode=True) -> None:
        """Trade predicted speed for memory in the auto-parallel search (OneFlow's API):
        ``mode`` 0/False off (default), 1/True, 2 or 3: among the layouts predicted
        within 5%, 10% or 15% of the fastest, take the one needing the least memory.

        Raises:
            ValueError: another mode.
        """
        m = int(mode) if isinstance(mode, (bool, int)) else mode
        if m not in (0, 1, 2, 3):
            raise ValueError(f"enable_auto_memory: mode must be 0-3 or a bool, got {mode!r}")
        self.auto_memory = m

    # OneFlow's search-algorithm switches: sbpflow's search prices whole logical graphs, so
    # these are recorded and otherwise have no effect.
    def enable_auto_parallel_trunk_algo(self, mode: bool = True) -> None:
        """OneFlow auto-parallel hint: accepted, no effect."""
        self.hints["auto_parallel_trunk_algo"] = mode

    enable_auto_parallel_mainstem_algo = enable_auto_parallel_trunk_algo

    def enable_auto_parallel_sbp_collector(self, mode: bool = True) -> None:
        """OneFlow auto-parallel hint: accepted, no effect."""
        self.hints["auto_parallel_sbp_collector"] = mode

    # OneFlow's kernel-fusion hints: sbpflow fuses with torch.compile (enable_compile), so
    # these are recorded and otherwise have no effect.
    def allow_fuse_add_to_output(self, mode: bool = True) -> None:
        """OneFlow fusion hint: accepted, no effect (use :meth:`enable_compile`)."""
        self.hints["fuse_add_to_output"] = mode

    def allow_fuse_model_update_ops(self, mode: bool = True) -> None:
        """OneFlow fusion hint: accepted, no effect (optimizer updates are torch's fused
        kernels in a graph already)."""
        self.hints["fuse_model_update_ops"] = mode

    def allow_fuse_cast_scale(self, mode: bool = True) -> None:
        """OneFlow fusion hint: accepted, no effect (use :meth:`enable_compile`)."""
        self.hints["fuse_cast_scale"] = mode

    def enable_cudnn_conv_heuristic_search_algo(self, mode: bool = True) -> None:
        """OneFlow cuDNN hint: accepted, no effect (torch's cuDNN settings apply)."""
        self.hints["cudnn_conv_heuristic"] = mode

    def key(self) -> tuple:
        """What a compiled program depends on."""
        return (self.grad_acc_steps, self.amp_dtype, self.zero_stage, self.zero_min_size,
                self.compile, self.overlap, self.pipeline_schedule, self.virtual_stages,
                self.replicate_micro_batches, self.auto_parallel)

    def __repr__(self) -> str:
        on = [f"gradient_accumulation_steps={self.grad_acc_steps}"]
        if self.amp_dtype is not None:
            on.append(f"amp={str(self.amp_dtype).replace('torch.', '')}")
        if self.zero_stage:
            on.append(f"zero_stage={self.zero_stage}, shard_min_size={self.zero_min_size}")
        if self.compile:
            on.append("compile")
        if not self.overlap:
            on.append("overlap=off")
        if self.auto_parallel:
            on.append("auto_parallel")
        return f"GraphConfig({', '.join(on)})"


def _flag(what: str, mode) -> bool:
    import numbers

    if not isinstance(mode, (bool, numbers.Integral)):
        raise TypeError(f"{what}: expected True or False, got {mode!r}")
    return bool(mode)


def _non_negative(what: str, value) -> float:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: expected a finite number >= 0, got {value!r}")
    return float(value)


class GraphModule:
    """A module's settings inside an ``nn.Graph`` (OneFlow's API):
    ``m = module.to(sbpflow.nn.graph.GraphModule)``, then

    * ``m.activation_checkpointing = True``: the module's activations are not kept for
      backward; its forward runs again in backward (``torch.utils.checkpoint``,
      non-reentrant), random draws included: the recomputation restores the generator
      state, so dropout masks are the forward's;
    * ``m.set_stage(stage_id, placement)``: the pipeline stage: the module's parameters
      and buffers move to ``placement`` at once (their SBP kept where the mesh shapes
      agree, else broadcast), and its inputs are boxed there whenever it runs. Without a
      placement (OneFlow's form) the stage keeps the placement its parameters already
      have (the module was laid out with ``to_global``); a module without global
      parameters takes the placement of another module of the same stage. OneFlow's
      deprecated ``m.stage_id = k`` is ``m.set_stage(k)`` with a ``DeprecationWarning``
      (:func:`sbpflow.runtime.stages.place_stage`); eagerly the stages run one after
      another, in a graph each rank runs its stage's forward and backward tasks in the
      schedule's order (:meth:`GraphConfig.set_pipeline_schedule`).

    One object per module (``module.to(GraphModule)`` returns the same each time); the
    settings act only when the module runs inside a graph.
    """

    _sbpflow_graph_module = True  # how Module.to recognises the class (nn is below graph)

    def __init__(self, module) -> None:
        self.module = module
        self.activation_checkpointing = False
        self._stage_id: int | None = None
        self.stage_placement = None
        self.stage_hooks = None  # the stage's forward hooks, once placed

    @classmethod
    def of(cls, module) -> GraphModule:
        """The settings of ``module`` (created on first use)."""
        gm = module.__dict__.get("_graph_module")
        if gm is None:
            gm = cls(module)
            object.__setattr__(module, "_graph_module", gm)
        return gm

    @property
    def stage_id(self) -> int | None:
        """The pipeline stage (:meth:`set_stage`), or None."""
        return self._stage_id

    @stage_id.setter
    def stage_id(self, value: int) -> None:
        import warnings

        warnings.warn("GraphModule.stage_id = k is deprecated (as in OneFlow); use "
                      "set_stage(k) (the placement is optional: set_stage(k, placement))",
                      DeprecationWarning, stacklevel=2)
        self.set_stage(value)

    def set_stage(self, stage_id: int, placement=None) -> None:
        """Put the module in pipeline stage ``stage_id`` on ``placement`` (default: the
        placement its global parameters and buffers already have).

        Raises:
            ValueError: a negative ``stage_id``; the module already set to another stage
                (a module belongs to one stage: split it, or share its parameters); no
                placement given and the module's tensors on several placements.
        """
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
            raise ValueError(f"set_stage: stage_id must be an integer >= 0, got {stage_id!r}")
        if placement is None:
            placement = _own_placement(self.module)
        if self._stage_id is not None and (self._stage_id, self.stage_placement) != \
                (stage_id, placement):
            raise ValueError(
                f"set_stage: {type(self.module).__name__} is already in stage {self._stage_id}"
                f" ({self.stage_placement!r}); a module runs in one stage: give each stage "
                f"its own module")
        self._stage_id, self.stage_placement = stage_id, placement
        if placement is not None:
            from ..runtime.stages import place_stage

            place_stage(self.module, self)

    def __repr__(self) -> str:
        parts = []
        if self.activation_checkpointing:
            parts.append("activation_checkpointing=True")
        if self._stage_id is not None:
            parts.append(f"stage={self._stage_id}")
        return f"GraphModule({type(self.module).__name__}{', ' if parts else ''}" \
               f"{', '.join(parts)})"


def _own_placement(module):
    """The one placement of ``module``'s global parameters and buffers; None when it has
    none (the stage's other modules give it one).

    Raises:
        ValueError: they live on several placements."""
    pls = {t.placement for t in (*module.parameters(), *module.buffers()) if t.is_global}
    if len(pls) > 1:
        raise ValueError(f"set_stage: {type(module).__name__}'s parameters live on "
                         f"{len(pls)} placements ({sorted(map(repr, pls))}); give the stage's "
                         f"placement: set_stage(stage_id, placement)")
    return pls.pop() if pls else None
