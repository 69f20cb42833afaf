"""The graph compiler's transforms and passes: the functions. Which run, and in what order,
is listed once, in :mod:`sbpflow.graph.compiler` (``STEP_TRANSFORMS``,
``PROGRAM_PASSES``).

Two kinds, by what they act on:

* **Step transforms** change what the step *is* before it is traced, so the dispatcher,
  the chooser and the autograd dual rule see the rewritten program and lay everything out
  consistently (a ZeRO-3 parameter stored ``S(0)`` gets its gather from the boxing planner
  and its gradient reduce-scatter from the gather's dual, as any layout would):
  :func:`zero_layouts` (once per graph), :func:`micro_batches` / :func:`combine`,
  :func:`autocast`, :func:`checkpointing`, :func:`zero_step_gathers`,
  :func:`zero3_gathers`, :class:`ForeignParams`, and the update (:func:`optimizer_step`,
  or torch's fused kernels for optimizers whose groups all set ``fused=True``;
  :mod:`sbpflow.graph.graph`).

* **Program passes** act on the traced per-rank ``torch.fx`` program, graph to graph:
  :func:`strip` (profiler markers, ``detach`` no-ops of a replay without autograd),
  :func:`empty_values` (a pure value without elements, such as what a rank computes for
  a pipeline stage it is not in, made a fresh empty tensor), :func:`dead_code`
  (dead-code removal; in-place updates, collectives and RNG kept), :func:`pipeline` (each
  rank's program in its schedule's action list's order, transfers at their actions;
  zero-bubble splits each backward into input and weight gradients), :func:`overlap`
  (each collective started as early as its inputs and the collective order allow, its
  wait moved to the first use),
  and :func:`compile_program` (``torch.compile``) when ``config.enable_compile()``.
  Each edits the graph and regenerates the module's code (``gm.recompile()``), unless
  called with ``recompile=False``, as the pass manager
  (:func:`sbpflow.graph.compiler.run_program_passes`) calls them: it generates the code
  once, after the last pass.

Every rank applies the same deterministic passes to a program traced from the same
step, so the collectives keep one order on every rank (the overlap pass never reorders
two collectives).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as tpytree

from ..distributed import _comm
from ..optim import Optimizer
from ..tensor import Tensor

__all__ = ["ForeignParams", "autocast", "checkpointing", "combine", "dead_code",
           "empty_values", "micro_batches", "optimizer_step", "overlap", "pipeline", "strip",
           "task", "unique", "zero3_gathers", "zero_layouts", "zero_step_gathers"]


def unique(items) -> list:
    """``items`` without repeats (by identity), in order."""
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


# ====================================================================== step passes


def micro_batches(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    """Cut every tensor among ``args``/``kwargs`` into ``m`` micro-batches along dim 0:
    ``[micro_batch(args, kwargs, m, k) for k in range(m)]``."""
    return [micro_batch(args, kwargs, m, k) for k in range(m)]


def micro_batch(args: tuple, kwargs: dict, m: int, k: int) -> tuple[tuple, dict]:
    """Micro-batch ``k`` of ``m`` of every tensor among ``args``/``kwargs``, cut along
    dim 0.

    Each rank cuts its own shard (no data moves): micro-batch ``k`` is the global tensor
    whose shard on every rank is the ``k``-th ``1/m`` of that rank's shard (a view), same
    placement and nd-SBP, dim 0 ``1/m`` as long. For a batch laid out ``S(0)`` over
    ``n`` ranks, micro-batch ``k`` holds rows ``r*B/n + k*B/(n*m) ...`` of each rank
    ``r``; for ``B`` it is the global rows ``k*B/m ...``. Non-tensor arguments are passed
    to every micro-batch unchanged.

    Raises:
        ValueError: a tensor whose shard's dim 0 is not divisible by ``m`` (names it).
    """
    if m == 1:
        return args, kwargs

    def cut(x, where: str):
        if not isinstance(x, Tensor):
            return x
        if x.ndim == 0 or x._local.shape[0] % m or x.shape[0] % m:
            which = "is 0-d" if x.ndim == 0 else \
                f"its shard {tuple(x._local.shape)} on this rank" if x._local.shape[0] % m \
                else f"its global dim 0 of {x.shape[0]} (a shard on another rank)"
            raise ValueError(
                f"gradient accumulation over {m} micro-batches: input {where} of global "
                f"shape {tuple(x.shape)} cannot be cut into {m} equal parts along dim 0: "
                f"{which}; make the batch (and each rank's part of it) divisible by {m}")
        rows = x._local.shape[0] // m
        part = x._local.narrow(0, k * rows, rows)  # also of an empty shard
        if x.is_local:
            return Tensor(part)
        return Tensor(part, x.placement, x.sbp, (x.shape[0] // m, *x.shape[1:]))

    return (tuple(cut(a, f"{i}") for i, a in enumerate(args)),
            {key: cut(v, repr(key)) for key, v in kwargs.items()})


def combine(outputs: list):
    """One output from the micro-batches' ``build()`` outputs, packed as OneFlow's
    ``nn.Graph`` packs them under gradient accumulation: a 0-d tensor (a loss) becomes a
    1-D tensor of ``n`` values, one per micro-batch in order (``.mean()`` is the step's
    loss); other tensors are concatenated along dim 0 shard by shard (the inverse of
    :func:`micro_batches`, so rows keep the input's order); anything else comes from the
    last micro-batch. One micro-batch: the output as it is."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(combine([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: combine([o[k] for o in outputs]) for k in first}
    if isinstance(first, Tensor):
        if first.ndim == 0:
            from ..ops.view import stack

            return stack(outputs)
        local = torch.cat([o._local for o in outputs])
        if first.is_local:
            return Tensor(local)
        return Tensor(local, first.placement, first.sbp,
                      (first.shape[0] * len(outputs), *first.shape[1:]))
    return outputs[-1]


def autocast(device_type: str, dtype: torch.dtype | None):
    """AMP: ``torch.autocast(device_type, dtype)`` around the forward and backward (the
    casts land in the program as ops); a no-op context when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


# -------------------------------------------------------------- activation checkpointing

_lib = torch.library.Library("sbpflow", "FRAGMENT")  # noqa: TID251 - ops the program replays
_lib.define("rng_get(str device) -> Tensor")
_lib.define("rng_set(Tensor state, str device) -> ()")


def _rng_get(device: str) -> torch.Tensor:
    if device == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _rng_set(state: torch.Tensor, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


_lib.impl("rng_get", _rng_get, "CompositeExplicitAutograd")
_lib.impl("rng_set", _rng_set, "CompositeExplicitAutograd")
RNG_OPS = (torch.ops.sbpflow.rng_get.default, torch.ops.sbpflow.rng_set.default)


@contextlib.contextmanager
def checkpointing(ctx, modules: list) -> Iterator[None]:
    """Activation checkpointing of ``modules``: each one's forward runs under
    ``torch.utils.checkpoint.checkpoint`` (non-reentrant), so its inner activations are
    not kept and the forward runs again in backward, collectives included. Set as the
    modules' forward wrappers in the compile context ``ctx`` (``Module.__call__`` calls
    them while the step traces).

    The generator state is read (an op of the program, ``sbpflow::rng_get``) before the
    forward and restored around the recomputation, so random draws repeat in the program
    as in eager mode (torch's own ``preserve_rng_state`` reads the state in Python,
    which a replayed program would not repeat). Likewise the module's buffers: the
    recomputation sees their values of the forward and leaves them as the forward left
    them (BatchNorm's running statistics and batch count are updated once per forward,
    as in eager mode, not a second time by the recomputation)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    device = ctx.device

    def wrapper(mod):
        buffers = [b for b in mod.buffers() if b is not None]

        def forward(fwd, args, kwargs):
            state = torch.ops.sbpflow.rng_get(device)
            before = [b._local.clone() for b in buffers]  # as the forward finds them
            calls = []

            def run(*a, **k):
                if not calls:  # the forward
                    calls.append(1)
                    return fwd(*a, **k)
                # the recomputation: the forward's generator state and buffers, then back
                saved = torch.ops.sbpflow.rng_get(device)
                after = [b._local.clone() for b in buffers]
                torch.ops.sbpflow.rng_set(state, device)
                for b, v in zip(buffers, before):
                    b._local.copy_(v)
                # the module's own ZeRO-3 parameters are gathered again, as its forward
                # hook had them (found by the fresh-user trial: a checkpointed Linear)
                zero3 = ctx.zero3_hooks.get(id(mod))
                regather = zero3 is not None and id(mod) not in ctx.zero3_swapped
                if regather:
                    zero3[0](mod, a)
                try:
                    return fwd(*a, **k)
                finally:
                    if regather:
                        zero3[1](mod, a, None)
                    torch.ops.sbpflow.rng_set(saved, device)
                    for b, v in zip(buffers, after):
                        b._local.copy_(v)

            if ctx.on_saved is not None:  # what the block keeps: its tensor inputs
                for x in tpytree.tree_leaves((args, kwargs)):
                    if isinstance(x, (Tensor, torch.Tensor)):
                        ctx.on_saved(x._local if isinstance(x, Tensor) else x)
            # the whole forward again: torch's early stop would skip the forward hooks
            # of the block's last modules (a ZeRO-3 gather left in place, found by the
            # fresh-user trial)
            with set_checkpoint_early_stop(False):
                return checkpoint(run, *args, use_reentrant=False,
                                  preserve_rng_state=False, **kwargs)

        return forward

    for mod in modules:
        ctx.forward_wrappers[id(mod)] = wrapper(mod)
    try:
        yield
    finally:
        for mod in modules:
            ctx.forward_wrappers.pop(id(mod), None)


