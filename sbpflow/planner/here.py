"""``sbpflow plan MODEL --nproc-per-node N``: search a zoo model's whole plan on this
machine's ranks before running any, from logical graphs and this machine's profile.

Every rank lowers the training step (``graph.lower()``: meta stand-ins, nothing runs) of
``MODEL`` (AdamW, a synthetic batch of ``--batch-size`` samples per rank, the one
``sbpflow bench`` uses, per-rank BatchNorm statistics as DDP) and prices it with
:func:`sbpflow.planner.predict.predict_step` on the profile (``--hardware``, default this
machine's calibration for ``N`` ranks, measured first when none is cached):

* the hand layouts its spec offers (data parallel; tensor parallel and data x tensor on a
  2-D mesh where the model has a ``tp`` plan), as a user would pick them;
* the whole-plan search: for every mesh of the ``N`` ranks (one row, and every 2-D
  factorisation ``a x b``) the auto-parallel search (:func:`sbpflow.planner.auto.search`,
  started from data parallel and from that mesh's hand layouts, so that it is never
  predicted slower than them) chooses the layouts and the ZeRO stage, then the other
  ZeRO stages (0, 2, 3; 1 is stage 2's program) are priced on those layouts (ZeRO
  trades memory for gathers; it does not change which op is split).

Rank 0 prints every plan fastest first (a step: the slowest rank's prediction; those
over ``--memory-per-rank`` after the ones that fit), what each loses against the chosen
one, and the chosen plan's explanation;
``--save`` writes it (mesh, ZeRO stage, layouts) for ``sbpflow train --plan FILE``.

Models with a pipeline split also get pipeline rows (:func:`pipeline_rows`: stages x data
parallel, micro-batches, 1F1B), priced from one micro-batch's logical graph; one may be
chosen (:func:`choose`: only when predicted :data:`PIPELINE_MARGIN` faster than the best
layout that fits, or when none fits) and saved as a
pipeline plan (``sbpflow train --plan FILE`` runs it as ``--pp/--dp/--micro-batches``).
"""

from __future__ import annotations

import gc
import sys

__all__ = ["PIPELINE_MARGIN", "choose", "layouts", "pipeline_rows", "rank_main"]


def layouts(spec, n: int) -> list[str]:
    """The layouts of ``spec`` on ``n`` ranks: ``dp``; ``tp`` and, on 4 or more ranks in a
    square-ish mesh, ``dp_tp`` where the model has a ``tp`` plan."""
    out = ["dp"]
    if "tp" in spec.plans and n > 1:
        out.append("tp")
        if n >= 4 and n % 2 == 0:
            out.append("dp_tp")
    return out


