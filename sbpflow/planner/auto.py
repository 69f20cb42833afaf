"""Automatic parallelism: choose the layouts a user left free by pricing whole logical
graphs (``graph.config.enable_auto_parallel()``; OneFlow's API).

**What is searched.** The graph's free layouts, grouped into *decisions*:

* each module owning parameters that has a tensor-parallel form: a ``Linear`` (broadcast,
  :class:`~sbpflow.nn.parallel.ColwiseParallel`: weight and bias ``S(0)``, or
  :class:`~sbpflow.nn.parallel.RowwiseParallel`: weight ``S(1)``, bias ``B``) and an
  ``Embedding``/``EmbeddingBag`` (broadcast, rows ``S(0)``, columns ``S(1)``), on each mesh
  axis of more than one rank (the other axes broadcast); a split is offered only when it
  divides the dimension. Modules at the same place of repeated blocks
  (``blocks.0.mlp.c_fc``, ``blocks.1.mlp.c_fc``: the name with its block numbers as ``*``,
  the same class and parameter shapes) are **one decision**: every block takes the same
  layout (the layers of a ``Sequential``, ``net.0``, ``net.2``, are not tied). A module
  whose parameters an earlier decision already lays out (a tied LM head) follows it.
  Other parameters (norms, convolutions, biases of no Linear) stay broadcast.
* the tensor inputs, grouped by their first dimension (the batch): broadcast, or split on
  dim 0 over any set of mesh axes (data parallel over those axes).
* the ZeRO stage (none, 2, 3: :meth:`sbpflow.graph.config.GraphConfig.enable_zero`'s sharding of
  the optimizer state, gradients and parameters over the axes where a parameter is
  broadcast), for a training graph with an optimizer whose own stage is not set (a stage
  the user set is kept). The chosen stage is set on the graph with the layouts. Stage 1
  is not offered: sbpflow's stage 1 shards the gradients too and is the same program as
  stage 2 (priced alike; the search would only break the tie).

Free means laid out broadcast on every mesh axis (what ``to_global(placement, B)``
gives): other layouts the user gave are kept (constraints) unless
``enable_auto_parallel_ignore_user_sbp_config``. Every op's SBP signature follows from
these layouts by sbpflow's chooser, as in any run: the layouts the search prices are the
program that runs.

**How a candidate is priced.** Its logical graph is built (:func:`sbpflow.graph.ir.build`
with the candidate's layouts on the meta stand-ins: nothing moves or runs; ~0.1 s for a
small GPT) and priced by :func:`sbpflow.planner.predict.predict_step` (compute: each op's
forward and backward, measured on this machine or by the roofline; the optimizer's
update; communication: every boxing and collective of forward and backward at its ring
cost) and :func:`sbpflow.planner.predict.predict_memory`. Objective: ``ratio x (compute
+ update) + communication + wait x collectives`` seconds
(``set_auto_parallel_computation_cost_ratio``, ``set_auto_parallel_wait_time``); a
candidate over the memory limit is ranked by its memory, after every one that fits. The
first candidate is priced by every rank; when the ranks predict the same memory and
communication for it (every split even: one program alike on every rank) and the
profile prices ops by the roofline (no rank's own timings in the figure), they share
the work from then on, each pricing its own candidate and exchanging the results (N
ranks price N candidates in the time of one; a candidate whose graph needs the other
ranks while built is priced again by all, and sharing stops). Otherwise (ops timed on
this machine: the ranks' timings differ with the load) every rank prices every
candidate and the largest of their predictions is taken (a step waits for its slowest
rank). Every rank sees the same results, so all choose alike.

**Search.** Coordinate descent from data parallel (parameters broadcast, the batch split
over every axis): each decision's every other option, then each pair of consecutive
module decisions (forward order) moved together onto one mesh axis (a column-split
Linear pays only beside a row-split one: Megatron's pair), repeated until no move
improves or the time limit (``set_auto_parallel_search_time``, default 10 s) is reached
(the time spent timing ops on this machine, each new op and shape once per process, is
a measurement of the machine, not search: left out of the limit and reported beside it;
so is a rank's wait for peers timing theirs: the limit counts each round's slowest
pricing).
A move is taken as soon as it gains 1%; while the current layout is over the memory
limit, a sweep prices every move and takes the one that saves the most memory; when the
descent ends with nothing that fits, it goes on from the least memory the memory
decisions give (ZeRO-3, every block recomputed). A last pass takes each decision back to
data parallel's option where that fits within 1% of the chosen (ties to the simpler). When
every assignment of the decisions can be priced in half the search time (judged from
the first layouts' time; at most 4096), the search prices them all instead and is exact
(a layout within 1% of a simpler one, nearer data parallel, does not replace it).
Recomputing a block cannot make a step faster in this objective (it only adds ops,
boxings and calls; with a computation cost ratio of at least 1, no negative wait, no
``enable_auto_memory``), so the exact search counts and prices recomputation only for
the layouts over the memory limit without it.
Not exhaustive: a local optimum over single and paired moves; the explanation lists, for
each decision, its options priced with every other decision as chosen (the last sweep
prices them all when the search was not cut).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..graph.config import ZERO_MIN_SIZE
from ..graph.trace import GraphError
from ..sbp import broadcast, split
from ..tensor import Tensor
from .plan_file import (
    PLAN_KEYS,
    _layout_entries,
    pipeline_plan,
    plan_argument_error,
    plan_mesh,
    read_plan,
    save_plan,
)

__all__ = ["PLAN_KEYS", "AutoPlan", "MemoryLimitError", "Option", "PlanError", "Variable",
           "apply", "assignment", "box_inputs", "given", "graph_optimizer", "parse_layout",
           "pipeline_plan", "plan_argument_error", "plan_mesh", "pricing_dtype", "read_plan",
           "resolve_hardware", "search", "state_per_param", "variables"]


class PlanError(GraphError):
    """A plan given to a graph (``set_auto_parallel_plan``, ``--plan FILE``) does not fit
    it: another mesh, a parameter or module it does not have, a layout its tensor cannot
    take (the message names the entry and the fix)."""


class MemoryLimitError(GraphError):
    """No layout the search found fits the memory limit: ``limit`` and ``least`` (the
    smallest memory any priced layout needs), bytes per rank; ``cut``: the search time
    (seconds) when it ran out first (more time may find one), else 0."""

    def __init__(self, message: str, limit: int, least: int, cut: float = 0.0):
        super().__init__(message)
        self.limit, self.least, self.cut = limit, least, cut


#: Every assignment is priced (the search is exact) when that is predicted to take at
#: most this share of the search time, from the time the first layouts took.
_EXACT_SHARE = 0.5
_EXACT_MAX = 4096  # and at most this many

#: The relative improvement a move must make: ops timed on this machine vary by a few
#: percent between measurements, so a layout within 1% of the current one is a tie, and
#: ties keep the current (simpler: data parallel's side) layout.
_EPS = 0.01


@dataclass(frozen=True)
class Option:
    """One layout of a decision: ``label`` (``"B"``, ``"ColwiseParallel"``, ``"S(0)"``,
    with ``" on mesh axis a"`` on a 2-D mesh) and ``layouts``: ``((key, nd-SBP), ...)``
    where a key is ``("param", qualified name)`` or ``("input", i)`` (the ``i``-th tensor
    input)."""

    label: str
    layouts: tuple

    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage this option sets (the ZeRO decision's), else None."""
        return next((nd[0] for k, nd in self.layouts if k[0] == "zero"), None)

    @property
    def axis(self) -> int | None:
        """The mesh axis this option splits on (None: broadcast, or several axes)."""
        axes = {a for k, nd in self.layouts if k[0] in ("param", "input")
                for a, s in enumerate(nd) if s.is_split()}
        return next(iter(axes)) if len(axes) == 1 else None


