"""Predict a pipeline-parallel training step from one micro-batch's logical graph.

A pipeline's own graph is not lowered (``nn.Graph.lower`` refuses pipelines: its program
is per stage and per micro-batch). Its cost is built instead from the logical graph of one
micro-batch of the same model run without stages, laid out as each stage runs it (data
parallel over the stage's ranks, the micro-batch's samples on each): every forward op
is given to the stage that runs it (:func:`stage_of_ops`, by the module whose forward ran
it: ``OpNode.module``) and priced as :func:`sbpflow.planner.predict.predict_step` prices
it (measured on a calibrated profile, else the roofline; forward and backward together).

Terms (seconds; ``p`` pipeline ranks, ``v`` model chunks a rank (``n = v p`` stages,
stage ``s`` on rank ``s % p``), ``m`` micro-batches, ``d`` data-parallel ranks per
stage):

* each stage's times per micro-batch, over this machine's
  :func:`~sbpflow.planner.predict.cpu_share` as ``predict_step``'s: forward ``F_s`` (its
  ops' forward alone, :func:`forward_seconds`), input-gradient backward ``B_s`` and
  weight-gradient backward ``W_s`` (the rest of each op's backward divided by
  :func:`weight_share`: a matmul's half, an embedding's all, a norm's none); a send
  occupies its sender: the activation crossing to stage ``s+1`` is added to ``F_s``, the
  gradient back to ``s-1`` to ``B_s`` (the boundary values' bytes on this rank, each a
  ``send_recv`` on the profile's link); a stage whose calls take longer than its device
  work (:func:`~sbpflow.planner.predict.host_seconds`) is stretched to them;
* the pipeline's time: the makespan of the schedule's own action lists
  (:func:`sbpflow.runtime.schedules.build`: 1F1B, GPipe, interleaved 1F1B, ZB-H1 zero
  bubble, as the runtime runs them) timed by :func:`sbpflow.runtime.schedules.simulate`
  with those per-stage times (a ``B`` without its own ``W`` is the full backward).
  With equal stages this is Narayanan et al.'s ``(m + p - 1) t`` for 1F1B and GPipe
  (SC'21, section 2.2), ``(p - 1) / (v m)`` of bubble interleaved, and Qi et al.'s
  ``(p - 1)(F + B - W)`` idle time for ZB-H1 (ICLR'24); with unequal stages, whatever
  the dependencies give (GPipe waits longer when forward and backward are unbalanced);
* after it, the slowest rank's data-parallel all-reduce of its gradients (25 MiB
  buckets over ``d`` ranks; none when ``d`` = 1) and update (its own parameters), and a
  weight used on two pipeline ranks (GPT's tied embedding and head) sent to the other
  and its gradient back once per step.

Reported as ``compute`` (``m`` times the busiest rank's ops per micro-batch),
``communication`` (its sends, ``m`` times, plus the all-reduce and the tied weight),
``host`` (its calls beyond its device work), ``update`` and ``bubble`` (the rest of
the pipeline's makespan), summing to ``total``.

Memory per pipeline rank (the largest is reported): its parameters (a weight used on two
ranks on both), their gradients (held through the step: micro-batches accumulate), the
optimizer state of the parameters it owns, the activations its stages' ops saved
(``LogicalGraph.saved_at``) held from each ``F`` to its ``B`` (what a weight gradient
reads, :func:`weight_share`'s matmul inputs, to its ``W``), the peak of that walked
through the rank's actions, twice its largest forward output (backward's workspace),
the transfers' buffers (a received activation and its copy per micro-batch in flight on
the stage, a received gradient, one task's sends) and, with ``d`` > 1, its gradients'
all-reduce (input and output). On gpt-mini (2 stages, 2-8 micro-batches, 1F1B) it is
0.96-1.07x the measured peak, either side: backward's transient buffers are not swept op
by op as :func:`~sbpflow.planner.predict.predict_memory` sweeps a graph's, so it is not a
bound.

Left out: tensor parallelism inside a stage, activation checkpointing, the program's
Python between tasks (more tasks interleaved: measured 1.3x 1F1B's step on this CPU where
predicted alike), the cost of splitting the backward in two (zero-bubble's ``B`` and
``W`` passes), overlap of transfers with compute (none assumed).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..graph.ir import shard_bytes
from .cost import collective_time, sent_time
from .hardware import Hardware
from .plan_file import save_plan
from .predict import (
    TIMER,
    _op_seconds,
    _update_seconds,
    cold_share,
    cpu_share,
    host_seconds,
    op_seconds,
    predict_memory,
    timed_op,
)

__all__ = ["BUCKET_BYTES", "PipelinePlan", "forward_seconds", "micro_batch_choices",
           "predict_pipeline", "stage_of_ops", "weight_share"]

#: Data-parallel gradient bucket (sbpflow's default, torch DDP's ``bucket_cap_mb``).
BUCKET_BYTES = 25 * 2 ** 20


def stage_of_ops(lg, stages: list[list[str]], prefix: str = "") -> dict[int, int]:
    """``{node index: stage}`` for every forward op of ``lg``: the stage whose modules
    (``stages[s]``: qualified names in the model, e.g. ``transformer.h.0``; ``prefix``:
    the model's own name in the graph, e.g. ``model.``) hold the module that ran it; an
    op outside every stage's modules (GPT's sum of the embeddings, the loss) runs where
    its inputs are, on the stage of the op before it (stage 0 before any).

    Raises:
        ValueError: a module listed by two stages, or a stage none of whose modules ran an
            op (names not in the model, or a wrong ``prefix``), naming them.
    """
    owner: dict[str, int] = {}
    for s, names in enumerate(stages):
        for name in names:
            if owner.setdefault(prefix + name, s) != s:
                raise ValueError(f"pipeline stages {owner[prefix + name]} and {s} both list "
                                 f"module {name!r}; give each module to one stage")
    out, ran, current = {}, set(), 0
    for node in lg.ops("forward"):
        path = node.module
        while path and path not in owner:
            path = path.rpartition(".")[0]
        if path:
            current = owner[path]
            ran.add(current)
        out[node.index] = current
    idle = [s for s in range(len(stages)) if s not in ran]
    if idle:
        raise ValueError(f"pipeline stages {idle}: no op of the logical graph ran in their "
                         f"modules {[stages[s] for s in idle]} (the graph's modules: "
                         f"{sorted({n.module for n in lg.ops('forward')})[:6]}, ...); give "
                         f"the modules' names as the model names them, prefix {prefix!r}")
    return out


def forward_seconds(lg, node, hw: Hardware, dtype: str = "float32",
                    cold: float = 0.0) -> float:
    """Seconds of forward op ``node`` alone, without its backward (measured on a
    calibrated profile where it can be replayed alone, its weights ``cold``:
    :func:`sbpflow.planner.predict.cold_share`; else the roofline's forward)."""
    sec = timed_op(lg, node, forward_only=True, cold=cold) \
        if hw.op_timing == "measured" else None
    return sec if sec is not None else _op_seconds(lg, node, hw, dtype)


def weight_share(lg, node) -> float:
    """The share of forward op ``node``'s backward that is its parameters' gradient
    (zero-bubble's ``W``, which may run later than the input gradient ``B``): 0 without
    a parameter input; 1 when its other inputs take no gradient (an embedding's ids);
    1/2 for an op with a FLOP count (a matmul, a convolution: the weight's gradient and
    the input's cost the same FLOPs); else 0 (a norm's or a bias's weight gradient is a
    reduction beside the input's). An approximation of how the backward divides."""
    vals = [lg.values.get(v) for v in node.inputs]
    params = [v for v in vals if v is not None and v.kind == "param"]
    if not params:
        return 0.0
    others = [v for v in vals if v is not None and v.kind != "param"]
    if not any(v.dtype.is_floating_point for v in others):
        return 1.0
    return 0.5 if node.flops[node.chosen] is not None else 0.0


def _weight_inputs(lg, node) -> int:
    """Bytes of the activations a matmul-like op's weight gradient reads (what a delayed
    ``W`` keeps after its ``B``): its floating non-parameter inputs."""
    vals = [lg.values.get(v) for v in node.inputs]
    return sum(shard_bytes(v.placement, v.shape, v.sbp, v.dtype) for v in vals
               if v is not None and v.kind != "param" and v.dtype.is_floating_point)


def predict_pipeline(lg, stages: list[list[str]], micro_batches: int, dp: int,
                     hw: Hardware, *, optimizer=None, dtype: str = "float32",
                     state_per_param: float = 2.0, schedule: str = "1f1b",
                     virtual_stages: int = 1, prefix: str = "") -> dict:
    """One step of the pipeline that runs ``lg``'s model in ``stages`` (see the module
    doc). ``lg``: the logical graph of one micro-batch, laid out as a stage runs it
    (data parallel, each rank its share of the micro-batch); ``stages``: each stage's
    modules, ``p x virtual_stages`` of them (stage ``s`` on pipeline rank ``s % p``);
    ``micro_batches``: ``m``; ``dp``: ranks per stage (data parallel); ``optimizer``: the
    graph's (the update term; None: none); ``state_per_param``: optimizer state in
    float32 values per parameter element (2: Adam/AdamW); ``schedule``: a key of
    :data:`sbpflow.runtime.schedules.SCHEDULES` (``"1f1b"``, ``"gpipe"``,
    ``"interleaved"`` with ``virtual_stages`` > 1, ``"zero_bubble"``): the action lists
    the runtime runs, timed by :func:`sbpflow.runtime.schedules.simulate` with each
    stage's own forward, backward and weight-gradient times.

    Returns ``{"compute", "update", "communication", "bubble", "host", "total"}``
    (seconds; ``compute``, ``communication`` and ``host``: the busiest pipeline rank's,
    ``bubble``: the rest of the pipeline's time; ``host``: its calls beyond its device
    work, each stage taking the longer of the two per micro-batch, its calls the logical
    graph's shared by its ops: :func:`sbpflow.planner.predict.host_seconds`),
    ``"memory"`` (bytes of the fullest pipeline rank) and ``"stages"``: per stage
    ``{"ops_s", "send_s", "update_s", "allreduce_s", "memory", "activations",
    "in_flight"}`` (seconds per micro-batch or step, bytes, micro-batches; ``memory``,
    ``update_s`` and ``allreduce_s``: its pipeline rank's).

    Raises:
        ValueError: an unknown ``schedule`` or one the counts cannot run (names the
            fix), fewer than 1 micro-batch or rank, stages not ``p x virtual_stages``
            for some ``p`` >= 1, a stage that ran no op (:func:`stage_of_ops`).
    """
    from ..runtime import schedules as sched

    if micro_batches < 1 or dp < 1 or virtual_stages < 1:
        raise ValueError(f"predict_pipeline: micro_batches={micro_batches}, dp={dp}, "
                         f"virtual_stages={virtual_stages}: give integers >= 1")
    n, m, v = len(stages), micro_batches, virtual_stages
    if n % v:
        raise ValueError(f"predict_pipeline: {n} stages are not {v} virtual stages on each "
                         f"of some pipeline ranks; give a multiple of {v} stages")
    p = n // v
    acts = sched.build(schedule, p, m, v)  # ValueError: the schedule, the counts
    where = stage_of_ops(lg, stages, prefix)
    nodes = {node.index: node for node in lg.ops("forward")}
    rank_of = [s % p for s in range(n)]
    # the weights' cold share (predict's module doc), a pipeline rank's working set taken
    # as a p-th of the whole model's (its stages' weights and state; the micro-batches in
    # flight, up to p of them, each with a p-th of the activations)
    cold = cold_share(lg, hw, predict_memory(lg, state_per_param)["total"] // p)

    def nbytes(x):
        return shard_bytes(x.placement, x.shape, x.sbp, x.dtype)

    fwd, bwd, wgt = [0.0] * n, [0.0] * n, [0.0] * n
    keep = [0] * n  # activations a delayed W still reads after its B
    largest = [0] * n  # each stage's largest forward output (backward's workspace)
    made_by: dict[int, int] = {}  # value -> the stage that made it
    used_by: dict[int, set] = {}  # value -> the stages that read it
    for i, node in nodes.items():
        s = where[i]
        both, f = op_seconds(lg, node, hw, dtype, cold), \
            forward_seconds(lg, node, hw, dtype, cold)
        f = min(f, both)
        share = weight_share(lg, node)
        w = (both - f) * share
        fwd[s] += f
        wgt[s] += w
        bwd[s] += both - f - w
        if share == 0.5:  # a matmul's weight gradient reads the op's input
            keep[s] += _weight_inputs(lg, node)
        for o in node.outputs:
            made_by[o] = s
            x = lg.values.get(o)
            if x is not None and not x.view:
                largest[s] = max(largest[s], nbytes(x))
        for x in node.inputs:
            used_by.setdefault(x, set()).add(s)
    # the values crossing each boundary b (stage b to b+1) per micro-batch
    link = hw.link(False, "send_recv")
    crossing = [0] * max(n - 1, 0)
    for x, users in used_by.items():
        if x in made_by:
            for b in range(made_by[x], max(users)):
                crossing[b] += nbytes(lg.values[x])
    hop = [sent_time("send_recv", b, 2, link) if b and p > 1 else 0.0 for b in crossing]
    # a send occupies its sender: the activation after F (to s + 1), the gradient after
    # the input-gradient backward (to s - 1)
    send_f = [hop[s] if s < n - 1 else 0.0 for s in range(n)]
    send_b = [hop[s - 1] if s > 0 else 0.0 for s in range(n)]
    # parameters: owned by the first stage that reads one, copied to the others
    params = {vid: x for vid, x in lg.values.items() if x.kind == "param"}
    owned: list[list] = [[] for _ in range(p)]  # per pipeline rank
    held = [0] * p
    tied = 0.0
    for vid, x in params.items():
        users = sorted(used_by.get(vid, {0}))
        owned[rank_of[users[0]]].append(x)
        for r in sorted({rank_of[s] for s in users}):
            held[r] += nbytes(x)
        ranks = {rank_of[s] for s in users}
        if len(ranks) > 1:  # sent to each other rank and its gradient back, once a step
            tied += 2 * (len(ranks) - 1) * sent_time("send_recv", nbytes(x), 2, link)
    timer = TIMER if hw.op_timing == "measured" else None
    update = [_update_seconds(lg, hw, optimizer, timer, owned[r], cold) for r in range(p)]
    allreduce = [0.0] * p
    if dp > 1:
        ar = hw.link(dp > hw.devices_per_node, "all_reduce")
        for r in range(p):
            total = sum(nbytes(x) for x in owned[r])
            full, rest = divmod(total, BUCKET_BYTES)
            allreduce[r] = full * collective_time("all_reduce", BUCKET_BYTES, dp, ar) + \
                (collective_time("all_reduce", rest, dp, ar) if rest else 0.0)
    share = cpu_share(lg, hw)
    fwd, bwd, wgt = ([x / share for x in xs] for xs in (fwd, bwd, wgt))
    update = [x / share for x in update]
    ops = [fwd[s] + bwd[s] + wgt[s] for s in range(n)]
    send = [send_f[s] + send_b[s] for s in range(n)]
    # the host's calls per micro-batch on each stage (the logical graph's, shared out by
    # the stage's ops), overlapping its device work: a stage takes the longer of the two
    calls = host_seconds(lg, hw)
    count = [sum(1 for i in nodes if where[i] == s) for s in range(n)]
    host = [calls * count[s] / max(len(nodes), 1) for s in range(n)]
    device = [ops[s] + send[s] for s in range(n)]
    slow = [max(1.0, host[s] / device[s]) if device[s] > 0 else 1.0 for s in range(n)]
    timeline = sched.simulate(
        acts, [(fwd[s] + send_f[s]) * slow[s] for s in range(n)],
        [(bwd[s] + send_b[s]) * slow[s] for s in range(n)],
        [wgt[s] * slow[s] for s in range(n)], 0.0)
    t = [max(device[s], host[s]) for s in range(n)]
    per_rank = [sum(t[s] for s in range(n) if rank_of[s] == r) for r in range(p)]
    neck = max(range(p), key=lambda r: per_rank[r])
    on_neck = [s for s in range(n) if rank_of[s] == neck]
    pipe = timeline.makespan
    after = max(range(p), key=lambda r: update[r] + allreduce[r])
    out = {"compute": m * sum(ops[s] for s in on_neck),
           "update": update[after],
           "communication": m * sum(send[s] for s in on_neck) + allreduce[after] + tied,
           "bubble": max(0.0, pipe - m * per_rank[neck]),  # (no -0.0 from rounding)
           "host": m * sum(t[s] - device[s] for s in on_neck) + hw.step_seconds}
    out["total"] = pipe + update[after] + allreduce[after] + tied + hw.step_seconds
    # memory per pipeline rank: what each stage's forward saved, held from its F to its
    # B (to its W for what a weight gradient reads), walked through the rank's actions
    saved = [0] * n
    order = sorted(nodes)
    for at, b in lg.saved_at:  # saved by the first op at or after its position
        j = bisect.bisect_left(order, at)
        saved[where[order[j]] if j < len(order) else n - 1] += b
    keep = [min(k, x) for k, x in zip(keep, saved)]  # a part of what the stage saved
    has_w = {(a.stage, a.micro_batch) for row in acts for a in row if a.kind == "W"}
    live, inflight = [0] * p, [0] * n
    for r, row in enumerate(acts):
        now, peak, count_s = 0, 0, [0] * n
        for a in row:
            if a.kind == "F":
                now += saved[a.stage]
                count_s[a.stage] += 1
                inflight[a.stage] = max(inflight[a.stage], count_s[a.stage])
            elif a.kind == "B":
                now -= saved[a.stage] - (keep[a.stage] if (a.stage, a.micro_batch) in has_w
                                         else 0)
                count_s[a.stage] -= 1
            elif a.kind == "W":
                now -= keep[a.stage]
            peak = max(peak, now)
        live[r] = peak
    stages_out, rank_mem = [], [0] * p
    for r in range(p):
        mine = [s for s in range(n) if rank_of[s] == r]
        state = sum(int(state_per_param * nbytes(x) / x.dtype.itemsize * 4) for x in owned[r])
        # transfers: a received activation (its buffer and the copy out) per micro-batch
        # in flight, a received gradient and the sends in flight (one task's)
        buffers = 0
        for s in mine:
            into = crossing[s - 1] if s > 0 else 0
            out_of = crossing[s] if s < n - 1 else 0
            buffers += 2 * into * inflight[s] + 2 * out_of + into + out_of
        rank_mem[r] = 2 * held[r] + state + live[r] + 2 * max(largest[s] for s in mine) + \
            buffers + (2 * sum(nbytes(x) for x in owned[r]) if dp > 1 else 0)
    for s in range(n):
        r = rank_of[s]
        stages_out.append({"ops_s": ops[s], "send_s": send[s], "update_s": update[r],
                           "allreduce_s": allreduce[r], "memory": rank_mem[r],
                           "activations": saved[s], "in_flight": inflight[s]})
    out["memory"] = max(rank_mem)
    out["stages"] = stages_out
    return out


@dataclass
class PipelinePlan:
    """A priced pipeline plan (``sbpflow plan``'s pp rows): ``stages`` x ``dp`` ranks
    (each stage data parallel over ``dp``), ``micro_batches``, ``schedule`` and
    ``virtual_stages`` (model chunks per rank, interleaved); ``split``: each model
    chunk's modules (``stages x virtual_stages`` of them); ``prediction``:
    :func:`predict_pipeline`'s result; ``hardware``: the profile's name. :meth:`save`
    writes the plan file ``sbpflow train --plan FILE`` runs
    (:data:`sbpflow.planner.plan_file.PLAN_KEYS`)."""

    stages: int
    dp: int
    micro_batches: int
    schedule: str
    split: list
    prediction: dict
    hardware: str
    global_batch: int = 0  # the samples a step it was priced for (0: not said)
    source: str = "pipeline"
    virtual_stages: int = 1  # model chunks per rank (the interleaved schedule's)

    def to_dict(self) -> dict:
        p = self.prediction
        v = {"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}
        return {"pipeline": {"stages": self.stages, "micro_batches": self.micro_batches,
                             "schedule": self.schedule, **v},
                "mesh": [self.dp], "hardware": self.hardware,
                **({"global_batch": self.global_batch} if self.global_batch else {}),
                "predicted_step_s": p["total"], "predicted_memory_bytes": p["memory"],
                "note": "a pipeline plan: stages x mesh ranks, each stage data parallel over "
                        "its mesh with the model's split; pipeline and mesh are read, "
                        "global_batch (what it was priced for) is said when a run differs"}

    def save(self, path: str, overwrite: bool = False) -> str:
        """Write :meth:`to_dict` as JSON to ``path``. Returns ``path``.

        Raises:
            FileExistsError: ``path`` exists and not ``overwrite``.
        """
        return save_plan(path, self.to_dict(), overwrite)

    def __str__(self) -> str:
        from ..graph.show import _fmt_bytes

        p = self.prediction
        chunks = f" ({self.virtual_stages} model chunks a rank)" \
            if self.virtual_stages > 1 else ""
        lines = [f"pipeline plan: {self.stages} stages x {self.dp} data-parallel rank(s), "
                 f"{self.micro_batches} micro-batches, {self.schedule}{chunks} (profile "
                 f"{self.hardware})",
                 f"  predicted step {p['total'] * 1e3:.2f} ms (compute {p['compute'] * 1e3:.2f} "
                 f"ms, bubble {p['bubble'] * 1e3:.2f} ms, communication "
                 f"{p['communication'] * 1e3:.2f} ms, update {p['update'] * 1e3:.2f} ms"
                 + (f", host {p['host'] * 1e3:.2f} ms" if p.get("host", 0) > 0 else "")
                 + "), "
                 f"memory {_fmt_bytes(p['memory'])} per rank (the fullest stage)",
                 "  | stage | modules | ops ms per micro-batch | transfers ms | micro-batches "
                 "in flight | memory |", "  |---|---|---|---|---|---|"]
        for s, (names, st) in enumerate(zip(self.split, p["stages"])):
            mods = ", ".join(names) if len(names) <= 3 else \
                f"{names[0]} ... {names[-1]} ({len(names)})"
            lines.append(f"  | {s} | {mods} | {st['ops_s'] * 1e3:.2f} | "
                         f"{st['send_s'] * 1e3:.2f} | {st['in_flight']} | "
                         f"{_fmt_bytes(st['memory'])} |")
        return "\n".join(lines)


def micro_batch_choices(samples: int, stages: int) -> list[int]:
    """Micro-batch counts worth pricing for a pipeline of ``stages`` over ``samples``
    samples per data-parallel replica and step: ``stages``, ``2 x`` and ``4 x`` that
    (a 1F1B bubble of ``(p-1)/m``), each dividing ``samples``."""
    return [m for m in (stages, 2 * stages, 4 * stages) if samples % m == 0 and m <= samples]