# ------------------------------------------------------------------ the optimizer update

OPTIM_OPS = (Optimizer.PROGRAM_OP,)


def optimizer_step(opt, found_inf=None) -> None:
    """The update of ``opt`` (an sbpflow optimizer) inside a traced step, with the
    arithmetic of eager mode: :meth:`sbpflow.optim.Optimizer.program_step`, one program
    op (``sbpflow::optimizer_step``) that runs the optimizer's own torch ``step()`` on the
    program's gradients at every call, so the learning rates, step counts and kernels
    (torch's for-loop, ``foreach`` or ``fused`` implementation, as the param groups
    choose) are those an eager ``opt.step()`` uses. ``found_inf`` (float16 loss scaling):
    the step is skipped when it is set.

    (Tracing the update's kernels instead would need the step counts and learning rates
    as tensors, which only torch's fused kernels take; they round differently from the
    for-loop and ``foreach`` kernels, and AdamW carries such last-bit differences into
    later steps: a graph then drifts from the eager run it should equal.)"""
    opt.program_step(found_inf)


# ------------------------------------------------------------------------------- ZeRO


def zero_layouts(params: list, stage: int, min_size: int) -> list:
    """ZeRO as layout changes, over every mesh axis on which a parameter is ``B``.

    At every stage the parameter itself is re-laid out ``S(0)`` there (each rank stores its
    shard, as OneFlow's ``enable_zero`` leaves a graph's parameters after the first call)
    and its gradient layout becomes ``S(0)`` (``p.set_grad_sbp``): the gradient is
    reduce-scattered and the optimizer steps the shard. What differs is when the full
    parameter exists: stages 1/2 gather each parameter once per step and hold it for the
    step (:func:`zero_step_gathers`); stage 3 gathers it just before its module runs and
    again in backward (:func:`zero3_gathers`). Parameters with fewer than ``min_size``
    elements, 0-d ones and local ones are left as they are.

    Returns the sharded parameters with their original nd-SBP: ``[(param, sbp), ...]``.
    """
    from ..nn.module import _rebind
    from ..sbp import split

    gathered = []
    for p in params:
        if not p.is_global or p.ndim == 0 or p.numel() < min_size:
            continue
        axes = [a for a, s in enumerate(p.sbp) if s.is_broadcast()]
        if not axes:
            continue
        dst = tuple(split(0) if a in axes else s for a, s in enumerate(p.sbp))
        orig = p.sbp
        with torch.no_grad():
            shard = p.detach().to_global(p.placement, dst)
        _rebind(p, shard)
        p.set_grad_sbp(dst)  # the gradient lives as the parameter does: shard-sized
        gathered.append((p, orig))
    return gathered


@contextlib.contextmanager
def zero_step_gathers(modules: list, layouts: dict, full: dict | None = None
                      ) -> Iterator[None]:
    """ZeRO stages 1/2: each ``S(0)``-stored parameter of ``modules`` (``layouts``:
    id(param) -> the nd-SBP to gather to) is all-gathered once, when the step starts, and
    the full copy stands in for it in every module that holds it until the block ends.
    ``full`` (optional) is filled with ``id(param) -> its full copy`` for the block
    (the logical graph's memory record tells them from activations).

    The full copy is a leaf of its own whose gradient is laid out ``S(0)``, as the
    parameter's: data-parallel gradients are reduce-scattered once, after the last
    micro-batch (``no_sync`` holds the earlier ones as partial sums), not once per
    micro-batch as a differentiable gather's dual would. On leaving the block normally the
    gradients move to the parameters, where the optimizers find them."""
    if not layouts:
        yield
        return
    gathered: dict[int, tuple] = {}  # id(param) -> (param, its gathered leaf)
    swapped = []
    try:
        for mod in modules:
            for name, p in list(mod._parameters.items()):
                if p is None or id(p) not in layouts:
                    continue
                if id(p) not in gathered:
                    with torch.no_grad():
                        f = p.detach().to_global(p.placement, layouts[id(p)])
                    if p.requires_grad:
                        f.set_grad_sbp(p.grad_sbp)  # also makes it require grad
                    gathered[id(p)] = (p, f)
                    if full is not None:
                        full[id(p)] = f
                mod._parameters[name] = gathered[id(p)][1]
                swapped.append((mod, name, p))
        yield
        for p, f in gathered.values():
            if f.grad is not None:
                p.grad = f.grad if p.grad is None else p.grad + f.grad
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p
        if full is not None:
            full.clear()


