"""``sbpflow bench MODEL --plan auto|FILE [--compare-plans]``: the layouts sbpflow
chooses (or a saved plan) measured against the hand layouts, each beside its prediction.

Runners (built and registered by :mod:`sbpflow.apps.bench`, ``_plan_runner``; nn.Graph
training steps of
the job's model, optimizer and synthetic data; every one on the same global batch of
``--batch-size`` x ranks samples, BatchNorm statistics per rank as in every ``sbpflow
bench`` runner):

* ``plan-auto``: the model laid out broadcast on all ranks in a row, the whole batch on
  every rank, ``config.enable_auto_parallel()`` (the search prices on this machine's
  calibration, :func:`sbpflow.planner.calibrate.profile_here`; its time is in the first
  step's, reported as ``compile_s``); ``plan-file``: the same running ``--plan FILE``;
* the hand plans, with ``--compare-plans``: ``plan-dp`` (parameters broadcast, batch
  ``S(0)``), ``plan-tp`` (the model's tensor-parallel plan over all ranks, batch ``B``),
  ``plan-dp_tp`` (both, on a 2 x N/2 mesh, 4 or more ranks), ``plan-zero1/2/3``
  (data parallel with ``enable_zero(stage)``), ``plan-pp`` (models with a pipeline
  split: a stage per rank, 1F1B, twice as many micro-batches as stages where they divide
  the batch).

Each runner's prediction: its graph lowered on its batch (the layouts it runs) priced by
:func:`sbpflow.planner.predict.predict_step` and :func:`~sbpflow.planner.predict.
predict_memory` on the same profile; the pipeline's by
:func:`sbpflow.planner.pipeline.predict_pipeline` (its graph is not lowered: one
micro-batch's logical graph, op by op on the stage that runs it). The report adds, per
plan, predicted and measured step time and their ratio, both rankings and Spearman's rank
correlation, the auto plan's throughput over the best hand plan's, and predicted against
measured peak memory
(:func:`peak_step_bytes`; with ``--memory-per-rank``, whether the auto plan's measured
peak is within the limit it was searched under).
"""

from __future__ import annotations

__all__ = ["HAND_PLANS", "compare", "peak_step_bytes", "report_lines", "runner_facts",
           "runner_names", "spearman", "supports"]

HAND_PLANS = ("dp", "tp", "dp_tp", "zero1", "zero2", "zero3", "pp")


def supports(plan: str, spec, dp: int, tp: int, world: int) -> str | None:
    """None when hand plan ``plan`` can run ``spec`` on ``world`` ranks, else why not."""
    if plan in ("tp", "dp_tp") and "tp" not in spec.plans:
        return f"{spec.name} has no tensor-parallel plan"
    if plan == "dp_tp" and (world < 4 or world % 2):
        return "a 2 x N/2 mesh needs an even number of ranks, 4 or more"
    if plan != "dp" and world == 1:
        return "one rank: data parallel is the only layout"
    if plan == "pp":
        try:
            spec.pipeline_stages(world)
        except ValueError as e:
            return str(e)
    return None


def runner_names(args, spec, world: int) -> list[str]:
    """The plan runners of a ``--plan`` run: the plan's, then (``--compare-plans``) the hand
    plans this model and world allow, then DDP (the headline baseline)."""
    names = ["plan-auto" if args.plan == "auto" else "plan-file"]
    if args.compare_plans:
        names += [f"plan-{p}" for p in HAND_PLANS if supports(p, spec, world, 1, world) is None]
    return names + ["torch-ddp"]


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of ``a`` and ``b`` (ties get their mean rank); None
    for fewer than 3 values or a constant ranking."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return None if va == 0 or vb == 0 else cov / (va * vb)


def _held_bytes(graph) -> int:
    """Bytes of this rank's shards of what a training graph keeps between steps: its
    modules' parameters (a tied one once), their gradients, buffers, and its optimizers'
    state."""
    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        local = getattr(t, "_local", t)
        if torch.is_tensor(local) and id(local) not in seen:
            seen.add(id(local))
            total += local.numel() * local.element_size()

    for mod in graph._modules().values():
        for p in mod.parameters():
            add(p)
            if p.grad is not None:
                add(p.grad)
        for b in mod.buffers():
            add(b)
    for opt, _ in graph._optimizers:
        for st in opt.state.values():
            for v in st.values():
                add(v)
    return total


