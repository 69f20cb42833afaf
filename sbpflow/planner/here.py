"""``sbpflow plan MODEL --nproc-per-node N``: rank a zoo model's layouts on this machine's
ranks before running any, from each layout's logical graph and this machine's profile.

Every rank lowers the training step (``graph.lower()``: meta stand-ins, nothing runs) of
``MODEL`` under each layout its spec offers on ``N`` ranks (data parallel; tensor
parallel and data x tensor on a 2-D mesh where the model has a ``tp`` plan), AdamW, a
synthetic batch of ``--batch-size`` samples per rank (the one ``sbpflow bench`` uses),
per-rank BatchNorm statistics (as DDP); :func:`sbpflow.planner.predict.predict_step`
prices each on the profile (``--hardware``, default this machine's calibration for ``N``
ranks, measured first when none is cached). Rank 0 prints them fastest first.
"""

from __future__ import annotations

import sys

__all__ = ["layouts", "rank_main"]


def layouts(spec, n: int) -> list[str]:
    """The layouts of ``spec`` on ``n`` ranks: ``dp``; ``tp`` and, on 4 or more ranks in a
    square-ish mesh, ``dp_tp`` where the model has a ``tp`` plan."""
    out = ["dp"]
    if "tp" in spec.plans and n > 1:
        out.append("tp")
        if n >= 4 and n % 2 == 0:
            out.append("dp_tp")
    return out


def _step(spec, layout: str | None, n: int, batch: int, seq_len: int, image_size: int):
    """``spec``'s training step on ``n`` ranks as an ``nn.Graph`` and its inputs: laid out
    by ``layout`` (``dp``, ``tp``, ``dp_tp``: the model's plans, the batch as the layout
    reads it, whole under tensor parallelism), or with ``layout=None`` broadcast on all
    ranks in a row and ``enable_auto_parallel`` on (every layout free). AdamW, per-rank
    BatchNorm statistics, a synthetic batch of ``batch`` samples per rank. Returns
    ``(graph, (x, y), placement)``."""
    import sbpflow
    from sbpflow.models.spec import (
        layout_placement,
        per_rank_batch_norm,
        synthetic_batch,
        task_loss,
    )
    from sbpflow.nn.parallel import parallelize_module
    from sbpflow.sbp import broadcast

    sbpflow.manual_seed(0)
    model = spec.build()
    per_rank_batch_norm(model)
    if layout is None:
        pl, data = sbpflow.placement("cpu", list(range(n))), (broadcast,)
        model.to_global(pl, broadcast)
    else:
        tp = 1 if layout == "dp" else (n if layout == "tp" else 2)
        pl, data = layout_placement("cpu", n // tp, tp)
        parallelize_module(model, pl, spec.plan("dp" if layout == "dp" else "tp"), tp_axis=-1)
    opt = sbpflow.optim.AdamW(model.parameters(), lr=1e-3)
    task = spec.task

    class Step(sbpflow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_auto_parallel(layout is None)

        def build(self, x, y):
            with sbpflow.default_placement(pl):
                loss = task_loss(sbpflow.nn.functional, task, self.model, x, y)
            loss.backward()
            return loss

    x, y = synthetic_batch(spec, batch * n, seq_len, 0, 0, image_size)
    return Step(), (sbpflow.tensor(x, placement=pl, sbp=data),
                    sbpflow.tensor(y, placement=pl, sbp=data)), pl


def _lower(spec, layout: str, n: int, batch: int, seq_len: int, image_size: int):
    """``(logical graph, graph)`` of ``spec``'s step under ``layout``."""
    g, args, _ = _step(spec, layout, n, batch, seq_len, image_size)
    return g.lower(*args), g


def _auto(spec, n: int, batch: int, seq_len: int, image_size: int, hw):
    """The auto-parallel plan of ``spec``'s training step on ``n`` ranks in a row (the
    model and the batch broadcast, every layout free), priced on ``hw``."""
    import torch

    from . import auto

    g, args, pl = _step(spec, None, n, batch, seq_len, image_size)
    with torch.enable_grad():
        return auto.search(g, args, {}, pl, hw, "cpu", list(range(n)))


def rank_main(model: str, hardware: str, batch: int, seq_len: int, image_size: int,
              save: str = "") -> int:
    """One rank of the job: lower and price every layout and search the auto plan; rank 0
    prints the table and the plan's explanation, and writes ``save`` when given."""
    import torch

    import sbpflow
    from sbpflow import distributed as sd

    from .auto import graph_optimizer
    from .hardware import load
    from .predict import predict_step

    torch.set_num_threads(1)
    sd.init()
    n, rank = sd.get_world_size(), sd.get_rank()
    spec = sbpflow.models.get(model)
    hw = load(hardware)
    rows = []
    for layout in layouts(spec, n):
        lg, g = _lower(spec, layout, n, batch, seq_len, image_size)
        rows.append((layout, predict_step(lg, hw, optimizer=graph_optimizer(g))))
    plan = _auto(spec, n, batch, seq_len, image_size, hw) if n > 1 else None
    if plan is not None:
        rows.append(("auto", plan.best.terms))
    rows.sort(key=lambda r: r[1]["total"])
    if rank == 0:
        print(f"{model} on {n} rank(s), {batch} samples per rank, profile {hw.name} "
              f"(predicted from each layout's logical graph):\n")
        print("| layout | predicted step ms | compute ms | update ms | communication ms |")
        print("|---|---|---|---|---|")
        for layout, p in rows:
            print(f"| {layout} | {p['total'] * 1e3:.1f} | {p['compute'] * 1e3:.1f} | "
                  f"{p.get('update', 0) * 1e3:.1f} | {p['communication'] * 1e3:.1f} |")
        if plan is not None:
            print(f"\n{plan}")
            if save:
                plan.save(save)
                print(f"\nsaved the auto plan to {save} (sbpflow train {model} "
                      f"--nproc-per-node {n} --plan {save} runs it)")
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(rank_main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), *a[5:]))