def meshes(n: int) -> list[tuple[int, int]]:
    """The meshes of ``n`` ranks the whole-plan search tries, as ``(rows, columns)``: one
    row, then every 2-D factorisation with both sides above 1."""
    return [(n, 1)] + [(a, n // a) for a in range(2, n // 2 + 1) if n % a == 0]


def _release_memory() -> None:
    """Give the memory of the layouts priced before back to the system, before the next
    model is built: the collectives' last works (kept by
    :mod:`sbpflow.distributed._comm`; a parameter broadcast's bucket is up to 250 MiB),
    the graphs and models only the cycle collector frees, and what the C allocator then
    holds free (``malloc_trim``). Without it, ``sbpflow plan gpt2 --nproc-per-node 4``
    (about 25 models built in turn) grew to 23 GB here and was killed for memory."""
    import ctypes

    from ..distributed._state import release_works

    release_works()  # (its default pause lets gloo's threads drop their references first)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def shape_flag(spec, seq_len: int, image_size: int) -> str:
    """The ``sbpflow train`` flag that gives a sample's shape: ``--block-size`` (text),
    ``--image-size`` (images), none (click-through rows)."""
    if spec.task in ("lm", "mlm"):
        return f"--block-size {seq_len}"
    return f"--image-size {image_size}" if spec.task == "image" else ""


def _step(spec, layout: str | None, n: int, batch: int, seq_len: int, image_size: int,
          mesh: tuple[int, int] | None = None, zero: int = 0, memory: int | None = None,
          search_time: float = 10.0):
    """``spec``'s training step on ``n`` ranks as an ``nn.Graph`` and its inputs: laid out
    by ``layout`` (``dp``, ``tp``, ``dp_tp``: the model's plans, the batch as the layout
    reads it, whole under tensor parallelism), or with ``layout=None`` broadcast on
    ``mesh`` (``(rows, columns)``, default all ranks in a row) and ``enable_auto_parallel``
    on (every layout free; ``memory``: its memory limit in bytes per rank; ``search_time``:
    its time limit in seconds). ``zero``: the
    ZeRO stage. AdamW (SGD with momentum for the face job, as bench runs it), per-rank
    BatchNorm statistics, a synthetic batch of ``batch``
    samples per rank. Returns ``(graph, batch (global tensors: inputs, labels),
    placement)``."""
    import sbpflow
    from sbpflow.models.spec import (
        layout_placement,
        per_rank_batch_norm,
        synthetic_batch,
        task_loss,
    )
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import broadcast

    _release_memory()
    sbpflow.manual_seed(0)
    model = spec.build()
    per_rank_batch_norm(model)
    if layout is None:
        pl = layout_placement("cpu", *(mesh or (n, 1)))[0]
        data = (broadcast,) * pl.ndim
        model.to_global(pl, broadcast)
    else:
        tp = 1 if layout == "dp" else (n if layout == "tp" else 2)
        pl, data = layout_placement("cpu", n // tp, tp)
        parallelize_module(model, pl, spec.plan("dp" if layout == "dp" else "tp"), tp_axis=-1)
    # AdamW as `sbpflow train` steps; the face job, which `sbpflow bench` runs, as bench
    # steps it (SGD with momentum, InsightFace's)
    opt = sbpflow.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) \
        if spec.task == "face" else sbpflow.optim.AdamW(model.parameters(), lr=1e-3)
    task = spec.task

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_auto_parallel(layout is None)
            if zero:
                self.config.enable_zero(True, stage=zero)
            if memory is not None:
                self.config.set_auto_parallel_memory_limit(memory)
            self.config.set_auto_parallel_search_time(search_time)

        def build(self, *batch):
            with sbpflow.default_placement(pl):
                loss = task_loss(sbpflow.nn.functional, task, self.model, *batch)
            loss.backward()
            return loss

    return Step(), tuple(sbpflow.tensor(t, placement=pl, sbp=data) for t in
                         synthetic_batch(spec, batch * n, seq_len, 0, 0, image_size)), pl


def _lower(spec, layout: str, n: int, batch: int, seq_len: int, image_size: int):
    """``(logical graph, graph)`` of ``spec``'s step under ``layout``."""
    g, args, _ = _step(spec, layout, n, batch, seq_len, image_size)
    return g.lower(*args), g


def _hand_layouts(spec, n: int, batch: int, seq_len: int, image_size: int,
                  mesh: tuple[int, int]) -> list[dict]:
    """The hand layouts of :func:`layouts` that lay ``n`` ranks out as ``mesh``, each as
    ``{("param", name) | ("input", i): nd-SBP}``: where the search also starts."""
    from . import auto

    out = []
    for layout in layouts(spec, n):
        shape = {"dp": (n, 1), "tp": (n, 1), "dp_tp": (2, n // 2)}[layout]
        if shape != mesh:
            continue
        g, args, _ = _step(spec, layout, n, batch, seq_len, image_size)
        lay = {("param", k): tuple(p.sbp) for k, p in auto._params(g).items()}
        lay.update({("input", i): tuple(x.sbp) for i, x in enumerate(args)})
        out.append(lay)
    return out


def _auto(spec, n: int, batch: int, seq_len: int, image_size: int, hw,
          mesh: tuple[int, int] = None, memory: int | None = None,
          search_time: float = 10.0):
    """The auto-parallel plan of ``spec``'s training step on ``n`` ranks on ``mesh`` (the
    model and the batch broadcast, every layout free; the search also starts from the
    hand layouts of that mesh), priced on ``hw``."""
    import torch

    from . import auto

    mesh = mesh or (n, 1)
    starts = tuple(_hand_layouts(spec, n, batch, seq_len, image_size, mesh))
    g, args, pl = _step(spec, None, n, batch, seq_len, image_size, mesh, memory=memory,
                        search_time=search_time)
    with torch.enable_grad():
        return auto.search(g, args, {}, pl, hw, "cpu", list(range(n)), starts)


def _with_zero(spec, n: int, batch: int, seq_len: int, image_size: int, hw, plan,
               zero: int, memory: int | None):
    """``plan``'s layouts priced under ZeRO stage ``zero`` (one logical graph)."""
    import torch

    from . import auto

    g, args, pl = _step(spec, None, n, batch, seq_len, image_size,
                        tuple(plan.placement.shape) + (1,) * (2 - plan.placement.ndim),
                        zero, memory)
    with torch.enable_grad():
        out = auto.given(g, args, {}, pl, hw, "cpu", list(range(n)),
                         {**plan.to_dict(), "zero_stage": zero})
    out.source = f"the search's layouts on mesh {list(pl.shape)} under ZeRO stage {zero}"
    return out


#: The schedules the pipeline rows price (GPipe is left out: the same work as 1F1B,
#: every micro-batch's activations held, never faster in the simulation with equal
#: stages); interleaved with two model chunks per rank where the model's split allows.
PIPELINE_SCHEDULES = (("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2))


def pipeline_rows(spec, n: int, batch: int, seq_len: int, image_size: int, hw) -> list:
    """The pipeline plans of ``spec`` on ``n`` ranks (a model with a pipeline split):
    every ``P`` stages dividing ``n`` (``D = n / P`` data-parallel ranks per stage), the
    micro-batch counts of :func:`sbpflow.planner.pipeline.micro_batch_choices` over the
    ``batch x P`` samples a data-parallel replica takes a step, and the schedules of
    :data:`PIPELINE_SCHEDULES` (1F1B, zero-bubble ZB-H1, interleaved 1F1B with two
    chunks per rank where the split has ``2 P`` parts and ``M`` is a multiple of
    ``P``), each priced by :func:`~sbpflow.planner.pipeline.predict_pipeline` from the
    logical graph of one micro-batch (data parallel on all ``n`` ranks, a micro-batch's
    samples on each: the shapes a stage runs). ``[(name, PipelinePlan, train
    arguments)]``; every rank calls it, in step."""
    from ..distributed import _comm
    from .auto import graph_optimizer
    from .pipeline import PipelinePlan, micro_batch_choices, predict_pipeline
    from .predict import TERMS, slowest_rank

    if spec.pipeline_split is None or n < 2:
        return []
    out = []
    for p in (k for k in range(2, n + 1) if n % k == 0):
        split = {}
        for _, v in PIPELINE_SCHEDULES:
            try:
                split[v] = spec.pipeline_stages(p * v)
            except ValueError:  # fewer blocks than stages
                pass
        if 1 not in split:
            continue
        d = n // p
        shape = shape_flag(spec, seq_len, image_size)
        for m in micro_batch_choices(batch * p, p):
            lg, g = _lower(spec, "dp", n, batch * p // m, seq_len, image_size)
            for schedule, v in PIPELINE_SCHEDULES:
                if v not in split or (schedule == "interleaved" and m % p):
                    continue
                t = predict_pipeline(lg, split[v], m, d, hw, optimizer=graph_optimizer(g),
                                     schedule=schedule, virtual_stages=v, prefix="model.")
                # the slowest rank's terms and the largest memory, as every row's (op
                # timings differ by rank): the same plan on every rank
                t.update(slowest_rank({k: t[k] for k in TERMS}, list(range(n))))
                t["memory"] = max(r[0] for r in _comm.all_gather_meta([t["memory"]],
                                                                       list(range(n))))
                tag = {"1f1b": "", "zero_bubble": " zb"}.get(schedule, f" v{v}")
                name = f"pp{p}{f' x dp{d}' if d > 1 else ''} m{m}{tag}"
                cmd = (f"--pp {p} --dp {d} --tp 1 --micro-batches {m} --schedule {schedule}"
                       f"{f' --virtual-stages {v}' if v > 1 else ''} --batch-size "
                       f"{batch * n} {shape}")
                out.append((name, PipelinePlan(p, d, m, schedule, split[v], t, hw.name,
                                               batch * n, virtual_stages=v), cmd.rstrip()))
    return out


def search_plans(spec, n: int, batch: int, seq_len: int, image_size: int, hw,
                 memory: int | None = None, search_time: float = 10.0) -> list:
    """The whole-plan search (see the module doc): ``[(name, AutoPlan)]``, one per mesh
    and ZeRO stage, in the order priced; every rank calls it, in step."""
    from ..graph.trace import GraphError
    from .auto import MemoryLimitError

    out = []
    for mesh in meshes(n):
        name = f"auto {list(mesh) if mesh[1] > 1 else [n]}"
        try:
            plan = _auto(spec, n, batch, seq_len, image_size, hw, mesh, memory, search_time)
        except MemoryLimitError as e:  # nothing found fits: the unlimited plan is shown (as
            # over), with what the limited search found least and whether it was cut
            plan = _auto(spec, n, batch, seq_len, image_size, hw, mesh, None, search_time)
            plan.miss = (e.least, bool(e.cut))
        out.append((f"{name} zero{plan.zero_stage}" if plan.zero_stage else name, plan))
        # the search's layouts under the other ZeRO stages (not 1: sbpflow's stage 1
        # shards the gradients too and compiles to stage 2's program)
        for zero in (0, 2, 3):
            if zero == plan.zero_stage:
                continue
            try:
                z = _with_zero(spec, n, batch, seq_len, image_size, hw, plan, zero, None)
            except GraphError:
                continue
            out.append((f"{name} zero{zero}" if zero else name, z))
    return out


def rank_main(model: str, hardware: str, batch: int, seq_len: int, image_size: int,
              save: str = "", memory: str = "", search_time: str = "10") -> int:
    """One rank of the job: price the hand layouts and search the whole plan; rank 0
    prints the table and the chosen plan's explanation, and writes ``save`` when
    given."""
    import torch

    import sbpflow
    from sbpflow import distributed as sd
    from sbpflow.distributed.launch import REPORTED_EXIT
    from sbpflow.graph.show import _fmt_bytes

    from .auto import graph_optimizer
    from .hardware import load
    from .predict import TERMS, predict_memory, predict_step, slowest_rank

    torch.set_num_threads(1)
    sd.init()
    n, rank = sd.get_world_size(), sd.get_rank()
    spec = sbpflow.models.get(model)
    hw = load(hardware)
    limit = int(memory) if memory else None
    rows = []  # (name, terms, memory bytes, AutoPlan or None)
    for layout in layouts(spec, n):
        lg, g = _lower(spec, layout, n, batch, seq_len, image_size)
        terms = slowest_rank(predict_step(lg, hw, optimizer=graph_optimizer(g)),
                             list(range(n)))  # as the search's: the slowest rank's
        rows.append((layout, terms, predict_memory(lg, 2.0)["total"], None))  # no ZeRO
    pipelines = pipeline_rows(spec, n, batch, seq_len, image_size, hw)
    rows += [(name, {k: plan.prediction[k] for k in TERMS + ("total",)},
              plan.prediction["memory"], plan) for name, plan, _ in pipelines]
    if n > 1:
        for name, plan in search_plans(spec, n, batch, seq_len, image_size, hw, limit,
                                       float(search_time)):
            rows.append((name, {**plan.best.terms, "total": plan.best.seconds},
                         plan.best.memory, plan))

    def fits(r):
        return limit is None or r[2] <= limit

    rows.sort(key=lambda r: (not fits(r), r[1]["total"]))
    chosen, eligible = choose(rows, fits)
    if rank != 0:
        return 0 if chosen is not None or n == 1 else REPORTED_EXIT
    print(f"{model} on {n} rank(s), {batch} samples per rank, profile {hw.name} "
          f"(predicted from each plan's logical graph"
          f"{f'; memory limit {_fmt_bytes(limit)} per rank' if limit else ''}):\n")
    host = any(r[1].get("host", 0) > 0 for r in rows)  # a profile that prices calls
    print("| plan | predicted step ms | compute ms | update ms | communication ms | "
          f"bubble ms | {'host ms | ' if host else ''}memory per rank | against the chosen |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if host else ""))
    for r in rows:
        name, p, mem, _ = r
        if r is chosen:
            faster = [q for q in rows if fits(q) and q[1]["total"] < p["total"] * 0.9999]
            # (an eligible one is within 1%, else it would be chosen; the others are
            # pipelines passed over by the margin)
            notes = (["within 1% of the fastest, simpler"] if any(
                eligible(q) for q in faster) else []) + \
                (["a faster pipeline is within the model's error on pipelines"]
                 if any(not eligible(q) for q in faster) else [])
            why = "chosen" + (f" ({'; '.join(notes)})" if notes else "")
        elif not fits(r):
            why = f"over the limit by {_fmt_bytes(mem - limit)}"
        elif chosen is not None:
            d = (p['total'] - chosen[1]['total']) * 1e3
            why = "the same" if abs(d) < 0.05 else f"{d:+.1f} ms" + (
                f" (not taken: a pipeline is chosen over a layout when predicted to take "
                f"{PIPELINE_MARGIN:.0%} less time than the best one)"
                if not eligible(r) and d < 0 else "")
        else:
            why = ""
        host_cell = f"{p.get('host', 0) * 1e3:.1f} | " if host else ""
        print(f"| {name} | {p['total'] * 1e3:.1f} | {p['compute'] * 1e3:.1f} | "
              f"{p.get('update', 0) * 1e3:.1f} | {p['communication'] * 1e3:.1f} | "
              f"{p.get('bubble', 0) * 1e3:.1f} | {host_cell}{_fmt_bytes(mem)} | {why} |")
    if not pipelines and n > 1:
        print(f"\n(no pipeline rows: {model} has no pipeline split; "
              f"ModelSpec.pipeline_split gives one)")
    if pipelines:
        best = min(pipelines, key=lambda r: (limit is not None and r[1].prediction["memory"]
                                             > limit, r[1].prediction["total"]))
        print(f"\n(pp rows: a pipeline of P stages over D data-parallel ranks each, M "
              f"micro-batches, 1F1B, zero-bubble (zb) or interleaved with V chunks a rank "
              f"(vV), predicted from one micro-batch's logical graph op by op on the stage "
              f"that runs it, the schedule's own action lists timed with each stage's "
              f"forward, input- and weight-gradient times; --save writes a pp row as any "
              f"other, or run one by hand, e.g. {best[0]}: `sbpflow train {model} "
              f"--nproc-per-node {n} {best[2]}`)")
    if chosen is None and n > 1:
        # the least memory priced: a row's, or what a limited search found (its layouts
        # are not a row: the row is the same mesh's search without the limit)
        least = min([(r[2], r[0]) for r in rows] +
                    [(r[3].miss[0], f"a layout of the {r[0]} search")
                     for r in rows if getattr(r[3], "miss", None)])
        cut = f", or a longer --search-time (a search ran out of its {search_time} s)" \
            if any(getattr(r[3], "miss", None) and r[3].miss[1] for r in rows) else ""
        print(f"\nno plan fits {_fmt_bytes(limit)} per rank: the smallest, {least[1]}, needs "
              f"{_fmt_bytes(least[0])}; raise --memory-per-rank, use more ranks or a "
              f"smaller --batch-size{cut}{' (nothing saved)' if save else ''}")
        return REPORTED_EXIT  # (the launcher adds no failure report; exits 1)
    if chosen is not None:
        plan = chosen[3]
        print(f"\nchosen: {chosen[0]}\n{_explained(plan, rows)}")
        if save:  # (with the batch it was priced for: a run at another is warned)
            from .plan_file import save_plan

            save_plan(save, {**plan.to_dict(), "global_batch": batch * n}, False)
            shape = shape_flag(spec, seq_len, image_size)
            run = (f"sbpflow train {model} --nproc-per-node {n} --plan {save} --batch-size "
                   f"{batch * n} {shape}".rstrip()) if spec.task != "face" else \
                (f"sbpflow bench {model} --nproc-per-node {n} --plan {save} --batch-size "
                 f"{batch}")  # a synthetic job: bench runs it, train has no data for it
            print(f"\nsaved the chosen plan to {save} (priced for {batch} samples a rank: "
                  f"{run} runs it as priced)")
    return 0


#: How much faster than the best layout that fits a pipeline must be predicted to be
#: chosen: the cost model's spread on pipelines, measured on this machine (2026-12-04):
#: gpt-mini pipelines were predicted 0.67-1.10x of their measured step where data
#: parallel was 0.73-0.93x (not the program's calls, 1.4 us each beyond the timed ops
#: here: ops run slower in a step than timed alone, more so with more ranks). A pipeline
#: that is the only plan fitting the memory limit is chosen anyway.
PIPELINE_MARGIN = 0.25


def choose(rows: list, fits) -> tuple:
    """The chosen row of ``rows`` (``(name, terms, memory, plan)``, fastest first; plan
    None for a hand layout, which is shown, not chosen) and the test ``eligible(row)``:
    the simplest plan (:func:`_simplicity`) within 1% of the fastest that ``fits``
    (closer is the model's noise, as in the search), a pipeline only when no layout
    fits or it is predicted :data:`PIPELINE_MARGIN` faster than the best layout that
    does. ``(None, eligible)`` when nothing fits."""
    ok = [r for r in rows if r[3] is not None and fits(r)]
    best_layout = next((r[1]["total"] for r in ok if not _is_pipeline(r[3])), None)

    def eligible(r):
        return not _is_pipeline(r[3]) or best_layout is None or \
            r[1]["total"] < (1 - PIPELINE_MARGIN) * best_layout

    ok = [r for r in ok if eligible(r)]
    chosen = min((r for r in ok if r[1]["total"] <= ok[0][1]["total"] * 1.01),
                 key=lambda r: (_simplicity(r[3]), r[1]["total"])) if ok else None
    return chosen, eligible


def _is_pipeline(plan) -> bool:
    from .pipeline import PipelinePlan

    return isinstance(plan, PipelinePlan)


def _simplicity(plan) -> tuple:
    """How simple a plan is to run, least first: one mesh axis before two, less ZeRO, a
    pipeline last (the chosen plan is the simplest within 1% of the fastest)."""
    if _is_pipeline(plan):
        return (3, 0)
    return (plan.placement.ndim, plan.zero_stage)


def _explained(plan, rows) -> str:
    """The chosen plan's explanation: its mesh search's (a ZeRO row's layouts came from
    the search of its mesh); a pipeline's own."""
    if plan.source in ("search", "pipeline"):
        return str(plan)
    search = next(r[3] for r in rows if r[3] is not None and r[3].source == "search"
                  and r[3].placement.shape == plan.placement.shape)
    return f"{plan}\nits layouts, from the search on mesh {list(plan.placement.shape)}:\n" \
           f"{search}"


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(rank_main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), *a[5:]))