@contextlib.contextmanager
def zero3_gathers(ctx, layouts: dict) -> Iterator[None]:
    """ZeRO-3: before each module in ``modules`` runs, its own ``S(0)``-stored parameters
    (``layouts``: id(param) -> the nd-SBP to gather to) are boxed to their gathered
    layout (an all-gather, differentiable: its dual reduce-scatters the gradient into the
    shard), and put back after.

    ``ctx``: the compile context (its modules; the per-module state lives in its
    ``zero3_hooks`` and ``zero3_swapped``). The gathered parameter lives only while its
    module runs: what autograd would save of
    it for backward (a linear's weight, or a view of it) is saved as a recipe instead
    (``torch.autograd.graph.saved_tensors_hooks``) and all-gathered again when backward
    needs it, as FSDP and DeepSpeed ZeRO-3 re-gather in backward. A copy made from it
    (an autocast cast) is saved as it is. The program's overlap pass starts each gather
    while the module before runs (:func:`overlap`)."""
    hooks = []
    # a gathered parameter's storage -> (shard, layout, the gathered tensor kept alive)
    live: dict[int, tuple] = {}

    def pre(mod, args):
        swapped = {}
        for name, p in mod._parameters.items():
            if p is not None and id(p) in layouts:
                swapped[name] = p
                full = p.to_global(p.placement, layouts[id(p)])
                mod._parameters[name] = full
                if full._local.numel():
                    live[_storage_key(full._local)] = (p, layouts[id(p)], full._local)
        ctx.zero3_swapped[id(mod)] = swapped

    def post(mod, args, out):
        for name, p in ctx.zero3_swapped.pop(id(mod), {}).items():
            full = mod._parameters[name]
            if full._local.numel():
                live.pop(_storage_key(full._local), None)
            mod._parameters[name] = p

    def pack(t):
        hit = live.get(_storage_key(t)) if live and isinstance(t, torch.Tensor) and \
            t.numel() else None
        if hit is None:
            if ctx.on_saved is not None:
                ctx.on_saved(t)  # (this hook hides the saves from an outer one)
            return t
        return _Regather(hit[0], hit[1], tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(saved):
        if not isinstance(saved, _Regather):
            return saved
        with torch.no_grad():
            full = saved.shard.to_global(saved.shard.placement, saved.layout)._local
        return full.as_strided(saved.shape, saved.stride, saved.offset)

    if not layouts:
        yield
        return
    for mod in ctx.modules:
        if any(p is not None and id(p) in layouts for p in mod._parameters.values()):
            hooks.append(mod.register_forward_pre_hook(pre))
            hooks.append(mod.register_forward_hook(post))
            ctx.zero3_hooks[id(mod)] = (pre, post)  # for checkpointing's recomputation
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for h in hooks:
            h.remove()
        ctx.zero3_hooks.clear()
        ctx.zero3_swapped.clear()


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` reads: its address; on meta tensors (every address 0, the
    logical graph's stand-ins) the identity of the tensor it is a view of."""
    if t.device.type == "meta":
        return id(t._base if t._base is not None else t)
    return t.untyped_storage().data_ptr()


class _Regather:
    """A saved gathered ZeRO-3 parameter (or a view of it), kept as its shard and the
    view's geometry: backward gathers it again."""

    __slots__ = ("shard", "layout", "shape", "stride", "offset")

    def __init__(self, shard, layout, shape, stride, offset):
        self.shard, self.layout = shard, layout
        self.shape, self.stride, self.offset = shape, stride, offset


# ------------------------------------------------------------------------- pipeline


def task(kind: str, micro_batch: int, on: bool = True):
    """Label what the step traces inside the block as pipeline task ``kind`` (``"F"``,
    ``"B"`` or ``"U"``, the update) of ``micro_batch``: the program's nodes carry it in
    ``node.meta["custom"]["pp"]`` (``torch.fx.traceback.annotate``), and
    :func:`pipeline` orders the tasks. ``on=False``: nothing."""
    if not on:
        return contextlib.nullcontext()
    from torch.fx import traceback as fx_traceback

    return fx_traceback.annotate({"pp": (kind, micro_batch)})


def stand_in(outputs):
    """Micro-batch outputs not traced (:func:`replicate_micro_batches` fills them in):
    ``outputs`` (a traced micro-batch's ``build()`` result) with every tensor cloned, so
    that the program has one node per output the copies then replace."""
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(stand_in(o) for o in outputs)
    if isinstance(outputs, dict):
        return {k: stand_in(v) for k, v in outputs.items()}
    if isinstance(outputs, Tensor):
        with torch.no_grad():
            local = outputs._local.clone()
        return Tensor(local) if outputs.is_local else \
            Tensor(local, outputs.placement, outputs.sbp, outputs.shape)
    if isinstance(outputs, torch.Tensor):
        with torch.no_grad():
            return outputs.clone()
    return outputs


@dataclass
class Replication:
    """How a step was traced with micro-batches left out (see
    :func:`replicate_micro_batches`): ``m`` micro-batches, of which ``traced`` ran
    (``0``, ``1`` and ``m - 1``); the world's transfer sequence numbers
    (``distributed._state.p2p_seq``) before and after micro-batch 1 and at the end of the
    trace."""

    m: int
    seq_before: int = 0
    seq_after: int = 0
    seq_end: int = 0

    @property
    def traced(self) -> tuple[int, ...]:
        return (0, 1, self.m - 1)

    @property
    def span(self) -> int:
        return self.seq_after - self.seq_before

    def shift(self, k: int) -> int:
        """What copy ``k`` adds to micro-batch 1's transfer numbers: its transfers come
        after the whole trace's and the earlier copies'."""
        return self.seq_end + (k - 2) * self.span - self.seq_before

    @property
    def seq_final(self) -> int:
        """The world's transfer count once the copies are numbered (the next trace's
        start)."""
        return self.seq_end + (self.m - 3) * self.span


class NotReplicable(Exception):
    """The traced micro-batch 1 cannot stand for the untraced ones (what uses it, and
    where); the step is traced again with every micro-batch."""


def _updates(node: fx.Node, value: fx.Node) -> bool:
    """``node`` is an in-place update of ``value`` that returns it (``add_``, ``copy_``:
    its schema's first return aliases the written argument ``value`` is passed as)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False
    ret = schema.returns[0].alias_info
    for i, a in enumerate(schema.arguments):
        v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if v is value and a.alias_info is not None and a.alias_info.is_write and \
                set(a.alias_info.before_set) == set(ret.before_set):
            return True
    return False


def _chain_root(n: fx.Node) -> fx.Node:
    """The value a chain of in-place updates (each returning its first argument)
    started from."""
    while n.args and isinstance(n.args[0], fx.Node) and _updates(n, n.args[0]):
        n = n.args[0]
    return n


def _base_labels(g: fx.Graph) -> dict:
    """node -> ``(kind, micro-batch)``: its trace label (:func:`task`), or the label of
    the node before it (the first labelled node's predecessors: none)."""
    base: dict = {}
    cur = None
    for n in g.nodes:
        if n.op in ("placeholder", "output"):
            continue
        lab = n.meta.get("custom", {}).get("pp")
        if lab is not None:
            cur = tuple(lab)
        if cur is not None:
            base[n] = cur
    return base


def replicate_micro_batches(gm: fx.GraphModule, rep: Replication,
                            recompile: bool = True) -> fx.GraphModule:
    """Complete a step traced with micro-batches ``0``, ``1`` and ``m - 1`` only into
    the step of all ``m``: micro-batch 1's forward and backward (its nodes, the
    *template*) copied as micro-batches ``2 .. m - 2``, in place, in order.

    Every micro-batch runs the same ``build()`` on another cut of the inputs, so a middle
    micro-batch's nodes are micro-batch 1's with (each copy ``k``):

    * the input cut: micro-batch 1's (:func:`micro_batch`, labelled ``("I", 1)``) is
      replaced by micro-batch ``k``'s, traced for every ``k``;
    * what carries over from one micro-batch to the next: an in-place update of a value
      of an earlier micro-batch (a gradient accumulated over the micro-batches, a
      running statistic) updates the previous copy's result instead (the same buffer,
      and the chain keeps them in order), and a read of a buffer as micro-batch 0 last
      updated it reads it as the previous copy last updated it (a checkpointed module's
      buffers, restored after each recomputation); micro-batch ``m - 1`` continues from
      copy ``m - 2``;
    * transfers: a fresh tag per copy, the same on every rank (each transfer's tag is
      its sequence number in the world, ``rep``'s numbers continued);
    * the outputs: the stand-ins traced for micro-batch ``k`` (:func:`stand_in`,
      labelled ``("O", k)``) are replaced by the copy's outputs.

    Anything else micro-batch 1 reads (parameters, a gathered or boxed copy of them made
    once per step) every copy reads too: checked, a value of micro-batch 0 it reads must
    be read by micro-batch ``m - 1`` as well (else it is passed from one micro-batch to
    the next, which a copy cannot tell).

    Raises:
        NotReplicable: a node outside micro-batches 1 and ``m - 1`` (the update, another
            micro-batch) reads a value of micro-batch 1 other than its outputs; micro-batch
            1 reads a value of micro-batch 0 that micro-batch ``m - 1`` does not; the
            template's transfers are not numbered as ``rep`` says.
    """
    g = gm.graph
    m = rep.m
    base = _base_labels(g)
    template = [n for n in g.nodes if base.get(n, ("U", 0))[0] in ("F", "B") and
                base[n][1] == 1]
    inside = set(template)
    cuts: dict = {}  # k -> micro-batch k's input cut nodes, in order
    outs: dict = {}
    for n in g.nodes:
        lab = base.get(n)
        if lab is not None and lab[0] == "I":
            cuts.setdefault(lab[1], []).append(n)
        elif lab is not None and lab[0] == "O":
            outs.setdefault(lab[1], []).append(n)
    last = m - 1
    results = {o.args[0] for k in outs for o in outs[k]}  # micro-batch 1's outputs
    for t in template:
        for u in t.users:
            lab = base.get(u)
            if u in inside or (lab is not None and (lab[1] == last and lab[0] in ("F", "B")
                                                    or lab[0] == "O")):
                continue
            if t in results and lab is not None and lab[0] == "U":
                continue  # combined with the other micro-batches' outputs
            raise NotReplicable(f"{u.name} ({lab}) reads {t.name} of micro-batch 1: "
                                f"{u.format_node()[:300]}")
    def in_last(n):
        lab = base.get(n)
        return lab is not None and lab[0] in ("F", "B") and lab[1] == last

    # a buffer updated in place in every micro-batch (a running statistic, a checkpointed
    # module's buffers restored after its recomputation): its last update in micro-batch 1
    last_update: dict = {}
    for t in template:
        if t.args and isinstance(t.args[0], fx.Node) and _updates(t, t.args[0]):
            last_update[_chain_root(t)] = t

    def updated_since(a):  # a read of such a buffer as micro-batch 0 left it
        return a.args and isinstance(a.args[0], fx.Node) and _updates(a, a.args[0]) and \
            _chain_root(a) in last_update

    for t in template:  # what micro-batch 1 takes from micro-batch 0
        for a in t.all_input_nodes:
            lab = base.get(a)
            if lab is None or lab[0] not in ("F", "B") or lab[1] != 0 or _updates(t, a) \
                    or updated_since(a):
                continue
            if not any(in_last(u) for u in a.users):
                raise NotReplicable(
                    f"micro-batch 1 reads {a.name} of micro-batch 0, which micro-batch "
                    f"{last} does not (a value passed from one micro-batch to the next): "
                    f"{t.format_node()[:300]}")
    cut_of = {n: i for i, n in enumerate(cuts.get(1, []))}
    for k in range(2, last):
        if len(cuts.get(k, [])) != len(cut_of):
            raise NotReplicable(f"micro-batch {k} has {len(cuts.get(k, []))} input cuts, "
                                f"micro-batch 1 {len(cut_of)}")
    p2p = _comm._p2p_ops().p2p_start.default
    for t in template:
        if t.target is p2p:
            seqs = {_comm.p2p_seq(tag) for tag in t.args[2]}
            lo, hi = _comm.p2p_seq(_comm.p2p_tag(rep.seq_before)), \
                _comm.p2p_seq(_comm.p2p_tag(rep.seq_after))
            if not all(lo < q <= hi for q in seqs):
                raise NotReplicable(f"transfer {t.name} (sequence {sorted(seqs)}) is not "
                                    f"one of micro-batch 1's ({lo}, {hi}]")

    def first_after(k):  # after micro-batch 1: the first node of a later micro-batch
        n = template[-1].next
        while n.op != "output":
            lab = base.get(n)
            if lab is not None and lab[0] != "U" and lab[1] > k:
                return n
            n = n.next
        raise NotReplicable(f"nothing of micro-batch {k + 1} was traced after micro-batch 1")

    prev = {t: t for t in template}  # template node -> its copy in the previous micro-batch
    for k in range(2, last):
        env: dict = {}
        shift = rep.shift(k)

        def arg(a, t, k=k, env=env, prev=prev):
            if a in env:
                return env[a]
            lab = base.get(a)
            if lab == ("I", 1):
                return cuts[k][cut_of[a]]
            if lab is not None and lab[0] in ("F", "B") and lab[1] == 0:
                if _updates(t, a):
                    return prev[t]  # the previous micro-batch's update of the same value
                if updated_since(a):  # the value as the previous micro-batch left it
                    return prev[last_update[_chain_root(a)]]
            return a

        with g.inserting_before(first_after(k)):
            for t in template:
                new = g.node_copy(t, lambda a, t=t, arg=arg: arg(a, t))
                if t.target is p2p:
                    tags = [_comm.p2p_tag(_comm.p2p_seq(tag) + shift) for tag in t.args[2]]
                    new.args = (*new.args[:2], tags, *new.args[3:])
                meta = dict(t.meta)
                if "custom" in meta:
                    meta["custom"] = {**meta["custom"], "pp": (base[t][0], k)}
                new.meta = meta
                env[t] = new
        for o in reversed(outs.get(k, [])):
            src = o.args[0] if o.target is torch.ops.aten.clone.default else None
            if src not in env:
                raise NotReplicable(f"output stand-in {o.format_node()} of micro-batch {k} "
                                    f"is not a copy of micro-batch 1's output")
            o.replace_all_uses_with(env[src])
            g.erase_node(o)
        for t in template:
            prev[t] = env[t]
    if last > 2:
        for n in list(g.nodes):
            lab = base.get(n)
            if lab is not None and lab[1] == last and lab[0] in ("F", "B"):
                for a in list(n.all_input_nodes):
                    if a in inside:
                        n.replace_input_with(a, prev[a])
    g.lint()
    if recompile:
        gm.recompile()
    return gm


class ForeignParams:
    """A pipeline step's copies of parameters used on another stage than theirs (a tied
    weight: GPT's embedding, used by ``lm_head`` on the last stage); see
    :class:`sbpflow.graph.compiler.TiedParameters`."""

    def __init__(self) -> None:
        self.copies: dict[tuple, tuple] = {}  # (id(param), placement) -> (param, copy)

    def get(self, p, pl):
        from ..runtime.stages import stage_placement_sbp

        key = (id(p), pl)
        hit = self.copies.get(key)
        if hit is None:
            with torch.no_grad():
                copy = p.detach().to_global(pl, stage_placement_sbp(p, pl))
            copy.requires_grad_(p.requires_grad)
            hit = self.copies[key] = (p, copy)
        return hit[1]

    def flush(self) -> None:
        """Send each copy's gradient (summed over the step's micro-batches) back to its
        parameter's placement and add it to the parameter's gradient."""
        for p, copy in self.copies.values():
            g = copy.grad
            if g is None:
                continue
            back = g.to_global(p.placement, p.grad_sbp or p.sbp)
            p.grad = back if p.grad is None else p.grad + back
        self.copies.clear()


# ====================================================================== program passes

_DETACH = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def _is_collective(target) -> bool:
    """A collective's start or wait: torch's functional collectives and the transfer ops."""
    return getattr(target, "namespace", None) == "_c10d_functional" or \
        target in (_P2P, _P2P_WAIT, _p2p_wait)


def _is_wait(target) -> bool:
    return target in (_COLLECTIVE_WAIT, _P2P_WAIT, _p2p_wait)


#: The checks a program makes of its data at every call (an id out of a table's range:
#: ``torch._assert_async``): they return nothing anyone uses, and must stay.
ASSERT_OPS = (torch.ops.aten._assert_async.default, torch.ops.aten._assert_async.msg)


def _impure(node: fx.Node) -> bool:
    t = node.target
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    if _is_collective(t) or t in RNG_OPS or t in OPTIM_OPS or t in ASSERT_OPS:
        return True
    schema = getattr(t, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = getattr(t, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def strip(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Remove what a replay without autograd does not need: ``detach``/``alias`` nodes
    (their users read the input) and the profiler's ``record_function`` markers."""
    g = gm.graph
    profiler = []
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DETACH:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
        elif getattr(node.target, "namespace", None) == "profiler":
            profiler.append(node)
    for node in reversed(profiler):  # exits (users) before their enters
        g.erase_node(node)
    if recompile:
        gm.recompile()
    return gm


_EMPTY = torch.ops.aten.empty_strided.default


def _written_args(user: fx.Node, schema) -> list:
    """The values ``user`` passes for the arguments its schema marks written."""
    return [user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """``user`` may write into ``node``'s value (an argument its schema marks written, or
    no schema to tell)."""
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return True
    return any(v is node or (isinstance(v, (list, tuple)) and any(x is node for x in v))
               for v in _written_args(user, schema))


def empty_values(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Make each pure value without elements a fresh empty tensor of its shape, stride,
    dtype and device, so that :func:`dead_code` drops what computed it.

    A rank traces every op of the step, and an op on a global tensor whose placement does
    not hold the rank runs there on empty shards: a pipeline stage's forward and backward
    ran, on empty tensors, on every other stage's ranks (a GPT's last stage's blocks,
    head and loss on stage 0, their gradients' chains of views and sums), each one a call
    of the replay. No element, no data: only the value's metadata matters, which the new
    ``empty_strided`` keeps (and the node's labels, such as its pipeline task). Left as
    they are: impure nodes (in-place updates, collectives, RNG: their effect counts),
    values read from a collective's result (a send's handle, empty, which its wait
    needs) and values that a user writes into (an in-place update of a parameter's empty
    shard)."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is _EMPTY or _impure(node):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() != 0:
            continue
        if any(a.op == "call_function" and _is_collective(a.target)
               for a in node.all_input_nodes):
            continue
        if any(u.op == "call_function" and _writes(u, node) for u in node.users):
            continue
        with g.inserting_before(node):
            new = g.call_function(_EMPTY, (list(val.shape), list(val.stride())),
                                  {"dtype": val.dtype, "device": val.device})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
    if recompile:
        gm.recompile()
    return gm


def _writes_nothing(node: fx.Node) -> bool:
    """An in-place aten op (not a collective, generator or optimizer op) whose written
    arguments all have no elements: it changes no data (an empty shard's gradient
    accumulated on a rank outside the stage's placement, once per micro-batch)."""
    t = node.target
    schema = getattr(t, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable or \
            _is_collective(t) or t in RNG_OPS or t in OPTIM_OPS or \
            getattr(t, "namespace", None) != "aten":
        return False
    written = _written_args(node, schema)
    vals = [v.meta.get("val") if isinstance(v, fx.Node) else None for v in written]
    return bool(written) and isinstance(node.args[0], fx.Node) and \
        all(isinstance(val, torch.Tensor) and val.numel() == 0 for val in vals)


def dead_code(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Remove nodes whose results nothing uses, except in-place updates, collectives, the
    generator ops (they act by side effect) and the data checks (:data:`ASSERT_OPS`), and
    in-place updates that write no element (:func:`_writes_nothing`; their users read
    the written input instead)."""
    g = gm.graph
    changed = True
    while changed:
        changed = False
        for node in reversed(list(g.nodes)):
            if _writes_nothing(node):
                node.replace_all_uses_with(node.args[0])
                g.erase_node(node)
                changed = True
            elif not node.users and not _impure(node):
                g.erase_node(node)
                changed = True
    if recompile:
        gm.recompile()
    return gm


def _mutates(node: fx.Node) -> bool:
    """An in-place update or a generator op (not a collective): nothing moves across it."""
    return node.op == "call_function" and _impure(node) and not _is_collective(node.target)


_COLLECTIVE_WAIT = torch.ops._c10d_functional.wait_tensor.default
_P2P = _comm._p2p_ops().p2p_start.default
_P2P_WAIT = torch.ops.sbpflow.p2p_wait.default
_GATHERS = (torch.ops._c10d_functional.all_gather_into_tensor.default,)

#: ZeRO-3 prefetch depth: an all-gather starts no earlier than the wait of the
#: all-gather this many before it, so at most this many gathered buffers are in flight
#: (2: about one module ahead, a linear's weight and bias). Unbounded, every gather of a
#: forward would start at the top of the step and hold the whole model gathered.
GATHERS_IN_FLIGHT = 2


def overlap(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """Start each collective as soon as its inputs exist and wait for it only just
    before its result is first used.

    The collectives keep their traced order (a collective never moves above the one
    before it): every rank issues them in one order, which the backends require. Nothing
    moves across an in-place update (a collective reads its input while in flight, and an
    update may alias it). A wait moves down to its first user; a start moves up to just
    after the last of its input producers, the previous collective's start and the last
    in-place update; an all-gather, in addition, after the wait of the all-gather
    :data:`GATHERS_IN_FLIGHT` before it (bounded ZeRO-3 prefetch). Gradient buckets then
    reduce while backward computes earlier layers; a ZeRO-3 gather runs while the module
    before it computes.

    In a pipeline program (after :func:`pipeline`) nothing moves out of its task: the
    schedule's order is what bounds the micro-batches in flight (moving a backward's
    compute past the next forward's send, as step 3 did, ran 1F1B's first stage with one
    more micro-batch's activations alive than the schedule allows).
    """
    g = gm.graph
    # 1. waits down: to the first user, stopping at an in-place update
    for node in list(g.nodes):
        if node.op != "call_function" or not _is_wait(node.target) or not node.users:
            continue
        target, cur = None, node.next
        while cur.op != "output" and cur not in node.users and not _mutates(cur) and \
                _task(cur) == _task(node):
            target, cur = cur, cur.next
        if target is not None:
            target.append(node)
    # 2. starts up: after input producers, the previous start and the last update
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prev, last_update = None, None
    gathers: list[fx.Node] = []
    for node in nodes:
        if _mutates(node):
            last_update = node
            continue
        if node.op != "call_function" or not _is_collective(node.target) or \
                _is_wait(node.target):
            continue
        after = list(node.all_input_nodes) + [n for n in (prev, last_update) if n is not None]
        if _task(node) is not None:  # not above the first node of its pipeline task
            k = node.prev
            while k.op != "root" and _task(k) == _task(node):
                k = k.prev
            if k.op != "root":
                after.append(k)
        if node.target in _GATHERS:  # bounded prefetch: not above an earlier gather's wait
            if len(gathers) >= GATHERS_IN_FLIGHT:
                after += [u for u in gathers[-GATHERS_IN_FLIGHT].users if _is_wait(u.target)]
            gathers.append(node)
        anchor = max(after, key=lambda n: index[n]) if after else None
        prev = node
        if anchor is not None and index[anchor] + 1 < index[node]:
            anchor.append(node)
            nodes = list(g.nodes)
            index = {n: i for i, n in enumerate(nodes)}
    # 3. independent work down: what precedes a start but does not feed it (a weight
    # gradient's matmul beside the input gradient being all-reduced) runs after it, while
    # the collective is in flight
    _sink_independent(g)
    g.lint()
    if recompile:
        gm.recompile()
    return gm


def _task(node: fx.Node):
    """The pipeline task a node runs in (``node.meta["pp_task"]``, set by :func:`pipeline`;
    None outside a pipeline program and for the program's head and tail)."""
    return node.meta.get("pp_task")


def _sink_independent(g: fx.Graph) -> None:
    """Move the nodes between the last collective or in-place update before each
    collective start and that start, which the start does not depend on, to just after
    it (their order kept). Their inputs stay before them; their users come after the
    start already or move with them."""
    nodes = list(g.nodes)
    for s in [n for n in nodes if n.op == "call_function" and _is_collective(n.target)
              and not _is_wait(n.target)]:
        order = list(g.nodes)
        pos = order.index(s)
        lo = pos
        while lo > 0:
            k = order[lo - 1]
            if k.op != "call_function" or _mutates(k) or _is_collective(k.target) or \
                    _task(k) != _task(s):
                break
            lo -= 1
        window = order[lo:pos]
        if not window:
            continue
        needed, stack = set(), list(s.all_input_nodes)
        inside = set(window)
        while stack:
            k = stack.pop()
            if k in inside and k not in needed:
                needed.add(k)
                stack.extend(k.all_input_nodes)
        anchor = s
        for k in window:
            if k not in needed:
                anchor.append(k)
                anchor = k


def pipeline(gm: fx.GraphModule, actions: list, stage_of: dict | None = None,
             neighbours: frozenset = frozenset(), pipe_rank: dict | None = None,
             recompile: bool = True) -> fx.GraphModule:
    """Reorder this rank's program into its pipeline actions: ``actions`` is the rank's
    list of :class:`sbpflow.runtime.schedules.Action` (``schedules.build(...)[rank]``):
    the compute tasks ``F``/``B``/``W`` of a stage and micro-batch, the transfers
    ``SEND_*``/``RECV_*`` and ``UPDATE`` last. The program runs them in the list's order;
    within a task the traced order is kept. Each node records its task in
    ``node.meta["pp_task"]`` (``(kind, micro-batch, stage)``, ``("U", 0, None)`` for the
    update).

    Which task a node belongs to (:func:`_task_labels`): the forward or backward and the
    micro-batch from the trace's labels (:func:`task`); the stage, where the rank holds
    several (interleaved), from the staged module that ran the node in forward, and in
    backward from the data: a node joins the latest of its inputs' tasks (a saved
    activation of stage ``c`` puts it in ``c``'s backward), a node without such inputs
    (a receive buffer) the earliest of its users'.

    Transfers (:func:`_transfers`): a point-to-point start of a task's forward (backward)
    that only sends to (only receives from) ranks of the pipeline rank the list's
    ``SEND_*`` (``RECV_*``) action of that task names is that action's: a receive (its
    buffer, start, wait and the copy out) runs at the action's place, right before the
    task that consumes it; a send's start right after the task that produced it. Other
    transfers (a tied weight between the first and the last stage, its gradient in the
    update) stay where their task traced them.

    Zero-bubble (the list has ``W`` tasks): each backward's nodes are split
    (:func:`_split_backward`): ``B`` holds what the task's outgoing gradient sends
    (``SEND_B``) depend on, ``W`` the rest (the weight gradients, their accumulation over
    micro-batches and reductions). The first stage sends nothing back: its whole backward
    is ``W`` (its ``B`` is empty; under ZB-H1 the two are adjacent on that rank anyway).

    The plan is a valid order of the rank's own dependencies: a micro-batch's forward
    precedes its backward, and the forwards of a stage keep their order (random draws,
    running statistics), as do its backwards (accumulated gradients). Transfers are
    tagged (a receive pairs with its send whatever the order between two ranks), and the
    ranks of one stage run one plan, so their collectives pair up.

    Each point-to-point wait is named (``stage_of``: rank -> its stages): a transfer that
    cannot complete (the peer stage's rank exited, hung or diverged) raises
    :class:`sbpflow.distributed.CollectiveError` naming the send or receive, the
    micro-batch and the stages. ``neighbours``: the ranks of the neighbouring stages;
    ``pipe_rank``: global rank -> pipeline rank (what an action's ``peer`` counts in;
    default: the same number).

    Raises:
        GraphError: a node that would run before its input (a step whose tasks depend on
            each other otherwise), or, in an interleaved plan, a random draw that cannot
            be taken ahead of its task (:func:`_hoist_draws`).
    """
    from ..runtime.schedules import COMM
    from .trace import GraphError

    g = gm.graph
    tasks = [_task_of(a) for a in actions if a.kind not in COMM]
    labels = _task_labels(g, tasks)
    chunks = {t[2] for t in tasks if t[0] == "F"}
    if len(chunks) > 1:
        _hoist_draws(g, labels)
    transfers = _transfers(g, labels, actions, pipe_rank or {})
    weights = {(t[1], t[2]) for t in tasks if t[0] == "W"}
    if weights:
        _split_backward(g, labels, weights, transfers)
    placed: dict = {}  # node -> the transfer action it runs at
    for key, starts in transfers.items():
        for start in starts:
            for n in _transfer_nodes(start, labels, receive=key[0].startswith("RECV")):
                placed[n] = key
                labels[n] = (key[0][-1],) + key[1:]  # F or B (not W) of the task
    groups: dict = {_task_of(a): [] for a in actions}
    head, tail = [], []
    for node in g.nodes:
        if node.op == "output":
            tail.append(node)
        elif node in placed:
            groups[placed[node]].append(node)
        elif node in labels:
            groups[labels[node]].append(node)
        else:
            head.append(node)
    order = head + [n for a in actions for n in groups[_task_of(a)]] + tail
    pos = {n: i for i, n in enumerate(order)}
    for n in order:
        for a in n.all_input_nodes:
            if pos[a] > pos[n]:
                raise GraphError(
                    f"pipeline: in the planned order {n.name} (task {labels.get(n)}) would "
                    f"run before its input {a.name} (task {labels.get(a)}): a task depends "
                    f"on a later one")
    anchor = order[0]  # re-link in the new order (fx: append moves a node)
    for n in order[1:]:
        anchor.append(n)
        anchor = n
    for n, lab in labels.items():
        n.meta["pp_task"] = lab
    # A send completes when its peer receives, which the plan may put later than this
    # rank's next receive: sends do not block. With one stage per rank, a neighbouring
    # stage receives in the order this rank sends (1F1B, GPipe, ZB-H1: forwards one way,
    # backwards the other, in micro-batch order), so a send to a neighbour is waited just
    # before the next task's first send to it: one task's sends in flight per neighbour,
    # not every micro-batch's. The sends of one task stay in flight together (the peer
    # may receive them in a task that sends first). Sends to other stages (a tied weight
    # between the first and last stage) and all sends of an interleaved plan are waited at
    # the end of the step: their receivers' order interleaves with other ranks' waits,
    # which can close a cycle.
    out = tail[0]
    pending: dict = {}  # peer -> waits of this rank's sends to it, not yet placed
    moved: set = set()
    for n in list(g.nodes):
        if n.target is _P2P and len(chunks) == 1:
            for op, peer in zip(n.args[0], n.args[1]):
                if op != "isend" or peer not in neighbours:
                    continue
                keep = []
                for w in pending.get(peer, []):
                    if labels.get(w.args[0].args[0]) != labels.get(n):
                        n.prepend(w)  # a send of an earlier task: wait for it now
                    else:
                        keep.append(w)  # this task's own sends stay in flight together
                pending[peer] = keep
        if n.target is _P2P_WAIT and _is_send(n.args[0]) and n not in moved:
            moved.add(n)
            src, i = n.args[0].args
            if len(chunks) == 1:
                pending.setdefault(src.args[1][i], []).append(n)
            out.prepend(n)
    me = _rank()
    stage_of = stage_of or {}
    for n in list(g.nodes):
        if n.target is _P2P_WAIT and _is_p2p(n.args[0]):
            src, i = n.args[0].args
            op, peer = src.args[0][i], src.args[1][i]
            kind, k, stage = labels.get(src, ("?", "?", "?"))
            n.target = _p2p_wait
            n.kwargs = {"what": (
                f"{'send to' if op == 'isend' else 'receive from'} rank {peer} (stage "
                f"{stage_of.get(peer, '?')}) in the {'forward' if kind == 'F' else 'backward'}"
                f" of micro-batch {k} on rank {me} (stage {stage})")}
    g.lint()
    if recompile:
        gm.recompile()
    return gm


def _task_of(a) -> tuple:
    """An action's key, as the pass's task labels: ``(kind, micro-batch, stage)``;
    ``("U", 0, None)`` for ``UPDATE``."""
    return ("U", 0, None) if a.kind == "UPDATE" else (a.kind, a.micro_batch, a.stage)


def _transfers(g: fx.Graph, labels: dict, actions: list, pipe_rank: dict) -> dict:
    """``(transfer kind, micro-batch, stage)`` (:func:`_task_of` of a ``SEND_*`` or
    ``RECV_*`` action of ``actions``) -> the point-to-point starts that are that action:
    starts labelled with the forward (backward) of ``stage`` on ``micro-batch`` whose
    operations all send (all receive) and whose peers are all ranks of the action's
    pipeline rank (``pipe_rank``: global rank -> pipeline rank)."""
    wanted = {_task_of(a): a.peer for a in actions if a.kind.startswith(("SEND", "RECV"))}
    out: dict = {}
    for n in g.nodes:
        if n.target is not _P2P or labels.get(n, ("U",))[0] not in ("F", "B"):
            continue
        kind, k, stage = labels[n]
        ops, peers = n.args[0], n.args[1]
        if len(set(ops)) != 1:
            continue
        key = ("SEND_" if ops[0] == "isend" else "RECV_") + kind, k, stage
        if key in wanted and all(pipe_rank.get(q, q) == wanted[key] for q in peers):
            out.setdefault(key, []).append(n)
    return out


def _transfer_nodes(start: fx.Node, labels: dict, receive: bool) -> list:
    """The nodes that move with a transfer's start to its action's place: the start and
    its handles; for a receive also the buffer it receives into (what the start reads that
    its task computes: a fresh ``empty``) and the copy of the data into the buffer; and
    the wait (a send's, which :func:`pipeline` then moves on). Nothing that writes moves
    ahead (only the receive's own copy into its fresh buffer)."""
    task = labels[start]
    out = [start]
    if receive:
        stack = list(start.all_input_nodes)
        while stack:
            a = stack.pop()
            if labels.get(a) != task or a in out:
                continue
            if _mutates(a) or _is_collective(a.target):
                return []  # not a fresh buffer: the receive stays in its task
            out.append(a)
            stack.extend(a.all_input_nodes)
    for h in start.users:
        out.append(h)
        for w in h.users:
            if w.target is _P2P_WAIT:
                out.append(w)
                out += [c for c in w.users if receive and c.args[1] is w and
                        c.target is torch.ops.aten.copy_.default and c.args[0] in out]
    return out


def _view_root(n):
    """The value ``n`` is a view of (``n`` itself when it is not an aten view)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.args and \
            isinstance(n.args[0], fx.Node):
        schema = getattr(n.target, "_schema", None)
        ret = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if ret is None or ret.is_write:
            break
        n = n.args[0]
    return n


def _split_backward(g: fx.Graph, labels: dict, weights: set, transfers: dict) -> None:
    """Zero-bubble: relabel each backward task ``("B", k, s)`` whose ``W`` is planned
    (``weights``: ``(k, s)``) into ``B`` and ``W``. ``B`` is what the task's gradient sends
    to the previous stage (its ``SEND_B`` starts in ``transfers``) depend on in the task,
    closed under inputs; and every in-place update, generator op, random draw (which
    advances the generator: an activation-checkpointed module's dropout redrawn between
    the generator's restore and its reset) or other side effect of the task except an
    update of a ``W`` value only (a weight gradient accumulated over the micro-batches),
    with what it reads, and with the task's earlier readers of what it writes. The rest
    is ``W``: the weight gradients, their accumulation and their reductions (which then
    start after the input gradient is sent). A stage that sends nothing back (the first)
    has an empty ``B`` (up to such side effects): its whole backward is ``W``. Tasks are
    split in micro-batch order, so an accumulation's target from an earlier micro-batch
    is already ``W``."""
    by_task: dict = {}
    for n in g.nodes:
        lab = labels.get(n)
        if lab is not None and lab[0] == "B" and (lab[1], lab[2]) in weights:
            by_task.setdefault(lab, []).append(n)
    for (_, k, s), nodes in sorted(by_task.items(), key=lambda kv: kv[0][1]):
        inside = set(nodes)
        keep: set = set()

        def take(n, inside=inside, keep=keep):
            stack = [n]
            while stack:
                x = stack.pop()
                if x in inside and x not in keep:
                    keep.add(x)
                    stack.extend(x.all_input_nodes)

        for start in transfers.get(("SEND_B", k, s), []):
            for a in start.all_input_nodes:
                take(a)

        def is_w(v, inside=inside, keep=keep):
            if not isinstance(v, fx.Node):
                return False
            if v in inside:
                return v not in keep
            lab = labels.get(v)
            return lab is not None and lab[0] == "W"

        index = {n: i for i, n in enumerate(nodes)}
        changed = True
        while changed:
            changed = False
            for i, n in enumerate(nodes):
                if n in keep or n.op != "call_function" or not _mutates(n):
                    continue
                schema = getattr(n.target, "_schema", None)
                written = [] if schema is None else [
                    x for v in _written_args(n, schema)
                    for x in (v if isinstance(v, (list, tuple)) else [v])]
                if written and not _draws(n) and \
                        all(is_w(v) and is_w(_view_root(v)) for v in written):
                    continue  # it writes W values only, and no generator state
                take(n)
                for v in written:  # earlier readers of what it writes keep their order
                    for u in getattr(v, "users", ()):
                        if u in inside and index[u] < i:
                            take(u)
                changed = True
        for n in nodes:
            if n not in keep:
                labels[n] = ("W", k, s)


_FRESH = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
          torch.ops.aten.empty_strided.default)


def _hoist_draws(g: fx.Graph, labels: dict) -> None:
    """Interleaved plans reorder the forwards of a rank's stages, which share one
    generator: the step's random draws (dropout masks) are taken out of their tasks and
    run first, in the traced order, so each mask is the one the traced (and one-process)
    order draws. A draw fills a fresh tensor (``empty``/``empty_like`` of another fresh
    tensor), so it moves with that chain. Cost: the step's masks all live from its start
    (bytes of every micro-batch's masks), not one task's.

    Raises:
        GraphError: a draw that depends on a computed value (it cannot move ahead), or
            generator-state ops (activation checkpointing with dropout) in the plan.
    """
    from .trace import GraphError

    def chain(n, out):
        for a in n.all_input_nodes:
            if a.op != "call_function" or a.target not in _FRESH:
                return False
            if not chain(a, out):
                return False
            out.append(a)
        return True

    for n in list(labels):
        if n.target in RNG_OPS and labels[n][0] == "F":
            raise GraphError(
                "the interleaved schedule with activation checkpointing of a module that "
                "draws random numbers (dropout) is not supported: use set_pipeline_schedule"
                "('1f1b') or 'gpipe', or no checkpointing there")
        if labels[n][0] != "F" or not _draws(n):
            continue
        moved: list = []
        if not chain(n, moved):
            raise GraphError(
                f"the interleaved schedule reorders the forwards of a rank's stages, and so "
                f"the random draws ({n.target}) they take from one generator; this draw "
                f"depends on a computed value and cannot be taken ahead: use "
                f"set_pipeline_schedule('1f1b') or 'gpipe' here")
        for m in [*moved, n]:
            labels.pop(m, None)  # into the head of the program, in the traced order


def _draws(n: fx.Node) -> bool:
    """Whether ``n`` draws from the generator: a seeded random op, unless its dropout
    probability is 0 (attention without dropout) or it is dropout in eval mode."""
    if n.op != "call_function" or \
            torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True
    for i, arg in enumerate(schema.arguments):
        if arg.name in ("dropout_p", "train"):
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name, arg.default_value)
            if value in (0, 0.0, False):
                return False
    return True


def _task_labels(g: fx.Graph, tasks: list) -> dict:
    """node -> its task ``(kind, micro-batch, stage)`` (see :func:`pipeline`); nodes
    before the first label (none in a traced step) are left out and run first."""
    from .trace import GraphError

    pos = {t: i for i, t in enumerate(tasks)}
    mine = sorted({t[2] for t in tasks if t[0] != "U"})
    first = mine[0]
    base = _base_labels(g)  # node -> (kind, micro-batch)
    labels: dict = {}
    # forward: the staged module that ran the node (another rank's stage: the stage
    # before it on this rank, whose task runs the stand-in ops of the empty shards)
    prev_key, chunk = None, first
    for n, (kind, k) in base.items():
        if kind == "U":
            labels[n] = ("U", 0, None)
        elif kind == "F":
            if (kind, k) != prev_key:
                prev_key, chunk = (kind, k), first
            st = n.meta.get("custom", {}).get("stage")
            if st in mine:
                chunk = st
            labels[n] = ("F", k, chunk)
    # backward: from the data
    back = [n for n, (kind, _) in base.items() if kind == "B"]
    for n in back:
        k = base[n][1]
        cands = []
        for a in n.all_input_nodes:
            la = labels.get(a)
            if la is None or la[0] == "U":
                continue
            cand = ("B", k, la[2]) if la[0] == "F" else la
            if cand in pos:
                cands.append(cand)
        if cands:
            labels[n] = max(cands, key=pos.__getitem__)
    for n in reversed(back):
        if n not in labels:
            users = [labels[u] for u in n.users if labels.get(u, ("U",))[0] == "B"]
            if users:
                labels[n] = min(users, key=pos.__getitem__)
    last: dict = {}
    for n in back:
        k = base[n][1]
        if n not in labels:
            labels[n] = last.get(k, ("B", k, mine[-1]))
        last[k] = labels[n]
    missing = {lab for lab in labels.values() if lab not in pos}
    if missing:
        raise GraphError(f"pipeline: tasks {sorted(missing, key=str)} are not in this rank's "
                         f"plan {tasks} (a bug)")
    return labels




def _rank() -> int:
    from ..distributed import get_rank

    return get_rank()


def _is_p2p(node) -> bool:
    return isinstance(node, fx.Node) and node.target is operator.getitem and \
        isinstance(node.args[0], fx.Node) and node.args[0].target is _P2P


def _p2p_wait(t: torch.Tensor, what: str = "a transfer") -> torch.Tensor:
    """``wait_tensor`` of a pipeline transfer; a failure is a ``CollectiveError`` that
    names the transfer."""
    from ..distributed import CollectiveError

    try:
        return _P2P_WAIT(t)
    except Exception as e:  # noqa: BLE001 - re-raised with what failed
        raise CollectiveError(f"pipeline: {what} did not complete: {type(e).__name__}: {e}. "
                              f"The peer may have exited, hung or diverged; SBPFLOW_TIMEOUT "
                              f"bounds the wait") from e


def _is_send(node) -> bool:
    """``node`` is ``getitem(p2p_start(...), i)`` of an ``isend``."""
    return _is_p2p(node) and node.args[0].args[0][node.args[1]] == "isend"


def _outside_compile(op):
    """``op`` called from Python where ``torch.compile`` does not look (a graph break):
    ops its tracer cannot handle run as they are, between compiled pieces."""
    import torch._dynamo

    def call(*args, **kwargs):
        return op(*args, **kwargs)

    call.__name__ = f"eager_{getattr(op, '__name__', 'op')}".replace(".", "_")
    return torch._dynamo.disable(call)


def compile_program(gm: fx.GraphModule, post_grad=None):
    """``torch.compile`` of the program (inductor: fused kernels on CPU; CUDA graphs on
    GPU). The optimizers' updates (``sbpflow::optimizer_step``, and torch's fused
    kernels with tensor learning rates, which have no meta kernel or functional form that
    compiling accepts) and the generator ops run outside the compiled pieces, as graph
    breaks; they come last in a step (the update) or are cheap (the generator state).

    ``post_grad``: inductor's ``post_grad_custom_post_pass`` for each compiled piece's
    graph, as inductor has rewritten it (after its post-grad passes, before it schedules
    kernels): the graph gives :func:`sbpflow.graph.verify.post_grad_check`, which chains
    the collectives in program order (inductor's scheduler would otherwise order them by
    heuristics that differ between ranks whose graphs differ) and checks the verifier's
    in-flight rules there."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True  # torch's random streams, as the replay's
    inductor_config.post_grad_custom_post_pass = post_grad
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", "")
        if node.target in RNG_OPS or node.target in OPTIM_OPS or \
                node.target in (_P2P, _P2P_WAIT, _p2p_wait) or (
                getattr(node.target, "namespace", None) == "aten" and name.startswith("_fused_")):
            node.target = _outside_compile(node.target)
    gm.recompile()
    return torch.compile(gm, dynamic=False)


def count_ops(gm: fx.GraphModule) -> int:
    """Call nodes in the program (what a replay executes, one Python call each)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and
               n.target is not operator.getitem)