def peak_step_bytes(built, device: str) -> int:
    """This rank's peak of live tensor bytes over one more (untimed) step of a graph
    runner. CUDA: the allocator's peak (``torch.cuda.max_memory_allocated``). CPU (no
    allocator statistics): what the graph keeps between steps (:func:`_held_bytes`) plus
    the most bytes of storages the step's ops created that were alive at once, checked
    after every op (:class:`sbpflow.apps.bench.live.LiveStorages`)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        built.step(built.batch)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    from .live import LiveStorages

    held = _held_bytes(built.graph)
    with LiveStorages() as live:
        built.step(built.batch)
    return held + live.peak


def runner_facts(job, name: str, b, side: dict) -> dict:
    """What :func:`compare` needs of plan runner ``name`` (built ``b``, timed ``side``),
    taken while it is alive: its prediction (``predicted``: the slowest rank's terms,
    seconds; ``memory``: bytes per rank) on this machine's profile, its measured peak
    (``peak``, the largest rank's), ``auto_plan`` (its graph's auto-parallel plan as
    text, or None) and ``layout`` (:func:`_layout_key`). Every rank calls it."""
    from sbpflow.distributed import _comm
    from sbpflow.planner.auto import (
        graph_optimizer,
        pricing_dtype,
        resolve_hardware,
        state_per_param,
    )
    from sbpflow.planner.predict import predict_memory, predict_step, slowest_rank

    hw = resolve_hardware(None, job.device)
    if b.predict is not None:
        p, mem = b.predict(hw)
    else:
        lg = b.graph.lower(*b.batch)
        p = predict_step(lg, hw, pricing_dtype(b.graph.config, hw),
                         b.graph.config.grad_acc_steps, graph_optimizer(b.graph))
        mem = predict_memory(lg, state_per_param(b.graph),
                             b.graph.config.grad_acc_steps)["total"]
    peak = max(r[0] for r in _comm.all_gather_meta([peak_step_bytes(b, job.device)],
                                                   list(range(job.world))))
    plan = getattr(b.graph, "auto_parallel_plan", None) if b.graph is not None else None
    return {"profile": hw.name, "predicted": slowest_rank(p, list(range(job.world))),
            "memory": mem, "peak": peak, "auto_plan": None if plan is None else str(plan),
            "layout": _layout_key(b)}


def _layout_key(b) -> tuple | None:
    """What a graph runner runs as: its mesh, ZeRO stage (1 as 2: sbpflow's stage 1
    shards the gradients too and compiles to stage 2's program), the modules it
    recomputes in backward (activation checkpointing), every parameter's layout and its
    inputs' (after the auto plan's boxing); None for a runner without a graph."""
    g = b.graph
    model = getattr(g, "model", None)
    if g is None or model is None:
        return None
    args, _ = g._planned_inputs(b.batch, {})
    stage = g.config.zero_stage
    return (tuple(next(model.parameters()).placement.shape), 2 if stage == 1 else stage,
            tuple(n for n, m in model.named_modules()
                  if getattr(m.__dict__.get("_graph_module"), "activation_checkpointing",
                             False)),
            tuple((n, repr(q.sbp)) for n, q in model.named_parameters()),
            tuple(repr(t.sbp) for t in args))


def compare(job, facts: dict, sides: dict) -> dict:
    """Every plan runner's prediction (``facts``: :func:`runner_facts` per plan runner),
    beside its measurement (``sides``: time_runners'): ``{"profile", "rows": [{plan,
    predicted_step_ms, measured_step_ms, ratio, predicted_memory_bytes, predicted_rank,
    measured_rank}], "spearman", "within_25_percent", "auto_vs_best_hand"}``; also sets
    ``predicted_step_ms``, ``predicted_memory_bytes`` and ``measured_peak_bytes`` in each
    plan runner's side."""
    rows = []
    for name, f in facts.items():
        p, mem, peak = f["predicted"], f["memory"], f["peak"]
        side = sides[name]
        side["predicted_step_ms"], side["predicted_memory_bytes"] = p["total"] * 1e3, mem
        side["measured_peak_bytes"] = peak
        rows.append({"plan": name[len("plan-"):], "predicted_step_ms": p["total"] * 1e3,
                     "measured_step_ms": side["step_ms_median"],
                     "ratio": p["total"] * 1e3 / side["step_ms_median"],
                     "predicted_memory_bytes": mem, "measured_peak_bytes": peak,
                     "samples_per_s": side["samples_per_s"]})
    for key, rank_key in (("predicted_step_ms", "predicted_rank"),
                          ("measured_step_ms", "measured_rank")):
        for i, r in enumerate(sorted(rows, key=lambda r: r[key])):
            r[rank_key] = i + 1
    chosen = rows[0]
    limit = getattr(job.args, "memory_per_rank", None)
    # the hand plans a user could have picked instead: under a memory limit, those whose
    # measured peak is within it
    hand = [r for r in rows if r["plan"] in HAND_PLANS
            and (limit is None or r["measured_peak_bytes"] <= limit)]
    best = max(hand, key=lambda r: r["samples_per_s"]) if hand else None
    mine = facts[f"plan-{chosen['plan']}"]
    programs = _per_program(rows, facts)
    return {
        # the hand plan that runs the chosen plan's very layout (mesh, ZeRO stage,
        # parameters, inputs), if any: their measured difference is not the plan's (the
        # runs' noise, or what else differs between the two runners' processes)
        "same_as": next((n[len("plan-"):] for n, f in facts.items()
                         if n != f"plan-{chosen['plan']}" and f["layout"] is not None
                         and f["layout"] == mine["layout"]), None),
        "profile": mine["profile"], "rows": rows,
        "spearman": spearman(*programs),
        "programs": len(programs[0]),
        "spearman_rows": spearman([r["predicted_step_ms"] for r in rows],
                                  [r["measured_step_ms"] for r in rows]),
        "within_25_percent": sum(abs(r["ratio"] - 1) <= 0.25 for r in rows),
        "auto_vs_best_hand": None if best is None else
        {"best_hand": best["plan"],
         "ratio": chosen["samples_per_s"] / best["samples_per_s"]},
        "auto_plan": mine["auto_plan"],
        "memory_limit": limit,
        "within_limit": None if limit is None else chosen["measured_peak_bytes"] <= limit,
    }


