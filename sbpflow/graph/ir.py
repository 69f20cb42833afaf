"""The logical graph: what a graph's step computes, as global ops with their SBP
signatures and what each costs, built without moving or computing any data.

:func:`build` runs ``build()`` once on *meta* stand-ins of the graph's inputs, parameters
and buffers (global tensors whose shards are ``torch`` meta tensors: shapes and dtypes,
no storage). Every op goes through sbpflow's one dispatcher as in eager mode, so the
signature chooser, the boxing planner and the dual rule decide what they always decide;
a :class:`Planner` installed as the graph tracer records, instead of running anything:

* each dispatched op as an :class:`OpNode`: its inputs (the values it was given, before
  any boxing), attributes, global metas, every signature the chooser considered
  (:class:`sbpflow.ops.chooser.Candidate`, cheapest first: the chosen one and the
  runner-up) with its cost terms (the bytes of each input's boxing, the algorithm's own
  collectives, the FLOPs of this rank's shard from ``torch.utils.flop_counter``);
* each boxing as a :class:`BoxingNode` with its plan (:func:`sbpflow.boxing.plan_boxing`)
  and bytes: the ones an op's signature implies belong to that op; the ones the user
  wrote (``x.to_global(...)``) stand alone; in backward, the dual rule's;
* every other collective (a global algorithm's own, the data-parallel gradient buckets,
  pipeline transfers) as a :class:`CollectiveNode`.

Collectives return meta tensors of their output's shape (no process group is used, no
rank waits on another). Backward runs too (meta autograd), so the gradient reductions
the layouts imply are in the graph, in their phase.

Signature choice is a pass over this graph (:func:`choose_greedy`: today's greedy
chooser, op by op, from the layouts its inputs have in the graph); a search over layouts
(automatic parallelism) is another pass over the same nodes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..ops import registry as _registry
from ..ops.chooser import Candidate, rank_signatures
from ..ops.registry import probing
from ..tensor import Tensor
from .show import _fmt_bytes
from .trace import Tracer, installed

__all__ = ["BoxingNode", "CollectiveNode", "LogicalGraph", "OpNode", "Planner", "Value",
           "choose_greedy", "cost_terms", "layout", "shard_bytes"]


@dataclass
class Value:
    """A global (or local) tensor value of the logical graph.

    ``kind``: ``input``, ``param``, ``buffer`` (named), ``op`` (an op's output), ``boxing``
    (a boxing's output) or ``made`` (created inside ``build()`` without an op, e.g. a
    creation function). ``placement``/``sbp`` are None for a local tensor. ``view``: an
    op's output that shares its input's storage (reshape, permute, indexing: no memory of
    its own)."""

    id: int
    kind: str
    shape: tuple
    dtype: torch.dtype
    placement: object
    sbp: tuple | None
    name: str | None = None
    label: int = -1  # order of first sight: printed as %label
    view: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}{list(self.shape)} {layout(self.sbp)}"


def shard_bytes(pl, shape, sbp, dtype) -> int:
    """Bytes of one rank's shard of a tensor of ``shape``/``dtype`` laid out ``sbp`` on
    placement ``pl`` (None for either: the whole tensor, a local one)."""
    whole = pl is None or sbp is None
    return math.prod(tuple(shape) if whole else pl.shard_shape(tuple(shape), sbp)) * \
        dtype.itemsize


def layout(nd_sbp) -> str:
    """``S(0)`` on a 1-D mesh, ``[S(0), B]`` on a 2-D one, ``local`` for None."""
    if nd_sbp is None:
        return "local"
    if len(nd_sbp) == 1:
        return repr(nd_sbp[0])
    return "[" + ", ".join(repr(x) for x in nd_sbp) + "]"


@dataclass
class OpNode:
    """One global op. ``inputs``: value ids as the op received them (before boxing);
    ``in_sbps``: their layouts then; ``candidates``: every signature considered, cheapest
    first; ``chosen``: the one that ran (index into ``candidates``); ``flops``: this
    rank's FLOPs under each candidate (None where torch's counter has no formula, e.g.
    elementwise ops); ``boxings``: the boxings the chosen signature implied; ``module``:
    the qualified name of the innermost module whose forward ran it, as the graph names
    its modules (``model.transformer.h.0.attn``; empty outside every module, e.g. in the
    graph's own ``build``, and for a checkpointed block's recomputation in backward)."""

    index: int
    op: str
    spec: object  # sbpflow.ops.registry.OpSpec
    attrs_key: tuple
    metas: tuple
    placement: object
    inputs: list[int]
    outputs: list[int]
    in_sbps: tuple
    candidates: tuple[Candidate, ...]
    chosen: int
    flops: list
    phase: str = "forward"
    inplace: bool = False
    boxings: list = field(default_factory=list)
    module: str = ""

    @property
    def signature(self) -> Candidate:
        return self.candidates[self.chosen]

    @property
    def runner_up(self) -> Candidate | None:
        others = [c for i, c in enumerate(self.candidates) if i != self.chosen]
        return others[0] if others else None


@dataclass
class BoxingNode:
    """A boxing ``src -> dst`` of value ``input`` into value ``output``: its plan's steps
    (collectives) and bytes (each rank sends, :func:`sbpflow.boxing.plan_boxing`'s
    cost). ``owner``: the op node whose signature implied it (None: the user's
    ``to_global``, or the dual rule's in backward). ``deferred``: a parameter's gradient
    boxed into its gradient layout (ZeRO's reduce-scatter), first used by the update: a
    compiled program waits for it there, while backward goes on."""

    index: int
    input: int
    output: int
    src: tuple
    dst: tuple
    placement: object
    plan: object
    phase: str = "forward"
    owner: int | None = None
    deferred: bool = False

    @property
    def bytes(self) -> int:
        return self.plan.bytes

    @property
    def collectives(self) -> list[str]:
        return [s.collective for s in self.plan.steps]


@dataclass
class CollectiveNode:
    """A collective outside any boxing: ``kind`` over ``ranks`` (mesh ``axis``), moving
    ``bytes`` (the tensor this rank hands in). ``inflight``: started and waited for
    later (:func:`sbpflow.distributed.all_reduce_async`: a data-parallel gradient
    bucket's, launched while backward runs and waited for at its end)."""

    index: int
    kind: str
    axis: int | None
    ranks: tuple
    bytes: int
    phase: str = "forward"
    inflight: bool = False


def _fmt_sig(c: Candidate) -> str:
    return f"{', '.join(layout(s) for s in c.ins)} -> {layout(c.out)}"


def cost_terms(c: Candidate, pl) -> dict:
    """A candidate's cost terms, in bytes each rank sends and collectives: ``boxing_bytes``
    and ``boxing_collectives`` (its inputs' boxings), ``own_bytes``/``own_collectives``
    (a global algorithm's), and ``cost``: the chooser's single number, bytes plus a
    start-up cost per collective (:data:`sbpflow.boxing.plan.LATENCY_BYTES` of the
    placement's backend)."""
    from ..boxing import backend_of
    from ..boxing.plan import LATENCY_BYTES

    lat = LATENCY_BYTES[backend_of(pl)]
    nb = sum(n for _, n in c.boxing)
    no = c.own[1] if len(c.own) > 1 else 0
    return {"boxing_bytes": c.boxing_cost - nb * lat, "boxing_collectives": nb,
            "own_bytes": c.own[0] - no * lat, "own_collectives": no,
            "cost": c.boxing_cost + c.own[0]}


class LogicalGraph:
    """What :func:`build` records: ``values`` (id -> :class:`Value`) and ``nodes`` (op,
    boxing and collective nodes in the order they ran; forward, then backward).
    ``print()`` shows each op's chosen signature, its cost and the runner-up's."""

    def __init__(self, name: str):
        self.name = name
        self.values: dict[int, Value] = {}
        self.nodes: list = []
        self.notes: list[str] = []  # what the graph stands for (micro-batch, not modelled)
        # bytes of this rank's tensors autograd saved for backward in the forward (one
        # micro-batch; the step's inputs, parameters, buffers and ZeRO's gathered
        # parameters left out: held anyway)
        self.saved_bytes: int | None = None
        # the same, each saved storage as (the position in ``nodes`` where the forward
        # saved it first, its bytes): backward frees it once it has passed that position
        self.saved_at: list[tuple[int, int]] = []
        # ZeRO's gathered parameters on this rank: stages 1/2 all of them (held for the
        # step), stage 3 the largest one module gathers at a time; 0 without ZeRO
        self.gathered_bytes: int = 0
        # modules activation checkpointing recomputes in backward (their ops: phase
        # "backward" in the graph)
        self.recomputed_modules: int = 0
        # torch ops the step's forward and backward dispatch on this rank (one
        # micro-batch; :class:`_CallCounter`): the calls a compiled program makes, what its
        # host time is made of (the update's are not counted)
        self.calls: int = 0

    # --------------------------------------------------------------------- queries
    def ops(self, phase: str | None = None) -> list[OpNode]:
        return [n for n in self.nodes if isinstance(n, OpNode)
                and (phase is None or n.phase == phase)]

    def boxings(self, phase: str | None = None, implied: bool | None = None
                ) -> list[BoxingNode]:
        """Boxing nodes (of ``phase``); ``implied``: only those a signature implied
        (True) or only the others (False)."""
        return [n for n in self.nodes if isinstance(n, BoxingNode)
                and (phase is None or n.phase == phase)
                and (implied is None or (n.owner is not None) == implied)]

    def collectives(self, phase: str | None = None) -> list[CollectiveNode]:
        return [n for n in self.nodes if isinstance(n, CollectiveNode)
                and (phase is None or n.phase == phase)]

    def comm_bytes(self, phase: str | None = None) -> int:
        """Bytes each rank sends in boxings and collectives (of ``phase``)."""
        return sum(n.bytes for n in self.boxings(phase)) + \
            sum(n.bytes for n in self.collectives(phase))

    def producer(self, value_id: int):
        """The node whose output ``value_id`` is (None for inputs, parameters, buffers)."""
        for n in self.nodes:
            outs = n.outputs if isinstance(n, OpNode) else \
                [n.output] if isinstance(n, BoxingNode) else []
            if value_id in outs:
                return n
        return None

    def _name(self, vid: int) -> str:
        v = self.values.get(vid)
        if v is None:
            return "%?"
        return f"%{v.name}" if v.name else f"%{v.label}"

    # --------------------------------------------------------------------- printing
    def __str__(self) -> str:
        ops = self.ops()
        lines = [f"logical graph of {self.name}: {len(ops)} ops, "
                 f"{len(self.boxings())} boxings, {len(self.collectives())} other "
                 f"collectives; forward {_fmt_bytes(self.comm_bytes('forward'))}, backward "
                 f"{_fmt_bytes(self.comm_bytes('backward'))} sent per rank"]
        lines += [f"  ({note})" for note in self.notes]
        lines.append("  (signatures ranked by the bytes each rank sends plus a start-up cost "
                     "per collective, as sbpflow.boxing.plan_boxing ranks plans)")
        named = [v for v in self.values.values() if v.kind in ("input", "param", "buffer")]
        for v in named:
            lines.append(f"  {v.kind:<6} {self._name(v.id)}: {v.describe()}")
        shown = {v.id for v in named}
        made = {o for n in self.nodes for o in
                (n.outputs if isinstance(n, OpNode) else
                 [n.output] if isinstance(n, BoxingNode) else [])}
        phase = None
        for n in self.nodes:
            if n.phase != phase:
                phase = n.phase
                lines.append(f"{phase}:")
            if isinstance(n, OpNode):
                for i in n.inputs:  # a value no recorded node made: say what it is, once
                    if i not in shown and i not in made and i in self.values:
                        shown.add(i)
                        lines.append(f"  {self._name(i)}: {self.values[i].describe()} (made "
                                     f"outside the dispatcher: a view, a creation or a "
                                     f"local op)")
                lines.extend(self._op_lines(n))
            elif isinstance(n, BoxingNode):
                if n.owner is not None:
                    continue  # shown under its op
                lines.append(f"  box {self._name(n.input)} -> {self._name(n.output)}: "
                             f"{layout(n.src)} -> {layout(n.dst)} "
                             f"{'+'.join(n.collectives)} {_fmt_bytes(n.bytes)}")
            else:
                lines.append(f"  {n.kind} over ranks {list(n.ranks)}: {_fmt_bytes(n.bytes)}")
        return "\n".join(lines)

    def _op_lines(self, n: OpNode) -> list[str]:
        outs = ", ".join(self._name(o) for o in n.outputs)
        ins = ", ".join(self._name(i) for i in n.inputs)
        out_v = self.values.get(n.outputs[0]) if n.outputs else None
        meta = f": {out_v.describe()}" if out_v is not None else ""
        c = n.signature
        lines = [f"  {outs} = {n.op}{' (in place)' if n.inplace else ''}({ins}){meta}",
                 f"      signature {_fmt_sig(c)}: {_fmt_terms(c, n.placement, n.flops[n.chosen])}"]
        for b in n.boxings:
            lines.append(f"      box {self._name(b.input)}: {layout(b.src)} -> {layout(b.dst)} "
                         f"{'+'.join(b.collectives)} {_fmt_bytes(b.bytes)}")
        r = n.runner_up
        if r is not None:
            tc, tr = cost_terms(c, n.placement), cost_terms(r, n.placement)
            db = (tr["boxing_bytes"] + tr["own_bytes"]) - (tc["boxing_bytes"] + tc["own_bytes"])
            dn = (tr["boxing_collectives"] + tr["own_collectives"]) - \
                (tc["boxing_collectives"] + tc["own_collectives"])
            why = "a tie, broken by the inputs' own layouts and the rule's order" \
                if (db, dn) == (0, 0) else \
                f"{'+' if db >= 0 else '-'}{_fmt_bytes(abs(db))}, {dn:+d} collective(s)"
            lines.append(f"      runner-up {_fmt_sig(r)}: {_fmt_terms(r, n.placement, None)} "
                         f"({why})")
        return lines


def _fmt_terms(c: Candidate, pl, flops) -> str:
    t = cost_terms(c, pl)
    out = f"boxing {_fmt_bytes(t['boxing_bytes'])}"
    if t["boxing_collectives"]:
        out += f" in {t['boxing_collectives']} collective(s)"
    if t["own_collectives"]:
        out += f", own {_fmt_bytes(t['own_bytes'])} in {t['own_collectives']} collective(s)"
    if flops:
        out += f", {flops:.3g} FLOPs on this rank"
    return out


# ------------------------------------------------------------------------------ planner


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class _CallCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch ops dispatched while :func:`build` runs the step on meta
    stand-ins (``calls``), but not ``detach``/``alias`` (a compiled program strips
    them), ``empty`` (the planner's own meta outputs), nor probes
    (:func:`sbpflow.ops.registry.probing`: the dispatcher's output metas, the FLOP
    counter's, the attention kernel's choice; the dispatcher caches its metas, so the
    first graph of a process counted a block's forward more). The logical graph's
    ``calls``: the compiled program's kernel calls within 3% (gpt-mini 520; its program's
    586 nodes add tuple unpacking and the fused update); autocast's casts are not
    counted."""

    _SKIP = frozenset({"detach", "alias", "empty", "_fused_sdp_choice"})

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _registry.PROBES[0] and func.__name__.split(".")[0] not in self._SKIP:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _shard_flops(cache: dict, spec, attrs_key, metas, sbps, pl) -> int | None:
    """FLOPs of ``spec``'s kernel on this rank's shards of inputs of ``metas`` laid out
    ``sbps`` (torch's flop counter on meta tensors; None where it has no formula or the
    kernel does not run on meta tensors). ``cache``: the planner's, by op, attributes and
    shard shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    shapes = tuple(pl.shard_shape(m.shape, s) for m, s in zip(metas, sbps))
    key = (spec.name, attrs_key, shapes, tuple(m.dtype for m in metas))
    if key not in cache:
        args = [torch.empty(sh, dtype=m.dtype, device="meta") for sh, m in zip(shapes, metas)]
        try:
            with FlopCounterMode(display=False) as fc:
                spec.kernel(*args, **dict(attrs_key))
            cache[key] = fc.get_total_flops() or None
        except Exception:  # noqa: BLE001 - a cost term, not a result: unknown
            cache[key] = None
    return cache[key]


class Planner(Tracer):
    """The tracer that builds a :class:`LogicalGraph`: installed while ``build()`` runs on
    meta stand-ins; the dispatcher, the boxing executor and the collectives report to it
    (``planning = True`` tells them not to move data)."""

    planning = True
    solo = False  # built by this rank alone: see build()

    def __init__(self, graph_name: str):
        super().__init__(graph_name)
        self.graph = LogicalGraph(graph_name)
        self.keep: list = []  # the recorded locals stay alive: their ids name values
        self.in_boxing = 0
        self.muted = False  # preparing the stand-ins (ZeRO's re-layout): not the step
        self.modules: list[str] = []  # qualified names of the modules running, inner last
        self.flops_cache: dict = {}

    # --------------------------------------------------------------------- values
    def value(self, t, kind: str = "made", name: str | None = None) -> int:
        """The id of ``t``'s value (a Tensor or a torch tensor), registered on first sight."""
        local = t._local if isinstance(t, Tensor) else t
        vid = id(local)
        if vid not in self.graph.values:
            self.keep.append(local)
            glob = isinstance(t, Tensor) and t.is_global
            self.graph.values[vid] = Value(
                vid, kind, tuple(t.shape), t.dtype, t.placement if glob else None,
                t.sbp if glob else None, name, len(self.graph.values))
        return vid

    # --------------------------------------------------------------------- reports
    def on_op(self, spec, attrs_key, metas, sbps, pl, sig, inputs, out,
              inplace: bool = False) -> None:
        if self.muted:
            return
        ins = [self.value(t) for t in inputs]
        outs = [out] if isinstance(out, Tensor) else \
            [o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, Tensor)]
        out_ids = []
        for o in outs:
            vid = self.value(o, "op")
            self.graph.values[vid].view = bool(o._local._is_view())
            out_ids.append(vid)
        cands = rank_signatures(spec, attrs_key, metas, sbps, pl, inplace)
        if sig is None or not cands:  # an in-place op with no signature keeping its layout
            return
        chosen = next(i for i, c in enumerate(cands) if (c.ins, c.out) == tuple(sig))
        # the FLOPs of the chosen signature and of the runner-up (the others: not shown)
        flops: list = [None] * len(cands)
        for i in {chosen, 0 if chosen else 1} & set(range(len(cands))):
            with probing():  # the FLOP counter's runs are not the step's
                flops[i] = _shard_flops(self.flops_cache, spec, attrs_key, metas,
                                        cands[i].ins, pl)
        node = OpNode(len(self.graph.nodes), spec.name, spec, attrs_key, metas, pl, ins,
                      out_ids, tuple(sbps), cands, chosen, flops, _phase(), inplace,
                      module=self.modules[-1] if self.modules else "")
        # the boxings this signature implied: recorded just before, from these inputs
        want = {(i, s, d) for i, s, d in zip(ins, sbps, cands[chosen].ins) if s != d}
        for b in reversed(self.graph.nodes):
            if not want:
                break
            if isinstance(b, BoxingNode) and b.owner is None and \
                    (b.input, b.src, b.dst) in want:
                b.owner = node.index
                want.discard((b.input, b.src, b.dst))
                node.boxings.insert(0, b)
        self.graph.nodes.append(node)

    def on_boxing(self, x_in: torch.Tensor, x_out: torch.Tensor, plan,
                  deferred: bool = False) -> None:
        if self.muted:
            return
        first, last = plan.steps[0], plan.steps[-1]
        src_pl, src, dst = first.placement, first.in_sbp, last.out_sbp
        dst_pl = last.dst_placement or last.placement
        if id(x_in) not in self.graph.values:  # a shard not seen yet (a backward gradient)
            self.keep.append(x_in)
            self.graph.values[id(x_in)] = Value(id(x_in), "grad", tuple(plan.shape),
                                                x_in.dtype, src_pl, src, None,
                                                len(self.graph.values))
        self.keep.append(x_out)
        self.graph.values[id(x_out)] = Value(id(x_out), "boxing", tuple(plan.shape),
                                             x_out.dtype, dst_pl, dst, None,
                                             len(self.graph.values))
        self.graph.nodes.append(BoxingNode(len(self.graph.nodes), id(x_in), id(x_out), src,
                                           dst, dst_pl, plan, _phase(), deferred=deferred))

    def on_collective(self, kind: str, axis, ranks, t, nbytes: int | None = None,
                      inflight: bool = False) -> None:
        if self.muted:
            return
        if self.in_boxing:
            return  # a step of the boxing being recorded
        n = t.nbytes if t is not None else int(nbytes or 0)
        self.graph.nodes.append(CollectiveNode(len(self.graph.nodes), kind, axis, ranks, n,
                                               _phase(), inflight))


# ------------------------------------------------------------------------------ build


def _stand_in(t, requires_grad: bool | None = None, sbp: tuple | None = None):
    """A meta twin of sbpflow tensor ``t``: same global shape, dtype, placement and
    nd-SBP (and gradient layout); its shard a meta tensor of this rank's shard shape.
    ``sbp``: another nd-SBP for the twin (a layout being priced; gradient layout the
    same)."""
    relaid = sbp is not None and t.is_global and tuple(sbp) != tuple(t.sbp)
    nd = tuple(sbp) if relaid else t.sbp
    shape = t.placement.shard_shape(tuple(t.shape), nd) if relaid else t._local.shape
    local = torch.empty(shape, dtype=t.dtype, device="meta")
    twin = Tensor(local, t.placement, nd, tuple(t.shape)) if t.is_global else Tensor(local)
    rg = t.requires_grad if requires_grad is None else requires_grad
    if rg:
        if not relaid and t.is_global and t.grad_sbp is not None and t.grad_sbp != t.sbp:
            twin.set_grad_sbp(t.grad_sbp)
        else:
            twin.requires_grad_(True)
    return twin


@contextlib.contextmanager
def _meta_module_state(modules, planner: Planner, relayout=None,
                       layouts: dict | None = None) -> Iterator[dict]:
    """Swap every parameter and buffer of ``modules`` (and their submodules) for its meta
    stand-in, registered in the planner's graph under its qualified name; put back after.
    ``layouts``: ``id(original) -> nd-SBP`` for stand-ins laid out otherwise than their
    originals (a candidate layout). ``relayout(twins)`` (the parameters': ``id(original)
    -> stand-in``) may re-lay out the stand-ins first (ZeRO). Yields the ``twins`` map
    (parameters and buffers)."""
    layouts = layouts or {}
    swapped, twins, names = [], {}, {}
    try:
        for prefix, top in modules.items():
            for mname, mod in top.named_modules():
                for kind, table in (("param", mod._parameters), ("buffer", mod._buffers)):
                    for name, t in list(table.items()):
                        if t is None or not isinstance(t, Tensor):
                            continue
                        if id(t) not in twins:
                            twins[id(t)] = _stand_in(
                                t, None if kind == "param" else False, layouts.get(id(t)))
                            names[id(t)] = (kind, ".".join(x for x in (prefix, mname, name)
                                                           if x))
                        table[name] = twins[id(t)]
                        swapped.append((table, name, t))
        if relayout is not None:
            planner.muted = True
            try:
                relayout({k: t for k, t in twins.items() if names[k][0] == "param"})
            finally:
                planner.muted = False
        for key, twin in twins.items():
            planner.value(twin, *names[key])
        yield twins
    finally:
        for table, name, t in swapped:
            table[name] = t


# What the logical graph does not show of a step (printed in its header).
_NOT_MODELLED = ("autocast (meta tensors carry no device: dtypes are as without AMP)",
                 "the optimizers' update")


def build(graph, args: tuple, kwargs: dict, device: str,
          layouts: dict | None = None, solo: bool = False) -> LogicalGraph:
    """The logical graph of ``graph``'s step on inputs like ``args``/``kwargs`` (the first
    micro-batch under gradient accumulation), built from meta stand-ins: no data moves, no
    parameter, buffer, optimizer or generator state changes. The step transforms apply as in a
    compiled step (:data:`sbpflow.graph.compiler.STEP_TRANSFORMS`: ZeRO's layouts and
    gathers - the layouts the first call would choose when it has not run yet -,
    activation checkpointing's recomputation, the loss scaled by ``1/m``), except what
    :data:`_NOT_MODELLED` lists. ``device``: the parameters' device type (autocast's).
    Call it on every rank of the graph's placements (the layouts' sub-groups are created
    as in a real step). :meth:`sbpflow.nn.Graph.lower` refuses pipelines before.

    ``layouts`` (a layout being priced, e.g. by automatic parallelism): ``id(parameter or
    buffer) -> nd-SBP`` and ``("input", i) -> nd-SBP`` (the ``i``-th tensor input in pytree
    order) lay those stand-ins out so instead of as the originals are.

    ``solo``: this rank builds the graph alone (the other ranks build others: an
    auto-parallel search sharing its pricing); an exchange with them (a metadata
    exchange, an agreement check, a new process group) raises
    :class:`sbpflow.distributed.SoloExchangeError` instead of waiting."""
    from torch.utils import _pytree as tpytree

    from . import compiler, passes

    modules = graph._modules()
    all_modules = [m for top in modules.values() for m in top.modules()]
    planner = Planner(type(graph).__name__)
    planner.solo = solo
    cfg = graph.config
    m = cfg.grad_acc_steps
    planner.graph.notes = ([f"micro-batch 1 of {m} (gradient accumulation)"] if m > 1 else []) \
        + [f"not modelled: {x}" for x in _NOT_MODELLED
           if "autocast" not in x or cfg.amp_dtype is not None]
    a, kw = passes.micro_batch(args, kwargs, m, 0)
    names = _input_names(graph, a, kw)

    layouts = layouts or {}

    flat, spec = tpytree.tree_flatten((a, kw))
    i = 0  # the tensor inputs' count: their names and layouts' index
    for j, x in enumerate(flat):
        if isinstance(x, Tensor):
            flat[j] = _stand_in(x, sbp=layouts.get(("input", i)))
            planner.value(flat[j], "input", names[i])
            i += 1
    a, kw = tpytree.tree_unflatten(flat, spec)
    ctx = compiler.CompileContext(graph, cfg, all_modules, device)
    planner.context = ctx

    def zero(twins):  # ZeRO's layouts on the stand-ins: the graph's, or the first call's
        if graph._zero is not None:
            ctx.zero12 = {id(twins[k]): v for k, v in graph._zero12.items() if k in twins}
            ctx.zero3 = {id(twins[k]): v for k, v in graph._zero3.items() if k in twins}
        elif cfg.zero_stage and graph._optimizers:
            ctx.zero12, ctx.zero3 = compiler.ZeroSharding.relayout(twins.values(), cfg)

    skip = ("update", "tied parameters")
    saved: dict[int, torch.Tensor] = {}
    first: dict[int, int] = {}  # id(storage) -> the graph's node count when first saved

    def record(t):  # what the forward keeps for backward, by storage (a view: its base's)
        if _phase() == "forward":  # (not a checkpointed block's recomputation)
            base = t._base if t._base is not None else t
            if id(base) not in saved:
                saved[id(base)] = base
                first[id(base)] = len(planner.graph.nodes)
        return t

    # the transforms whose own saved-tensor hooks hide the saves (ZeRO-3, checkpointing)
    # report them here; ZeRO-1/2 leave their gathered copies in ctx.zero_full
    ctx.on_saved = record
    with installed(planner), _meta_module_state(modules, planner, zero, layouts), \
            _generators_kept(), contextlib.ExitStack() as stack, \
            torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        _track_modules(modules, planner.modules, stack)
        for t in compiler.STEP_TRANSFORMS:
            if t.name not in skip and t.enabled(ctx):
                stack.enter_context(t.scope(ctx))
                stack.enter_context(t.micro_batch(ctx, 0, True))
        with _CallCounter() as counter:
            graph.build(*a, **kw)
        full = {id(f._local): f._local for f in ctx.zero_full.values()}
        per_module = [sum(shard_bytes(p.placement, p.shape, ctx.zero3[id(p)], p.dtype)
                          for p in mod._parameters.values()
                          if p is not None and id(p) in ctx.zero3) for mod in all_modules]
    held = {k for k, v in planner.graph.values.items() if v.kind in ("input", "param", "buffer")}
    lg = planner.graph
    lg.recomputed_modules = len(compiler.ActivationCheckpointing.marked(ctx))
    lg.calls = counter.calls
    lg.gathered_bytes = sum(f.numel() * f.element_size() for f in full.values()) + \
        max(per_module, default=0)
    lg.saved_at = [(first[k], b.numel() * b.element_size()) for k, b in saved.items()
                   if k not in held and k not in full]
    lg.saved_bytes = sum(n for _, n in lg.saved_at)
    return lg


def _track_modules(modules: dict, names: list[str], stack) -> None:
    """Keep ``names`` the qualified names of the modules of ``modules`` (the graph's,
    ``{attribute: module}``) whose forward is running, innermost last, through forward
    hooks that ``stack`` removes when it closes."""
    def enter(name):
        def hook(mod, args):
            names.append(name)
        return hook

    def leave(mod, args, out):
        if names:
            names.pop()

    for top_name, top in modules.items():
        for name, mod in top.named_modules(prefix=top_name):
            stack.callback(mod.register_forward_pre_hook(enter(name)).remove)
            stack.callback(mod.register_forward_hook(leave).remove)


@contextlib.contextmanager
def _generators_kept() -> Iterator[None]:
    """Put torch's generators back as they were: the draws of ``build()`` on stand-ins
    (dropout's seeds) must not move the next real step's (found by a run whose
    automatic-parallelism search lowered 40 layouts before its first step)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _input_names(graph, args, kwargs) -> list[str]:
    """A name for each tensor input, in pytree order of ``(args, kwargs)``: ``build()``'s
    parameter name (``x``), ``*args`` by position (``ins[1]``), a container's leaf by
    its index (``batch[0]``), a keyword by its name."""
    import inspect

    from torch.utils import _pytree as tpytree

    try:
        params = list(inspect.signature(graph.build).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "input")
    bases = [positional[i].name if i < len(positional) else
             f"{star}[{i - len(positional)}]" for i in range(len(args))]
    out = []
    for base, value in [*zip(bases, args), *kwargs.items()]:
        leaves = tpytree.tree_flatten(value)[0]
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                out.append(base if len(leaves) == 1 else f"{base}[{j}]")
    return out


# ------------------------------------------------------------------------------ passes


def choose_greedy(g: LogicalGraph) -> int:
    """Signature choice as a pass over the logical graph: each op, in order, takes the
    chooser's cheapest signature for the layouts its inputs have *in the graph* (an
    input's producer's chosen output layout; a user's boxing's destination; a named
    value's own), exactly as eager dispatch chooses. Updates ``chosen``, ``in_sbps`` and
    the op's implied boxings' layouts; returns how many ops changed signature (0 on a
    graph just built: the pass reproduces the dispatcher)."""
    layout = {vid: v.sbp for vid, v in g.values.items()}
    changed = 0
    for n in g.nodes:
        if isinstance(n, BoxingNode):
            if n.owner is None:
                layout[n.output] = n.dst
            continue
        if not isinstance(n, OpNode) or n.phase != "forward":
            continue
        sbps = tuple(layout.get(i) for i in n.inputs)
        if any(s is None for s in sbps):
            continue  # a local input: nothing to choose
        cands = rank_signatures(n.spec, n.attrs_key, n.metas, sbps, n.placement, n.inplace)
        if not cands:
            continue
        if cands[0].ins != n.signature.ins or cands[0].out != n.signature.out:
            changed += 1
        n.candidates, n.chosen, n.in_sbps = cands, 0, sbps
        for o in n.outputs:
            layout[o] = cands[0].out
    return changed