@dataclass
class Variable:
    """A decision: ``name`` (a module-name pattern, or ``inputs ...``), ``kind``
    (``"module"`` or ``"inputs"``), ``members`` (the module or input names it lays out),
    ``options`` and ``start`` (data parallel's option)."""

    name: str
    kind: str
    members: list
    options: list
    start: int = 0


def _nd(ndim: int, axis: int, sbp) -> tuple:
    nd = [broadcast] * ndim
    nd[axis] = sbp
    return tuple(nd)


def _free(t, ignore_user: bool) -> bool:
    return ignore_user or all(s == broadcast for s in t.sbp)


def _module_options(kind: str, mod, prefix: str, pl) -> list[tuple[str, dict]]:
    """``[(label, {param qualified name: nd-SBP})]`` beyond broadcast for one module."""
    w = mod._parameters.get("weight")
    b = mod._parameters.get("bias")
    if w is None or w.ndim != 2:
        return []
    out = []
    for a in range(pl.ndim):
        n = pl.shape[a]
        if n == 1:
            continue
        on = f" on mesh axis {a}" if pl.ndim > 1 else ""
        if kind == "Linear":
            if w.shape[0] % n == 0:
                lay = {prefix + "weight": _nd(pl.ndim, a, split(0))}
                if b is not None:
                    lay[prefix + "bias"] = _nd(pl.ndim, a, split(0))
                out.append(("ColwiseParallel" + on, lay))
            if w.shape[1] % n == 0:
                out.append(("RowwiseParallel" + on, {prefix + "weight": _nd(pl.ndim, a,
                                                                            split(1))}))
        elif kind in ("Embedding", "EmbeddingBag"):
            if w.shape[0] % n == 0:
                out.append(("RowwiseParallel (rows)" + on,
                            {prefix + "weight": _nd(pl.ndim, a, split(0))}))
            if w.shape[1] % n == 0:
                out.append(("ColwiseParallel (columns)" + on,
                            {prefix + "weight": _nd(pl.ndim, a, split(1))}))
    return out


def _input_tensors(args, kwargs) -> list:
    from torch.utils import _pytree as tpytree

    flat, _ = tpytree.tree_flatten((args, kwargs))
    return [x for x in flat if isinstance(x, Tensor)]


def variables(graph, args, kwargs, placement, ignore_user: bool = False) -> list[Variable]:
    """The decisions of ``graph`` on inputs like ``args``/``kwargs`` (see the module doc),
    module decisions in the order their modules are registered (forward order for
    models written top down), the inputs' last."""
    groups: dict[tuple, list] = {}
    owned: set[int] = set()
    for top_name, top in graph._modules().items():
        for name, mod in top.named_modules():
            own = [(n, p) for n, p in mod._parameters.items() if p is not None]
            if not own:
                continue
            kind = type(mod).__name__
            full = ".".join(x for x in (top_name, name) if x)
            if any(id(p) in owned for _, p in own):
                continue  # tied to an earlier decision's parameter (an LM head)
            if not all(p.is_global and _free(p, ignore_user) for _, p in own):
                continue  # a layout the user gave: a constraint
            if not _module_options(kind, mod, "", placement):
                continue
            owned.update(id(p) for _, p in own)
            # a block index (``h.3.mlp.c_fc``) ties; a layer's own index in a Sequential
            # (``net.3``) does not: consecutive layers pair up instead (column, row)
            pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", full)
            key = (pattern, kind, tuple((n, tuple(p.shape)) for n, p in own))
            groups.setdefault(key, []).append((full, mod))
    out = []
    for (pattern, kind, _), mods in groups.items():
        per = [_module_options(kind, mod, full + ".", placement) for full, mod in mods]
        bcast = (broadcast,) * placement.ndim
        opts = [Option("B", tuple((("param", f"{full}.{n}"), bcast) for full, mod in mods
                                  for n, p in mod._parameters.items() if p is not None))]
        for i, (label, _) in enumerate(per[0]):
            lay = tuple((("param", k), nd) for p in per for k, nd in p[i][1].items())
            opts.append(Option(label, lay))
        name = mods[0][0] if len(mods) == 1 else f"{pattern} ({kind} x{len(mods)})"
        out.append(Variable(name, "module", [f for f, _ in mods], opts))
    from ..graph.ir import _input_names

    tensors = _input_tensors(args, kwargs)
    names = _input_names(graph, args, kwargs)
    by_batch: dict[int, list[int]] = {}
    for i, x in enumerate(tensors):
        if x.is_global and x.ndim >= 1 and _free(x, ignore_user):
            by_batch.setdefault(x.shape[0], []).append(i)
    for n, idx in by_batch.items():
        opts, start = [], 0
        axes = [a for a in range(placement.ndim) if placement.shape[a] > 1]
        for k in range(len(axes) + 1):
            for subset in itertools.combinations(axes, k):
                parts = math.prod(placement.shape[a] for a in subset)
                if n % parts:
                    continue
                nd = tuple(split(0) if a in subset else broadcast
                           for a in range(placement.ndim))
                label = "B" if not subset else "S(0)" + (
                    "" if placement.ndim == 1 else
                    f" on mesh axis {subset[0]}" if len(subset) == 1 else
                    f" on mesh axes {list(subset)}")
                opts.append(Option(label, tuple((("input", i), nd) for i in idx)))
                if len(subset) == len(axes):
                    start = len(opts) - 1  # data parallel over every axis
        if len(opts) > 1:
            out.append(Variable(f"inputs {', '.join(names[i] for i in idx)} (batch {n})",
                                "inputs", [names[i] for i in idx], opts, start))
    if graph._optimizers:
        for pattern, names in _block_groups(graph).items():
            out.append(Variable(f"activation checkpointing of {pattern} (x{len(names)})",
                                "checkpoint", names, [Option("none", ()), Option(
                                    "recompute in backward", ((("checkpoint", pattern),
                                                               (1,)),))]))
    cfg = graph.config
    if graph._optimizers and not cfg.zero_stage and graph._zero is None and \
            math.prod(placement.shape) > 1:  # a stage the user set is a constraint
        out.append(Variable("ZeRO stage", "zero", [], [Option("none", ())] + [
            Option(f"ZeRO stage {k}", ((("zero", "stage"), (k,)),)) for k in (2, 3)]))
    return out


def _modules_named(graph) -> dict:
    """``{qualified name: module}`` of the graph's modules."""
    return {".".join(x for x in (top_name, name) if x): mod
            for top_name, top in graph._modules().items()
            for name, mod in top.named_modules()}