def _per_program(rows: list, facts: dict) -> tuple[list, list]:
    """The rows' predicted and measured step times, one pair per distinct program: rows
    whose runners run one layout (:func:`_layout_key`: the auto plan and the hand plan it
    equals, ZeRO-1 and ZeRO-2) counted once, at their mean (their predictions are one;
    their measured difference is the runs' noise, which would otherwise rank them)."""
    groups: dict = {}
    for r in rows:
        key = facts[f"plan-{r['plan']}"]["layout"]
        groups.setdefault(key if key is not None else ("row", r["plan"]), []).append(r)
    pred = [sum(r["predicted_step_ms"] for r in g) / len(g) for g in groups.values()]
    meas = [sum(r["measured_step_ms"] for r in g) / len(g) for g in groups.values()]
    return pred, meas


def report_lines(r: dict) -> list[str]:
    """The markdown of :func:`compare`'s result."""
    c = r["plans"]
    lines = ["", f"Plans, predicted (profile {c['profile']}) against measured:", "",
             "| plan | predicted ms | measured ms | predicted / measured | predicted rank | "
             "measured rank | predicted memory MiB | measured peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        lines.append(f"| {row['plan']} | {row['predicted_step_ms']:.1f} | "
                     f"{row['measured_step_ms']:.1f} | {row['ratio']:.2f} | "
                     f"{row['predicted_rank']} | {row['measured_rank']} | "
                     f"{row['predicted_memory_bytes'] / 2 ** 20:.1f} | "
                     f"{row['measured_peak_bytes'] / 2 ** 20:.1f} |")
    sp = c["spearman"]
    lines.append("")
    spr = c.get("spearman_rows")
    lines.append(f"Spearman (predicted vs measured ranking) over the {c.get('programs')} "
                 f"distinct programs (rows that run one program once, at their mean): "
                 f"{'n/a (fewer than 3)' if sp is None else f'{sp:.2f}'} (over every row: "
                 f"{'n/a' if spr is None else f'{spr:.2f}'}); "
                 f"within 25%: {c['within_25_percent']} of {len(c['rows'])}")
    a = c["auto_vs_best_hand"]
    within = " within the memory limit" if c.get("memory_limit") is not None else ""
    if a is None and within:
        lines.append("no hand plan's measured peak is within the memory limit")
    if a is not None:
        lines.append(f"{c['rows'][0]['plan']} plan / best hand plan{within} "
                     f"({a['best_hand']}) samples/s: {a['ratio']:.2f}x"
                     + (f" (the {c['rows'][0]['plan']} plan runs {c['same_as']}'s layout: "
                        f"the same program as the {c['same_as']} row, so the two rows' "
                        f"difference is not the plan's)" if c.get("same_as") else ""))
    if c.get("memory_limit") is not None:
        first = c["rows"][0]
        lines.append(f"{first['plan']} plan under --memory-per-rank "
                     f"{c['memory_limit'] / 2 ** 20:.1f} MiB: measured peak "
                     f"{first['measured_peak_bytes'] / 2 ** 20:.1f} MiB per rank, "
                     f"{'within' if c['within_limit'] else 'OVER'} the limit")
    lines.append("(measured peak: the largest of the ranks' live tensor bytes over a step; "
                 "predicted: parameters, optimizer state and ZeRO's gathers, plus the most "
                 "backward holds, swept op by op: activations not yet freed, gradients "
                 "made, the reductions in flight)")
    lines += ["", "```", c["auto_plan"], "```"]
    return lines
