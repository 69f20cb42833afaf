"""``print(graph)``: the logical graph of each compiled signature and its costs.

For each signature: the settings; per-rank bytes of parameters, gradients and optimizer
state (what this rank stores); the peak of live intermediate tensors estimated from the
per-rank program (every value freed after its last use, as the replay frees it; views
and in-place results cost nothing); the program's size; then the logical ops in trace
order, each with its inputs' nd-SBPs, the chosen signature (inputs -> output) and the
boxing it needed, each collective with its bytes, and ``[all-B fallback]`` where an op
had no rule for its inputs' layout and gathered them whole.
"""

from __future__ import annotations

import torch

from ..distributed import CommRecord
from ..sbp import format_nd_sbp

__all__ = ["describe", "memory"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def memory(graph, program) -> dict[str, int]:
    """Per-rank bytes: ``params`` (parameter shards), ``grads`` (one gradient per
    optimizer target, as the update consumes them), ``optimizer`` (state and fp32 master
    shards), ``peak_activations`` (the program's estimated peak of live intermediates)."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0}
    for s in program.slots:
        t = s.get()
        if s.kind == "param":
            out["params"] += _nbytes(t)
        elif s.kind == "buffer":
            out["buffers"] += _nbytes(t)
        elif s.kind in ("opt_state", "master"):
            out["optimizer"] += _nbytes(t)
    for opt, _ in graph._optimizers:
        for g in opt.param_groups:
            for t in g["params"]:
                out["grads"] += _nbytes(t)
    out["peak_activations"] = peak_live_bytes(program.gm)
    return out


def _aliases(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def peak_live_bytes(gm: torch.fx.GraphModule) -> int:
    """The largest sum of live intermediate values along the program (placeholders not
    counted: they are the parameters, state and inputs; views and in-place results
    alias their input and count nothing)."""
    nodes = list(gm.graph.nodes)
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    live, peak = 0, 0
    sizes = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and not _aliases(n):
            val = n.meta.get("val")
            vals = val if isinstance(val, (list, tuple)) else [val]
            sizes[n] = sum(_nbytes(v) for v in vals)
            live += sizes[n]
        peak = max(peak, live)
        for a in n.all_input_nodes:
            if last.get(a) == i and a in sizes:
                live -= sizes.pop(a)
        if n in sizes and n not in last:  # never used
            live -= sizes.pop(n)
    return peak


def _op_lines(events) -> list[str]:
    lines = []
    for ev in events:
        if isinstance(ev, str):  # a section heading
            lines.append(f"  -- {ev} --")
            continue
        if isinstance(ev, CommRecord):
            if ev.kind == "check":
                continue
            axis = f" axis {ev.axis}" if ev.axis is not None else ""
            lines.append(f"      {ev.kind}{axis} ranks {list(ev.ranks)}: "
                         f"{_fmt_bytes(ev.bytes)}")
            continue
        if ev.inputs is None:
            lines.append(f"  {ev.op}{'_' if ev.inplace else ''} (local)")
            continue
        ins = ", ".join(format_nd_sbp(s) for s in ev.inputs)
        if ev.signature is None:
            lines.append(f"  {ev.op}_ ({ins}) in place")
            continue
        sig_in, sig_out = ev.signature
        chosen = ", ".join(format_nd_sbp(s) for s in sig_in)
        boxed = "" if tuple(sig_in) == tuple(ev.inputs) else f" boxed to ({chosen})"
        fallback = ""
        if any(all(s[a].is_broadcast() for s in sig_in) and sig_out[a].is_broadcast() and
               any(not s[a].is_broadcast() for s in ev.inputs)
               for a in range(len(sig_out))):
            fallback = "  [all-B fallback]"
        lines.append(f"  {ev.op}{'_' if ev.inplace else ''} ({ins}){boxed} -> "
                     f"{format_nd_sbp(sig_out)}{fallback}")
    return lines


def _zero_lines(graph) -> list[str]:
    """How many parameters ZeRO sharded (the others are under ``shard_min_size``)."""
    cfg = graph.config
    if not cfg.zero_stage or graph._zero is None:
        return []
    params = {id(p): p for m in graph._modules().values() for p in m.parameters()}.values()
    n = sum(1 for p in params if id(p) in graph._zero3 or id(p) in graph._zero12)
    return [f"  ZeRO-{cfg.zero_stage}: {n} of {len(params)} parameters sharded (the others "
            f"have fewer than shard_min_size={cfg.zero_min_size} elements or no broadcast "
            f"axis)"]


def _pipeline_lines(graph) -> list[str]:
    """The pipeline's schedule as this rank runs it: stages, micro-batches, the bubble of
    the plan simulated with equal task times (:func:`sbpflow.runtime.schedules.simulate`:
    ``(p - 1) / m`` for 1F1B and GPipe, ``(p - 1) / (v m)`` interleaved, a third of
    1F1B's for zero-bubble with ``m >= p``), this rank's task order (``F3@1``: forward of
    micro-batch 3 on stage 1; ``B``/``W``: the input and weight gradients under
    zero-bubble, else ``B`` is the whole backward) and its actions with the transfers."""
    actions = graph.__dict__.get("_actions")
    if not actions:
        return []
    from ..distributed import get_rank

    cfg = graph.config
    n_stages = len({sid for _m, _pl, sid in graph._stages})
    v = cfg.virtual_stages if cfg.pipeline_schedule == "interleaved" else 1
    p = n_stages // v
    order = " ".join("U" if a.kind == "UPDATE" else f"{a.kind}{a.micro_batch}@{a.stage}"
                     for a in actions if "_" not in a.kind)
    return [f"  pipeline: {n_stages} stages on {p} rank groups, schedule "
            f"{cfg.pipeline_schedule}" + (f" ({v} virtual stages per rank)" if v > 1 else "")
            + f", {cfg.grad_acc_steps} micro-batches; bubble (theory) "
            f"{graph._timeline.bubble:.3f} of compute; rank {get_rank()} runs stage(s) "
            f"{graph._stage_of[get_rank()]}",
            f"  task order on this rank (F/B: forward/backward of a micro-batch @ stage, "
            f"W: its weight gradient, U: the update): {order}",
            f"  actions on this rank (r: pipeline ranks): "
            f"{' '.join('U' if a.kind == 'UPDATE' else str(a) for a in actions)}"]


def describe(graph, program) -> str:
    """The text ``print(graph)`` shows for one compiled signature."""
    from .passes import count_ops

    mem = memory(graph, program)
    comms = [e for e in program.events if isinstance(e, CommRecord) and e.kind != "check"]
    from .passes import _is_collective, _is_wait

    n_coll = sum(1 for n in program.gm.graph.nodes if n.op == "call_function" and
                 _is_collective(n.target) and not _is_wait(n.target))
    head = [
        f"{type(graph).__name__} ({'training' if graph.training else 'evaluation'} graph) "
        f"for inputs ({program.signature})",
        f"  {graph.config!r}",
        f"  per rank: parameters {_fmt_bytes(mem['params'])}, gradients "
        f"{_fmt_bytes(mem['grads'])}, optimizer state {_fmt_bytes(mem['optimizer'])}, "
        f"buffers {_fmt_bytes(mem['buffers'])}; peak live intermediates "
        f"{_fmt_bytes(mem['peak_activations'])} (estimated from the program)",
        f"  program: {count_ops(program.gm)} torch calls, {n_coll} collectives "
        f"({_fmt_bytes(sum(e.bytes for e in comms))} sent by this rank per call), traced "
        f"in {program.trace_s:.2f}s"
        + (f", torch.compile {program.compile_s:.1f}s" if program.compile_s is not None
           else ""),
    ]
    head += _zero_lines(graph)
    head += _pipeline_lines(graph)
    head.append("  logical graph (op (input nd-SBPs) [boxed to the signature's] -> output "
                "nd-SBP; collectives indented):")
    return "\n".join(head + _op_lines(program.events))