def _block_groups(graph) -> dict:
    """The repeated blocks activation checkpointing may recompute: ``{pattern: [qualified
    names]}`` for each set of two or more modules of one class numbered under one parent
    (``transformer.h.0`` .. ``h.3``: ``transformer.h.*``) that hold parameters and
    submodules (a block, not a layer). A set where the user marked a module
    (``activation_checkpointing``) is left to the user."""
    groups: dict[tuple, list] = {}
    for full, mod in _modules_named(graph).items():
        parent, _, last = full.rpartition(".")
        if last.isdigit() and parent and any(True for _ in mod.children()) and \
                any(True for _ in mod.parameters()):
            groups.setdefault((parent, type(mod)), []).append((full, mod))
    out = {}
    for (parent, _), members in groups.items():
        if len(members) < 2 or any(getattr(m.__dict__.get("_graph_module"),
                                           "activation_checkpointing", False)
                                   for _, m in members):
            continue
        out[parent + ".*"] = [full for full, _ in members]
    return out


def _zero_of(vs: list, assign: tuple, default: int) -> int:
    """The ZeRO stage assignment ``assign`` of decisions ``vs`` sets (``default`` when
    the stage is no decision: the graph's own)."""
    return next((v.options[o].zero_stage or 0 for v, o in zip(vs, assign)
                 if v.kind == "zero"), default)


def _recomputed(vs: list, assign: tuple) -> list[str]:
    """The modules assignment ``assign`` of decisions ``vs`` recomputes in backward."""
    return [n for v, o in zip(vs, assign)
            if v.kind == "checkpoint" and v.options[o].layouts for n in v.members]


@contextlib.contextmanager
def _checkpointed(modules: list) -> Iterator[None]:
    """``modules`` marked for activation checkpointing inside the block (a candidate's
    logical graph), their own marks back after."""
    from ..graph.config import GraphModule

    marks = [GraphModule.of(m) for m in modules]
    before = [gm.activation_checkpointing for gm in marks]
    for gm in marks:
        gm.activation_checkpointing = True
    try:
        yield
    finally:
        for gm, was in zip(marks, before):
            gm.activation_checkpointing = was


def _params(graph) -> dict:
    """``{qualified name: parameter}`` of the graph's modules (a tied one once)."""
    out = {}
    for top_name, top in graph._modules().items():
        for name, p in top.named_parameters():
            out[".".join(x for x in (top_name, name) if x)] = p
    return out


# ------------------------------------------------------------------------------ pricing


def resolve_hardware(hardware, device: str):
    """The profile to price on: ``hardware`` as given (a Hardware, a name or a file), or
    by default the named profile matching the CUDA device's name, else this machine's
    calibration (:func:`sbpflow.planner.calibrate.profile_here`)."""
    from . import calibrate
    from .hardware import Hardware, load, names

    if isinstance(hardware, Hardware):
        return hardware
    if hardware is not None:
        return load(str(hardware))
    if device == "cuda" and torch.cuda.is_available():
        dev = torch.cuda.get_device_name().lower()
        for n in names():
            if n.split("-")[0] in dev:
                return load(n)
    return calibrate.profile_here()


def graph_optimizer(graph):
    """The graph's first optimizer (``add_optimizer``), None without one: what the
    update term of :func:`sbpflow.planner.predict.predict_step` prices every
    parameter's step with."""
    return graph._optimizers[0][0] if graph._optimizers else None


def state_per_param(graph) -> float:
    """Optimizer state per parameter element (float32 values): Adam/AdamW 2, SGD with
    momentum 1, plain SGD 0; the largest over the graph's optimizers
    (:func:`sbpflow.planner.predict.state_per_param` of each)."""
    from .predict import state_per_param as of

    return max((of(opt) for opt, _ in graph._optimizers), default=0.0)


@dataclass
class _Priced:
    seconds: float  # the objective
    memory: int
    terms: dict = field(default_factory=dict)  # predict_step's, of the slowest rank
    failed: str = ""

    def key(self, limit):
        if self.failed:
            return (2, math.inf, math.inf)
        if limit is not None and self.memory > limit:
            return (1, self.memory, self.seconds)
        return (0, self.seconds, self.memory)


@dataclass
class AutoPlan:
    """What the search chose, and why. ``variables`` and ``chosen`` (an option index per
    variable); ``priced``: every evaluated assignment's :class:`_Priced` (objective
    seconds, memory bytes per rank, cost terms); ``start``: data parallel's assignment;
    ``seconds``: search time (timing ops left out); ``timing``: seconds the search spent
    timing ops on this machine (``op_timing = "measured"``: each new op and shape once
    per process); ``cut``: the time limit stopped it; ``hardware``: the profile's name;
    ``limit``: the memory limit (bytes per rank) or None."""

    graph: str
    placement: object
    variables: list
    chosen: tuple
    start: tuple
    priced: dict
    seconds: float
    cut: bool
    hardware: str
    limit: int | None
    auto_memory: int = 0
    source: str = "search"  # or the plan file (or "a plan given as data") run as given
    zero_stage: int = 0  # the graph's ZeRO stage the plan was priced under
    exact: bool = False  # every assignment was priced: the chosen is the optimum
    # a search under a memory limit that found nothing fitting: (the least memory it
    # found, whether its time ran out); this plan is then the same search without the limit
    miss: tuple = ()
    timing: float = 0.0
    # assignments the exact search left unpriced: recomputation that cannot be faster
    # (where the layout without it fits the memory limit)
    pruned: int = 0
    sharers: int = 1  # ranks that shared the pricing (1: every rank priced every layout)

    @property
    def best(self) -> _Priced:
        return self.priced[self.chosen]

    def layouts(self) -> dict:
        """``{("param", name) | ("input", i): nd-SBP}`` of the chosen options."""
        out = {}
        for v, o in zip(self.variables, self.chosen):
            out.update((k, nd) for k, nd in v.options[o].layouts
                       if k[0] in ("param", "input"))
        return out

    @property
    def checkpointed(self) -> list[str]:
        """The modules the plan recomputes in backward (activation checkpointing)."""
        return _recomputed(self.variables, self.chosen)

    def to_dict(self) -> dict:
        """The plan as JSON-able data: the placement's mesh shape, each decision's chosen
        label, each parameter's and input's layout (``repr`` of its nd-SBP), the
        prediction."""
        from ..graph.ir import layout

        return {
            "note": "what runs: mesh, zero_stage, activation_checkpointing, parameters and "
                    "inputs (edit them); graph, hardware, decisions and the figures "
                    "describe the search that made this plan and are not read",
            "graph": self.graph, "mesh": list(self.placement.shape),
            "zero_stage": self.zero_stage, "activation_checkpointing": self.checkpointed,
            "hardware": self.hardware,
            "decisions": {v.name: v.options[o].label
                          for v, o in zip(self.variables, self.chosen)},
            "parameters": {k[1]: layout(nd) for k, nd in self.layouts().items()
                           if k[0] == "param"},
            "inputs": {str(k[1]): layout(nd) for k, nd in self.layouts().items()
                       if k[0] == "input"},
            "predicted_step_s": self.best.seconds,
            "data_parallel_step_s": self.priced[self.start].seconds,
            "predicted_memory_bytes": self.best.memory,
            "search_s": self.seconds, "evaluated": len(self.priced), "exact": self.exact,
        }

    def save(self, path: str, overwrite: bool = False) -> str:
        """Write :meth:`to_dict` as JSON to ``path`` (a plan to edit and give back with
        ``config.set_auto_parallel_plan(path)`` or ``--plan FILE``). Returns ``path``.

        Raises:
            FileExistsError: ``path`` exists and not ``overwrite`` (a plan is never
                replaced silently).
        """
        return save_plan(path, self.to_dict(), overwrite)

    def _exactly(self) -> str:
        if not self.pruned:
            return ": all of them (exact, ties within 1% to the simpler)"
        return (f": all of them but {self.pruned} that recompute blocks where the layout "
                f"without recomputation fits, which cannot be faster (exact, ties within "
                f"1% to the simpler)")

    def __str__(self) -> str:
        from ..graph.show import _fmt_bytes

        b = self.best
        timed = f" (+{self.timing:.1f} s timing ops on this machine)" \
            if self.timing >= 0.05 else ""
        shared = f" by {self.sharers} ranks sharing the work" if self.sharers > 1 else ""
        how = (f"{len(self.priced)} layouts priced{shared} in {self.seconds:.1f} s{timed}"
               f"{_CUT if self.cut else ''}"
               f"{self._exactly() if self.exact else '' if self.cut else _LOCAL}"
               if self.source == "search" else
               f"{self.source}, priced in {self.seconds:.1f} s"
               if self.source.startswith("the search") else
               f"given by {self.source}: checked and run as given, priced in "
               f"{self.seconds:.1f} s")
        zero = f", ZeRO stage {self.zero_stage}" if self.zero_stage else ""
        lines = [
            f"auto-parallel plan of {self.graph} on mesh {list(self.placement.shape)}{zero} "
            f"(profile {self.hardware}): {how}",
            f"  predicted step {b.seconds * 1e3:.2f} ms (compute "
            f"{b.terms.get('compute', 0) * 1e3:.2f} ms, update "
            f"{b.terms.get('update', 0) * 1e3:.2f} ms, communication "
            f"{b.terms.get('communication', 0) * 1e3:.2f} ms"
            + (f", host {b.terms['host'] * 1e3:.2f} ms: the program's calls beyond the "
               f"device's work" if b.terms.get("host", 0) > 0 else "")
            + "), memory "
            f"{_fmt_bytes(b.memory)} per rank"
            + (f" (limit {_fmt_bytes(self.limit)})" if self.limit is not None else "")]
        s = self.priced.get(self.start)
        if s is not None and self.start != self.chosen:
            lines.append(f"  data parallel (where the search started): "
                         f"{s.seconds * 1e3:.2f} ms, {_fmt_bytes(s.memory)} per rank")
        others = [(p.key(self.limit), a) for a, p in self.priced.items()
                  if a != self.chosen and not p.failed]
        if others:
            a = min(others)[1]
            p = self.priced[a]
            diff = "; ".join(f"{v.name}: {v.options[j].label}" for v, i, j in
                             zip(self.variables, self.chosen, a) if i != j)
            over = self.limit is not None and p.memory > self.limit
            lines.append(f"  next best layout priced: {p.seconds * 1e3:.2f} ms "
                         f"({(p.seconds - b.seconds) * 1e3:+.2f} ms{_tie(p, self)}), "
                         f"{_fmt_bytes(p.memory)} per rank"
                         f"{', over the memory limit' if over else ''}, with {diff}")
        if self.auto_memory:
            lines.append(f"  enable_auto_memory({self.auto_memory}): the least memory "
                         f"within {5 * self.auto_memory}% of the fastest")
        if self.source != "search":
            lines += [f"  {v.name}: {v.options[o].label}"
                      for v, o in zip(self.variables, self.chosen)]
            return "\n".join(lines)
        lines.append("  | decision | chosen | runner-up (others as chosen) | its step | "
                     "difference |")
        for i, (v, o) in enumerate(zip(self.variables, self.chosen)):
            alts = []
            for j in range(len(v.options)):
                if j == o:
                    continue
                a = self.chosen[:i] + (j,) + self.chosen[i + 1:]
                if a in self.priced:
                    alts.append((self.priced[a].key(self.limit), j, self.priced[a]))
            if alts:
                _, j, p = min(alts)
                if p.failed:
                    why = f"not lowered: {p.failed}"
                    its = "-"
                else:
                    its = f"{p.seconds * 1e3:.2f} ms"
                    why = f"{(p.seconds - b.seconds) * 1e3:+.2f} ms{_tie(p, self)}"
                    if self.limit is not None and p.memory > self.limit:
                        why += f", needs {_fmt_bytes(p.memory)} (over the limit)"
                    elif p.memory != b.memory:
                        why += f", memory {_fmt_bytes(p.memory)}"
                alt = v.options[j].label
            else:
                alt, its, why = "(not priced)", "-", "-"
            lines.append(f"  | {v.name} | {v.options[o].label} | {alt} | {its} | {why} |")
        return "\n".join(lines)


_CUT = " (cut by the time limit; set_auto_parallel_search_time, or --search-time on the " \
    "command line, gives it more)"
_LOCAL = ": a local search from data parallel (single and paired moves until none gains; " \
    "too many layouts to price them all in the time)"


def _tie(p: _Priced, plan: AutoPlan) -> str:
    """Why a layout predicted faster than the chosen one, and fitting, was not taken:
    ``enable_auto_memory`` (it needs more memory), or within the 1% a move must gain (a
    tie: the layout nearer data parallel is kept)."""
    chosen = plan.best
    if p.seconds >= chosen.seconds or (plan.limit is not None and p.memory > plan.limit):
        return ""
    if plan.auto_memory and p.memory > chosen.memory:
        return ", more memory: enable_auto_memory"
    return ", within 1%: a tie, not taken" if p.seconds >= chosen.seconds * (1 - _EPS) \
        else ""


def pricing_dtype(cfg, hw) -> str:
    """The matmuls' dtype name to price a graph of config ``cfg`` at on ``hw``: the AMP
    dtype (else float32) when the profile lists it, else the profile's default (a CPU
    calibration lists float32 only: bfloat16 AMP is priced at its float32 rate)."""
    dtype = str(cfg.amp_dtype or torch.float32).replace("torch.", "")
    return dtype if dtype in hw.peak_flops else hw.default_dtype


# what a rank reports in place of a layout's objective: it failed to lower; it needed the
# other ranks while they built other layouts (priced again on every rank); it had none
_FAILED, _ALONE, _IDLE = -1, -3, -2


class _Pricer:
    """Prices assignments of decisions ``vs`` of ``graph`` on inputs like ``args``/
    ``kwargs`` (see the module doc), every rank in step; ``priced`` keeps each one;
    ``cut`` turns True once the search time is spent: the sum over its rounds of the
    slowest rank's pricing time, op timing left out (all ranks agree on it; a rank
    waiting at an exchange for a peer that is timing ops is not searching).

    **Ranks share the work** when any of them would price a layout alike: the first
    layout is priced by every rank, and when every rank predicts the same memory and
    communication for it (every split even: what each rank holds and sends is the same
    size) and the profile prices ops by the roofline (a named profile: GPU planning,
    the simulation), :meth:`many` hands each rank its own layouts and the ranks exchange
    the results (``shared``; N ranks price N layouts in the time of one). Otherwise,
    and always with ops timed on this machine (a calibrated profile: each rank its own
    timings, which differ by rank with the load), every rank prices every layout and
    the slowest rank's prediction is taken."""

    def __init__(self, graph, args, kwargs, vs, hw, device: str, ranks: list[int]):
        cfg = graph.config
        self.graph, self.args, self.kwargs, self.vs = graph, args, kwargs, vs
        self.hw, self.device, self.ranks, self.cfg = hw, device, ranks, cfg
        from ..distributed import get_rank
        from .predict import TIMER

        self.timed0 = TIMER.seconds
        self.params = _params(graph)
        self.modules = _modules_named(graph)
        limit = cfg.auto_parallel_memory_limit
        if limit is None and device == "cuda" and torch.cuda.is_available():
            limit = int(torch.cuda.mem_get_info()[0])
        self.limit = limit
        self.dtype = pricing_dtype(cfg, hw)
        self.state = state_per_param(graph)
        self.optimizer = graph_optimizer(graph)
        self.priced: dict[tuple, _Priced] = {}
        self.cut = False
        self.spent = 0.0  # seconds pricing (op timing left out), each round's slowest rank
        self.timed = 0.0  # seconds timing ops, as the slowest rank saw
        # each pricing's time (op timing left out, slowest rank); shared: a round's time
        # over the layouts it priced (what one more layout costs the search)
        self.durations: list[float] = []
        self.me = ranks.index(get_rank()) if len(ranks) > 1 else 0
        self.shared = False  # set by the first pricing: see the class doc

    def timing(self) -> float:
        """Seconds this search spent timing ops on this machine (each new op and shape
        once per process: a measurement of the machine, cached, not a search step)."""
        from .predict import TIMER

        return TIMER.seconds - self.timed0

    @property
    def width(self) -> int:
        """How many layouts one round prices: one per rank when ranks share, else 1."""
        return len(self.ranks) if self.shared else 1

    def __call__(self, assign: tuple) -> _Priced:
        return self.many([assign])[0]

    def many(self, assigns: list) -> list[_Priced | None]:
        """:class:`_Priced` of each of ``assigns`` (every rank calls it with the same
        list, in step); None for those left unpriced because the search time ran out."""
        todo = [a for a in dict.fromkeys(assigns) if a not in self.priced]
        k = 0
        while k < len(todo) and not self.cut:
            n = self.width
            self._round(todo[k:k + n])
            k += n
        return [self.priced.get(a) for a in assigns]

    def _round(self, chunk: list) -> None:
        """Price ``chunk``: one layout on every rank, or shared: the ``i``-th layout on
        the ``i``-th rank, the results exchanged. A layout whose graph needed the other
        ranks (:class:`~sbpflow.distributed.SoloExchangeError`) is priced again on every
        rank, and the ranks stop sharing."""
        from ..distributed import _comm

        if self.shared:
            mine = chunk[self.me] if self.me < len(chunk) else None
        else:
            mine = chunk[0]
        row, why = self._local(mine) if mine is not None else ([_IDLE] + [0] * 9, "")
        rows = _comm.all_gather_meta(row + [int(self.timing() * 1e3)], self.ranks)
        # why each rank's layout failed (the same text on every rank, for the explanation)
        whys = [w.decode() for w in _comm.all_gather_bytes(why.encode(), self.ranks)] \
            if any(r[0] == _FAILED for r in rows) else [""] * len(rows)
        again = []
        if self.shared:
            for a, r, w in zip(chunk, rows, whys):
                if r[0] == _ALONE:
                    again.append(a)
                else:
                    self.priced[a] = self._priced(r, [r], w)
        else:
            fail = next((w for w in whys if w), "")
            self.priced[chunk[0]] = self._priced(max(rows, key=lambda r: r[0]), rows, fail)
            if len(self.priced) == 1 and len(self.ranks) > 1 and not fail:
                # one program alike on every rank (the same memory and communication),
                # priced alike by every rank (no op timed here: each rank's own timings
                # would make a layout's figure depend on which rank priced it)
                self.shared = len({(r[1], r[7]) for r in rows}) == 1 and \
                    self.hw.op_timing != "measured"
        # the round's time: its slowest rank's pricing, op timing left out (before,
        # each rank's wall time less its own timing: with ranks outnumbering the cores
        # they time ops in turn, and the time a rank waited here for the others' timing
        # counted as search: arcface-1e6 on 4 ranks priced 3 layouts in its 10 s)
        self.spent += max(r[3] for r in rows) / 1e6
        self.timed = max(r[10] for r in rows) / 1e3
        done = len(chunk) - len(again)
        if done:  # what one more layout costs: shared, a round prices one per rank
            self.durations.append(max(r[3] for r in rows) / 1e6 / self.width)
        if self.spent > self.cfg.auto_parallel_search_time:
            self.cut = True
        if again:  # this model's graphs exchange while built: every rank builds each
            self.shared = False
            for a in again:
                if not self.cut:
                    self._round([a])

    @staticmethod
    def _priced(row: list, rows: list, failed: str) -> _Priced:
        if failed:
            return _Priced(math.inf, 0, {}, failed[:200])
        from .predict import terms_from_ints

        return _Priced(row[0] / 1e9, max(r[1] for r in rows), terms_from_ints(row[5:10]))

    def _local(self, assign: tuple) -> tuple[list[int], str]:
        """``assign`` priced on this rank: the ints ranks exchange (objective in ns, or
        :data:`_FAILED` / :data:`_ALONE`; memory in bytes; 0; this pricing's time less
        its op timing in us; 0; then :func:`~sbpflow.planner.predict.terms_as_ints`), and
        why it failed ("" when it did not)."""
        from ..distributed import SoloExchangeError
        from ..graph.ir import build
        from .predict import (
            TIMER,
            collective_count,
            predict_memory,
            predict_step,
            terms_as_ints,
        )

        t0, timed = time.perf_counter(), TIMER.seconds
        cfg, m = self.cfg, self.cfg.grad_acc_steps
        zero = _zero_of(self.vs, assign, cfg.zero_stage)
        recompute = [self.modules[n] for n in _recomputed(self.vs, assign)]
        lay = {}
        for v, o in zip(self.vs, assign):
            for k, nd in v.options[o].layouts:
                if k[0] in ("param", "input"):
                    lay[id(self.params[k[1]]) if k[0] == "param" else k] = nd
        failed = ""
        try:
            # the stage priced, while built, as apply() will set it (enable_zero's default
            # shard_min_size) unless the user's own stage is what is priced
            own = cfg.zero_stage, cfg.zero_min_size
            if zero != own[0]:
                cfg.zero_stage, cfg.zero_min_size = zero, ZERO_MIN_SIZE
            try:
                with _checkpointed(recompute):
                    lg = build(self.graph, self.args, self.kwargs, self.device, lay,
                               solo=self.shared)
            finally:
                cfg.zero_stage, cfg.zero_min_size = own
            mem = predict_memory(lg, self.state, m)["total"]
            terms = predict_step(lg, self.hw, self.dtype, m, self.optimizer, working_set=mem)
            colls = m * collective_count(lg)
            sec = cfg.auto_parallel_compute_ratio * (terms["compute"] + terms["update"]) + \
                terms["communication"] + terms["host"] + cfg.auto_parallel_wait_time * colls
        except SoloExchangeError:
            return [_ALONE] + [0] * 9, ""
        except Exception as e:  # noqa: BLE001 - a layout the ops cannot take: not a plan
            terms, sec, mem, failed = {}, math.inf, 0, f"{type(e).__name__}: {e}"[:200]
        # this call's time less the op timing's (each new shape is timed once: the first
        # layouts pay for most of it), for the search's estimate of what the rest cost
        pure = time.perf_counter() - t0 - (TIMER.seconds - timed)
        return [int(min(sec, 1e9) * 1e9) if not failed else _FAILED, int(mem), 0,
                int(pure * 1e6), 0] + terms_as_ints(terms), failed


def assignment(vs: list, layouts: dict) -> tuple | None:
    """The options of decisions ``vs`` that lay every tensor out as ``layouts`` (``{key:
    nd-SBP}``, keys as :class:`Option`'s) does: a hand layout as a point of the search;
    None when some decision has no such option (a layout the decisions cannot express)."""
    out = []
    for v in vs:
        o = next((i for i, opt in enumerate(v.options)
                  if all(tuple(layouts.get(k, ())) == tuple(nd) for k, nd in opt.layouts)),
                 None)
        if o is None:
            return None
        out.append(o)
    return tuple(out)


def search(graph, args, kwargs, placement, hw, device: str, ranks: list[int],
           starts: tuple = ()) -> AutoPlan:
    """Search ``graph``'s free layouts on ``placement`` (see the module doc); call on
    every rank of ``ranks`` (the graph's), in step. ``starts``: more layouts (``{key:
    nd-SBP}``, e.g. the hand layouts a user would pick, :func:`assignment`) priced
    beside data parallel's; the descent starts from the best of them. Returns the
    :class:`AutoPlan`.

    Raises:
        MemoryLimitError: no layout found fits the memory limit (names the smallest
            memory found, and whether the search time ran out first).
        GraphError: no candidate could be lowered.
    """
    cfg = graph.config
    vs = variables(graph, args, kwargs, placement, cfg.auto_parallel_ignore_user_sbp)
    price = _Pricer(graph, args, kwargs, vs, hw, device, ranks)
    limit = price.limit
    cur = tuple(v.start for v in vs)
    start = cur
    best = price(cur)
    others = [a for a in (assignment(vs, lay) for lay in starts) if a is not None and a != cur]
    for a, p in zip(others, price.many(others)):
        if p is not None and p.key(limit) < _shrunk(best.key(limit)):
            cur, best = a, p
    frugal = None  # over the limit: the least memory the memory decisions give (ZeRO-3,
    # every block recomputed), a fallback the descent may not reach in its time
    if best.key(limit)[0] > 0:
        f = tuple(len(v.options) - 1 if v.kind in ("zero", "checkpoint") else o
                  for v, o in zip(vs, cur))
        if f != cur:
            frugal = (f, price(f))
    cur, best, exact, pruned = _exhaustive(price, vs, start, cur, best)
    moves = [] if exact else _moves(vs)
    cur, best = _descend(price, moves, cur, best, limit)
    if frugal is not None and frugal[1].key(limit) < best.key(limit):
        # the descent found nothing better that fits: buy speed back from the fallback
        cur, best = _descend(price, moves, frugal[0], frugal[1], limit)
    # ties go to the simpler: each decision back to where the search started when that
    # fits and costs under 1% more (a ZeRO stage or a split that does nothing)
    ref = best.seconds
    for i in range(len(vs)):
        if cur[i] != start[i] and not price.cut:
            cand = cur[:i] + (start[i],) + cur[i + 1:]
            p = price(cand)
            if p.key(limit)[0] == 0 and p.seconds <= ref * (1 + _EPS):
                cur, best = cand, p
    _check_found(graph, best, limit, price.priced, price.cut)
    if cfg.auto_memory:
        ok = [(p.memory, p.seconds, a) for a, p in price.priced.items() if not p.failed and
              (limit is None or p.memory <= limit) and
              p.seconds <= best.seconds * (1 + 0.05 * cfg.auto_memory)]
        cur = min(ok)[2]
    return AutoPlan(type(graph).__name__, placement, vs, cur, start, price.priced,
                    price.spent, price.cut, hw.name, limit, cfg.auto_memory,
                    zero_stage=_zero_of(vs, cur, cfg.zero_stage), exact=exact,
                    timing=price.timed, pruned=pruned, sharers=price.width)


def _recompute_dominated(cfg) -> bool:
    """Whether recomputing a block can never make a step faster under ``cfg``'s objective
    (so the exact search need not price it where memory does not call for it):
    recomputation only adds ops, boxings and calls, and the objective ``r x (compute +
    update) + communication + host + w x collectives``, with ``host = max(0, calls x
    call_seconds - (compute + update + communication))``, grows with each when the
    computation cost ratio ``r >= 1`` (host shrinks by at most what compute grows) and
    the wait ``w >= 0``. Not under ``enable_auto_memory``, which trades speed for memory."""
    return cfg.auto_parallel_compute_ratio >= 1 and cfg.auto_parallel_wait_time >= 0 \
        and not cfg.auto_memory


def _exhaustive(price: _Pricer, vs: list, start: tuple, cur: tuple, best: _Priced
                ) -> tuple[tuple, _Priced, bool, int]:
    """Price every assignment of ``vs``, nearest data parallel (``start``) first (a near
    tie keeps it), when that is predicted to take at most :data:`_EXACT_SHARE` of the
    search time (from a layout's time so far, op timing left out) and they are at most
    :data:`_EXACT_MAX`; else nothing. Recomputation, when it cannot be faster
    (:func:`_recompute_dominated`), is priced only on the layouts over the memory limit
    without it. Returns the best ``(assignment, priced)`` (``cur``, ``best`` when
    nothing was priced), whether the search is exact (everything it needed priced in
    time), and how many assignments are left unpriced (by that dominance)."""
    cfg, limit = price.cfg, price.limit
    ck = [i for i, v in enumerate(vs) if v.kind == "checkpoint"] \
        if _recompute_dominated(cfg) else []
    axes = [range(1) if i in ck else range(len(v.options)) for i, v in enumerate(vs)]
    total = math.prod(len(a) for a in axes)
    budget = _EXACT_SHARE * cfg.auto_parallel_search_time
    if total > _EXACT_MAX or total * min(price.durations) > budget:
        return cur, best, False, 0

    def near(cands):
        return sorted(cands, key=lambda a: sum(x != y for x, y in zip(a, start)))

    def take(cands):
        nonlocal cur, best
        for cand, p in zip(cands, price.many(cands)):
            if p is None:
                break
            if p.key(limit) < _shrunk(best.key(limit)):
                cur, best = cand, p

    first = near(itertools.product(*axes))
    take(first)
    more = []  # recomputation where the layout without it is over the limit (or failed)
    if ck and not price.cut:
        every = [range(len(vs[i].options)) for i in ck]
        for a in first:
            if price.priced[a].key(limit)[0] > 0:
                for c in itertools.product(*every):
                    b = list(a)
                    for i, o in zip(ck, c):
                        b[i] = o
                    if tuple(b) != a:
                        more.append(tuple(b))
        more = near(dict.fromkeys(more))
        if more and len(more) * min(price.durations) > budget - price.spent:
            return cur, best, False, 0  # not in time: the descent goes on from here
        take(more)
    return cur, best, not price.cut, math.prod(len(v.options) for v in vs) - len(price.priced)


def parse_layout(text: str, mesh_ndim: int, tensor_ndim: int) -> tuple:
    """The nd-SBP written ``text`` as plans write layouts: ``"B"``, ``"S(1)"``
    (on a 1-D mesh), ``"[S(0), B]"`` or ``"(S(0), B)"`` (one per mesh axis).

    Raises:
        ValueError: not a layout, or one that does not fit the mesh or the tensor (names
            the text and the fix).
    """
    from ..sbp import normalize_nd_sbp

    out = []
    for x in _layout_entries(text):
        m = re.fullmatch(r"S\((-?\d+)\)", x)
        if m:
            out.append(split(int(m.group(1))))
        elif x == "B":
            out.append(broadcast)
        else:  # P: a parameter or input does not start as a partial sum
            raise ValueError(f"layout {text!r}: {x!r} is not B or S(dim); write e.g. "
                             f"\"S(0)\" or \"[S(0), B]\"")
    if len(out) != mesh_ndim:
        raise ValueError(f"layout {text!r} has {len(out)} entr{'y' if len(out) == 1 else 'ies'}"
                         f" but the mesh has {mesh_ndim} axes; give one per axis")
    return normalize_nd_sbp(tuple(out), mesh_ndim, tensor_ndim)


def given(graph, args, kwargs, placement, hw, device: str, ranks: list[int],
          plan) -> AutoPlan:
    """The plan ``plan`` (a path of :meth:`AutoPlan.save`'s JSON, edited or not, or its
    dict) checked against ``graph`` and priced (one logical graph), to be run as given:
    the layouts it names replace the parameters' and inputs'; what it does not name
    keeps its layout.

    Raises:
        GraphError: the file cannot be read, its mesh is not the placement's, it names a
            parameter the graph does not have or an input beyond its tensor inputs, or a
            layout does not fit (each names the entry and the fix); or the memory limit.
    """
    where = plan if isinstance(plan, str) else "a plan given as data"
    try:
        plan = read_plan(plan)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if "pipeline" in plan:
        p = plan["pipeline"]
        raise PlanError(f"auto-parallel plan {where}: a pipeline of {p['stages']} stages, not "
                        f"layouts of one graph; run it with `sbpflow train MODEL --plan FILE`, "
                        f"or in a graph put the model's stages with set_stage and "
                        f"config.set_gradient_accumulation_steps({p['micro_batches']})")
    if plan.get("mesh", list(placement.shape)) != list(placement.shape):
        raise PlanError(f"auto-parallel plan {where}: made for mesh {plan['mesh']}, but the "
                         f"graph's placement has mesh {list(placement.shape)}; plan again on "
                         f"this placement (sbpflow plan / enable_auto_parallel)")
    zero = plan.get("zero_stage", 0)
    if zero and graph.config.zero_stage not in (0, zero):
        raise PlanError(f"auto-parallel plan {where}: made for ZeRO stage {zero}, but the "
                         f"graph has enable_zero(stage={graph.config.zero_stage}); drop one "
                         f"of them or set the plan's zero_stage")
    if zero and not graph.config.zero_stage:
        graph.config.enable_zero(True, stage=zero)  # the plan's, before the first compile
    params = _params(graph)
    tensors = _input_tensors(args, kwargs)
    from ..distributed._state import get_rank as _rank

    priced, rows = plan.get("global_batch"), tensors[0].shape[0] if tensors and \
        tensors[0].ndim else None
    if isinstance(priced, int) and rows is not None and rows != priced and \
            _rank() == min(ranks):  # (said once, by the first rank)
        import warnings

        again = f" --batch-size {rows // len(ranks)}" if rows % len(ranks) == 0 else ""
        warnings.warn(f"auto-parallel plan {where}: priced for a global batch of {priced}, "
                      f"but the graph's first input has {rows} rows: its layouts run as "
                      f"given, though another may be faster at this batch (plan again at "
                      f"it: sbpflow plan MODEL --nproc-per-node {len(ranks)}{again})",
                      stacklevel=2)
    vs = []

    def decision(key, what: str, text, t):
        try:
            nd = parse_layout(text, placement.ndim, t.ndim)
        except ValueError as e:
            raise PlanError(f"auto-parallel plan {where}: {what} of shape "
                             f"{tuple(t.shape)}: {e}") from None
        return Variable(what, "given", [str(key[1])], [Option(str(text), ((key, nd),))])

    named = plan.get("parameters") or {}
    if named and not any(name in params for name in named):
        raise PlanError(f"auto-parallel plan {where}: none of its {len(named)} parameters "
                        f"(such as {next(iter(named))!r}) is in {type(graph).__name__}, "
                        f"whose parameters are {sorted(params)[:6]}"
                        f"{'...' if len(params) > 6 else ''}: it was made for another "
                        f"model; plan this one (sbpflow plan MODEL --save FILE, or "
                        f"--plan auto)")
    for name, text in named.items():
        if name not in params:
            raise PlanError(f"auto-parallel plan {where}: no parameter {name!r} in "
                             f"{type(graph).__name__}; its parameters are "
                             f"{sorted(params)[:12]}{'...' if len(params) > 12 else ''}")
        vs.append(decision(("param", name), f"parameter {name!r}", text, params[name]))
    for key, text in (plan.get("inputs") or {}).items():
        i = int(key) if str(key).isdigit() else -1
        if not 0 <= i < len(tensors):
            raise PlanError(f"auto-parallel plan {where}: input {key!r} is not the index of "
                             f"one of the graph's {len(tensors)} tensor inputs (0-"
                             f"{len(tensors) - 1})")
        vs.append(decision(("input", i), f"input {i}", text, tensors[i]))
    modules = _modules_named(graph)
    marked: list[str] = []  # each module once; a * in a name stands for one component
    for entry in plan.get("activation_checkpointing") or []:
        one = re.compile("[^.]+".join(re.escape(x) for x in entry.split("*")))
        names = [n for n in modules if one.fullmatch(n)]  # a * is one name component
        if not names:
            blocks = sorted(_block_groups(graph))
            raise PlanError(f"auto-parallel plan {where}: activation_checkpointing names "
                            f"{entry!r}, which is no module of {type(graph).__name__} "
                            f"(give a module's name, or a pattern with * for one name "
                            f"component{': its repeated blocks are ' if blocks else ''}"
                            f"{', '.join(blocks)})")
        marked += [n for n in names if n not in marked]
    for name in marked:
        vs.append(Variable(f"activation checkpointing of {name}", "checkpoint", [name],
                           [Option("recompute in backward", ((("checkpoint", name), (1,)),))]))
    price = _Pricer(graph, args, kwargs, vs, hw, device, ranks)
    chosen = (0,) * len(vs)
    best = price(chosen)
    _check_found(graph, best, price.limit, price.priced)
    return AutoPlan(type(graph).__name__, placement, vs, chosen, chosen, price.priced,
                    price.spent, False, hw.name, price.limit, 0, where,
                    zero_stage=graph.config.zero_stage)


def _check_found(graph, best: _Priced, limit, priced: dict, cut_short: bool = False
                 ) -> None:
    """Raise GraphError when the best layout found failed to lower, and
    :class:`MemoryLimitError` when it needs more memory than ``limit`` (naming the
    smallest memory any priced layout needs)."""
    from ..graph.show import _fmt_bytes
    name = type(graph).__name__
    if best.failed:
        raise GraphError(f"auto-parallel: no layout of {name} could be lowered "
                         f"({best.failed})")
    if limit is not None and best.memory > limit:
        least = min((p.memory for p in priced.values() if not p.failed), default=0)
        cut = f" in the {graph.config.auto_parallel_search_time:g} s the search had " \
              f"({len(priced)} layouts priced; set_auto_parallel_search_time gives it " \
              f"more)" if cut_short else ""
        raise MemoryLimitError(
            f"auto-parallel: no layout of {name} found to fit the memory limit of "
            f"{_fmt_bytes(limit)} per rank{cut}; the smallest found needs "
            f"{_fmt_bytes(least)} (predicted: parameters, gradients, optimizer state, "
            f"activations). Raise set_auto_parallel_memory_limit, use more ranks, a "
            f"smaller batch or model", limit, least,
            graph.config.auto_parallel_search_time if cut_short else 0.0)


def _descend(price: _Pricer, moves: list, cur: tuple, best: _Priced, limit
             ) -> tuple[tuple, _Priced]:
    """Coordinate descent from ``cur`` (priced ``best``) over ``moves`` until none gains
    1% or the search time runs out: over the memory limit each sweep prices every move
    and takes the one that saves the most (the first saving found may lead where nothing
    fits, e.g. a split weight that ZeRO then cannot shard), within it the first move that
    gains. The next moves are priced a round at a time (one per rank when the ranks
    share the pricing); those after a move taken are priced again from the new layout,
    so the descent is the one move-at-a-time pricing would take."""
    while moves and not price.cut:
        steepest = best.key(limit)[0] > 0
        improved, base = False, cur
        i = 0
        while i < len(moves) and not price.cut:
            batch, new = [], 0  # (index of the move after it, layout), as many new as a round
            while i < len(moves) and new < price.width:
                cand = list(base)
                for v, o in moves[i]:
                    cand[v] = o
                cand = tuple(cand)
                i += 1
                if cand != base:
                    batch.append((i, cand))
                    new += cand not in price.priced
            for (after, cand), p in zip(batch, price.many([c for _, c in batch])):
                if p is None:
                    break
                if p.key(limit) < _shrunk(best.key(limit)):
                    cur, best, improved = cand, p, True
                    if not steepest:
                        base, i = cur, after
                        break
        if not improved:
            break
    return cur, best


def _moves(vs: list) -> list[tuple]:
    """The search's moves, each ``((variable, option), ...)``: every single option;
    Megatron's pair on each mesh axis (a column-split module followed by a row-split one)
    for consecutive module decisions; and for each run of consecutive decisions under
    one parent module (``h.*.attn.q, k, v, c_proj``), its first ``k`` column-split and
    the rest row-split, for every ``k`` (attention's q, k, v then its projection)."""
    out = [((i, o),) for i, v in enumerate(vs) for o in range(len(v.options))]

    def split_as(v, style, axis):
        return [o for o, opt in enumerate(v.options)
                if opt.label.startswith(style) and opt.axis == axis]

    axes = {o.axis for v in vs for o in v.options if o.axis is not None}
    # a tensor-parallel move on axis a also tries the batch whole on that axis (every
    # rank of the axis then computes on the same samples, as Megatron's TP group does)
    def split_axes(opt):
        return {a for _, nd in opt.layouts[:1] for a, x in enumerate(nd) if x.is_split()}

    whole = {}  # axis -> the inputs' options: data parallel's, less that axis
    for a in axes:
        whole[a] = tuple(
            (i, o) for i, v in enumerate(vs) if v.kind == "inputs"
            for o, opt in enumerate(v.options)
            if split_axes(opt) == split_axes(v.options[v.start]) - {a})
    tp: list[tuple] = []
    for a in sorted(axes):
        for i in range(len(vs) - 1):
            if vs[i].kind == vs[i + 1].kind == "module":
                tp += [((i, c), (i + 1, r), a) for c in split_as(vs[i], "Colwise", a)
                       for r in split_as(vs[i + 1], "Rowwise", a)]
        runs: dict[str, list[int]] = {}
        for i, v in enumerate(vs):
            if v.kind == "module":
                runs.setdefault(v.name.split(" (")[0].rpartition(".")[0], []).append(i)
        for run in runs.values():
            if len(run) < 3 or run != list(range(run[0], run[-1] + 1)):
                continue
            for k in range(2, len(run)):  # k = 1: the pair above
                cols = [split_as(vs[i], "Colwise", a) for i in run[:k]]
                rows = [split_as(vs[i], "Rowwise", a) for i in run[k:]]
                if all(cols) and all(rows):
                    tp.append(tuple((i, c[0]) for i, c in zip(run[:k], cols)) +
                              tuple((i, r[0]) for i, r in zip(run[k:], rows)) + (a,))
    for *move, a in tp:
        out.append(tuple(move))
        if whole[a]:
            out.append(tuple(move) + whole[a])
    return out


def _shrunk(key: tuple) -> tuple:
    """``key`` less the smallest improvement a move must make."""
    return (key[0], key[1] * (1 - _EPS)) + key[2:]


# ------------------------------------------------------------------------------ apply


def apply(graph, plan: AutoPlan) -> None:
    """Lay the graph's parameters out as ``plan`` chose (in place: the same Parameter
    objects; every optimizer's state re-laid out) and set its ZeRO stage (before the
    first compile, which shards them)."""
    from ..graph.config import GraphModule

    if plan.zero_stage and not graph.config.zero_stage:
        graph.config.enable_zero(True, stage=plan.zero_stage)
    modules = _modules_named(graph)
    for name in plan.checkpointed:
        GraphModule.of(modules[name]).activation_checkpointing = True
    lay = {k[1]: nd for k, nd in plan.layouts().items() if k[0] == "param"}
    if not lay:
        return
    for top_name, top in graph._modules().items():
        pre = top_name + "."
        mine = {k[len(pre):]: nd for k, nd in lay.items() if k.startswith(pre)}
        if mine:
            top.to_global(plan.placement, lambda name, t, mine=mine: mine.get(name, t.sbp))
    for opt, _ in graph._optimizers:
        opt.relayout()


def box_inputs(plan: AutoPlan, args, kwargs):
    """``args``/``kwargs`` with the tensor inputs the plan lays out boxed to its layouts
    (the others as given)."""
    from torch.utils import _pytree as tpytree

    lay = {k[1]: nd for k, nd in plan.layouts().items() if k[0] == "input"}
    if not lay:
        return args, kwargs
    flat, spec = tpytree.tree_flatten((args, kwargs))
    i = 0
    for j, x in enumerate(flat):
        if isinstance(x, Tensor):
            nd = lay.get(i)
            if nd is not None and x.is_global and tuple(x.sbp) != tuple(nd):
                flat[j] = x.to_global(sbp=nd)
            i += 1
    return tpytree.tree_unflatten(flat, spec)
