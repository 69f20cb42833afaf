"""``sbpflow calibrate``: measure this machine's cost-model terms and cache them as a
hardware profile (:mod:`sbpflow.planner.hardware`).

Each of ``--nproc-per-node`` ranks (one torch thread each, as sbpflow runs several ranks
on one machine) measures, and rank 0 writes the medians:

* the achieved matrix-multiply rate: float32 ``n x n @ n x n`` for n = 256, 512, 1024
  (``2 n^3`` FLOPs; the best size's median);
* the achieved memory bandwidth: copying a 32 MiB tensor (64 MiB read and written);
* the links: all-reduce, all-gather, reduce-scatter, all-to-all and broadcast over the
  ranks, each of 4 KiB to 16 MiB (three sizes with ``--quick``) as a compiled program
  runs them (torch's functional collectives and their waits: :func:`_collectives`), each kind
  fitted to its ring model ``steps x latency + bytes sent / bandwidth``
  (:func:`sbpflow.planner.cost.collective_time`) by least squares of the relative error
  (small and large messages alike); the all-reduce's fit is the profile's ``intra_node``
  link, every kind's its ``collectives`` entry.

  Each collective is timed back to back (:func:`_in_step` without compute: the ranks
  arrive together). A step's ranks do not: they compute between collectives and drift
  apart while they do (the OS, the other ranks' processes and gloo's threads share the
  cores), and every collective waits for the last rank. So the profile's
  ``collective_wait`` curve is measured too: what a 4 KiB all-reduce adds beyond its
  back-to-back time between blocks of :data:`STEP_GAPS` of matrix multiplies (each gap
  as the machine ran it with every rank computing). Here (2 ranks on 2 cores, gloo) a
  1 MiB all-reduce took 0.35-0.9 ms back to back and 2.1-2.9 ms between 1.4-5.4 ms of
  compute, and gpt-mini's tensor-parallel step waited 3.0 ms on average in each of its
  22 all-reduces (torch's profiler), where the back-to-back fit priced 1.3 ms.
* the step: small compiled training steps (:data:`STEP_MODEL`: data parallel, tensor
  parallel, ZeRO-3), timed and fitted (:func:`_step_terms`) for the profile's
  ``step_seconds`` (what a compiled step takes beyond the other terms: the program's
  check at each call, its Python; priced once a step) and the latencies of the
  all-reduce and of the all-gather and reduce-scatter, which replace the back-to-back
  fits' (the bandwidths stay theirs): here a small collective took 0.3-2.7 ms back to
  back, differently at each measurement, while compiled steps of many collectives ran
  within 10% of each other.

The profile's efficiencies are 1.0 (the measured rates are the achieved ones), its
``op_timing`` is ``"measured"`` (a search prices ops by timing them here:
:class:`sbpflow.planner.predict.OpTimer`) and its only node holds the ranks (each rank's
memory: the machine's over the ranks). It is
written to ``--out`` or to the cache (``$SBPFLOW_CACHE``, default ``~/.cache/sbpflow``,
file ``calibration-<host>-<N>ranks-v4[-quick].json``); an existing file is kept unless
``--force``. ``sbpflow plan --nproc-per-node N --hardware FILE`` reads it (its matmuls in
float32, the one dtype measured; N the ranks it measured: a measured profile of another
count is refused).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

__all__ = ["build_parser", "cache_path", "load_cached", "main", "profile_here", "wrong_ranks"]


#: Seconds of compute between two small all-reduces at which calibration measures the
#: ranks' wait (the profile's ``collective_wait`` curve): about what steps compute
#: between their collectives (gpt-mini on 2 ranks here: 4-5 ms between tensor
#: parallelism's all-reduces, 2 ms between ZeRO's gathers; DLRM's whole step is 3 ms).
STEP_GAPS = (1e-3, 3e-3, 9e-3)

#: Rounds of each wait measurement (``--quick``'s apart): the wait is the noisiest term
#: (three calibrations of five rounds minutes apart here: 0.02-1.1 ms after 1 ms of
#: compute), and its rounds are cheap beside the collectives'.
WAIT_ROUNDS, WAIT_ROUNDS_QUICK = 15, 7

#: The calibration's method, in the cache's file names: a profile measured otherwise
#: (collectives back to back, before version 2; without ``step_seconds``, before 3;
#: latencies from back-to-back loops, before 4) is
#: not read as this machine's, and is left where it is.
METHOD = 4

#: The model whose compiled steps calibration times for the profile's ``step_seconds``
#: and collective latencies (:func:`_step_terms`): Linear layers of this width (rounded
#: up to a multiple of the ranks) and count, a batch of as many rows per rank.
STEP_MODEL = (16, 8)


def cache_path(nproc: int, quick: bool = False) -> str:
    """Where ``sbpflow calibrate`` keeps this machine's profile for ``nproc`` ranks
    (``--quick``'s apart): ``calibration-HOST-Nranks-vMETHOD[-quick].json`` under
    ``$SBPFLOW_CACHE``, else ``~/.cache/sbpflow``."""
    root = os.environ.get("SBPFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "sbpflow")
    tag = "-quick" if quick else ""
    return os.path.join(root, f"calibration-{socket.gethostname()}-{nproc}ranks-v{METHOD}"
                              f"{tag}.json")


def wrong_ranks(hw, nproc: int) -> str:
    """Why profile ``hw`` (a :class:`sbpflow.planner.hardware.Hardware`) cannot price a
    job of ``nproc`` ranks on this machine, or ``""`` when it can: a profile ``sbpflow
    calibrate`` measured (``op_timing`` ``"measured"``) on another number of ranks (its
    ``devices_per_node``), whose collectives and ranks' waits were fitted for that
    count. A roofline profile (a named one) prices any count."""
    if hw.op_timing != "measured" or hw.devices_per_node == nproc:
        return ""
    return (f"measured by sbpflow calibrate on {hw.devices_per_node} rank(s) "
            f"(devices_per_node {hw.devices_per_node}), not {nproc}: its collectives and "
            f"waits were fitted for {hw.devices_per_node}")


def load_cached(path: str, nproc: int):
    """This machine's cached calibration for ``nproc`` ranks (the file at ``path``, e.g.
    :func:`cache_path`'s), as a :class:`sbpflow.planner.hardware.Hardware`: a profile
    whose fields ``sbpflow calibrate`` writes are all there (``step_seconds``; with 2 or
    more ranks ``collective_wait``: a named profile may omit them, a calibration that
    lacks one would price no step or no wait) and measured on ``nproc`` ranks.

    Raises:
        ProfileError: names the file and the field or both rank counts (the caller adds
            the fix: ``sbpflow calibrate --nproc-per-node N --force``).
    """
    from .hardware import ProfileError, load

    hw = load(path, require=("step_seconds",) + (("collective_wait",) if nproc > 1 else ()))
    why = wrong_ranks(hw, nproc)
    if why:
        raise ProfileError(f"hardware profile {path}: {why}")
    return hw


def build_parser(prog: str = "sbpflow calibrate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace(
        "``", ""))
    p.add_argument("--nproc-per-node", type=int, default=2, metavar="N",
                   help="ranks to measure with (default 2)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the profile goes (default: $SBPFLOW_CACHE, else "
                   f"~/.cache/sbpflow, file calibration-HOST-Nranks-v{METHOD}[-quick].json; "
                   "`sbpflow plan --hardware FILE` reads it)")
    p.add_argument("--force", action="store_true",
                   help="measure again and replace an existing profile")
    p.add_argument("--quick", action="store_true", help="smaller sizes (a few seconds)")
    return p


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _in_step(collective, block, iters: int, rounds: int = 5) -> tuple[float, float]:
    """``(adds, gap)``: seconds ``collective()`` adds to a loop of ``iters`` times
    ``block()`` (compute; None: nothing, the collectives back to back) then
    ``collective()``, against the loop of ``block()`` alone, per iteration, and the
    seconds ``block()`` took in that loop (the gap the ranks computed between two
    collectives, as the machine ran it with every rank computing); the medians of
    ``rounds`` such pairs (``adds`` at least 1 us). Every rank runs it in step (the
    collectives pair up)."""
    block = block or (lambda: None)
    block()
    collective()  # warm-up
    rows = [_round(collective, block, iters, paired=False) for _ in range(rounds)]
    return max(statistics.median(a for a, _, _ in rows), 1e-6), \
        statistics.median(g for _, g, _ in rows)


def _wait_in_step(collective, block, iters: int, rounds: int) -> tuple[float, float]:
    """``(wait, gap)``: the seconds ``collective()`` takes beyond its back-to-back time
    when run after each ``block()`` (:func:`_in_step`'s ``adds`` less its time back to
    back), each round's two measured one after the other and subtracted there, the
    median over ``rounds`` (at least 0), and ``block()``'s seconds in that loop. Paired
    so: measured minutes apart, the back-to-back time here moved 0.4-1.7 ms for a 4 KiB
    all-reduce, more than the wait it was subtracted from."""
    block()
    collective()  # warm-up
    rows = [_round(collective, block, iters, paired=True) for _ in range(rounds)]
    return max(statistics.median(a - b for a, _, b in rows), 0.0), \
        statistics.median(g for _, g, _ in rows)


def _round(collective, block, iters: int, paired: bool) -> tuple[float, float, float]:
    """One round of :func:`_in_step` / :func:`_wait_in_step`, per iteration: ``(adds,
    gap, back to back)``, the last timed first (``paired``; else 0)."""
    back = 0.0
    if paired:
        t0 = time.perf_counter()
        for _ in range(iters):
            collective()
        back = (time.perf_counter() - t0) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        block()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        block()
        collective()
    return (time.perf_counter() - t0 - alone) / iters, alone / iters, back


def _compute_block(seconds: float, flops: float, gen):
    """A function that runs about ``seconds`` of 256 x 256 float32 matrix multiplies at
    ``flops`` FLOP/s."""
    import torch

    n = 256
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    c = torch.empty(n, n)
    k = max(1, round(seconds * flops / (2 * n ** 3)))

    def block():
        for _ in range(k):
            torch.mm(a, b, out=c)
    return block


def _measure(quick: bool) -> dict:
    """This rank's measurements (every rank runs the same collectives, in step)."""
    import torch

    from sbpflow import distributed as sd
    from sbpflow.distributed import _comm, _state

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)  # its own: a job calibrating mid-run (automatic
    # parallelism) must not move the default generator its dropout draws from
    best = 0.0
    for n in (256, 512) if quick else (256, 512, 1024):
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        best = max(best, 2 * n ** 3 / _median_time(lambda a=a, b=b: a @ b, 5))
    x = torch.randn(2 ** 23, generator=g)
    y = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / _median_time(lambda: y.copy_(x), 5)
    world = sd.get_world_size()
    points, wait = {}, []
    if world > 1:
        ranks = list(range(world))
        _state.ensure_groups([tuple(ranks)])
        sizes = (2 ** 12, 2 ** 18, 2 ** 22) if quick else \
            (2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24)
        iters = 6 if quick else 12
        # every rank the same blocks (the agreed rate: the ranks' loops stay in step)
        rate = _comm.all_reduce(torch.tensor([best], dtype=torch.float64), ranks).item()
        saved = _state._ensure().config.check  # every rank: off together, back together
        _state.set_check("off")
        try:
            kinds = _collectives(ranks)
            for kind, fn in kinds.items():
                points[kind] = []
                for nbytes in sizes:  # (a multiple of the ranks: 3 ranks split it too)
                    t = torch.ones(nbytes // 4 // world * world)
                    points[kind].append((nbytes, _in_step(lambda f=fn, t=t: f(t), None,
                                                          iters)[0]))
            # the wait: a small all-reduce between blocks of compute, beyond its time back
            # to back
            t = torch.ones(sizes[0] // 4 // world * world)
            for gap in STEP_GAPS:
                extra, wall = _wait_in_step(lambda t=t: kinds["all_reduce"](t),
                                            _compute_block(gap, rate / world, g), iters,
                                            WAIT_ROUNDS_QUICK if quick else WAIT_ROUNDS)
                wait.append((wall, extra))
        finally:
            _state.set_check(saved)
    return {"flops": best, "bandwidth": bandwidth, "points": points, "world": world,
            "wait": wait}


def _collectives(ranks: list[int]) -> dict:
    """``{kind: fn(t)}``: each kind of collective on a flat float32 tensor ``t`` (its
    full buffer: an all-gather's output, a reduce-scatter's input), as a compiled program
    runs it: torch's functional collective (``torch.ops._c10d_functional``, the op
    :mod:`sbpflow.graph` traces a step's collectives to) and its ``wait_tensor``. Not
    sbpflow's eager collectives: their library calls differ (gloo's reduce-scatter of
    4 KiB took 0.6-0.7 ms back to back eagerly here and 1.8-2.1 ms as a program's), and
    the planner prices compiled programs."""
    from sbpflow.distributed import _comm

    w = len(ranks)
    ops = _comm._funcol()
    group = _comm._group_rank_order(ranks)[0].group_name

    def done(out):
        return ops.wait_tensor(out)
    return {
        "all_reduce": lambda t: done(ops.all_reduce(t, "sum", group)),
        "all_gather": lambda t: done(ops.all_gather_into_tensor(t[: t.numel() // w], w,
                                                                group)),
        "reduce_scatter": lambda t: done(ops.reduce_scatter_tensor(t, "sum", w, group)),
        "all_to_all": lambda t: done(ops.all_to_all_single(t, [t.numel() // w] * w,
                                                           [t.numel() // w] * w, group)),
        "broadcast": lambda t: done(ops.broadcast(t, 0, group)),
    }


def _fit(points: list, kind: str, n: int) -> tuple[float, float]:
    """``sec = steps x latency + share x bytes / bandwidth`` (collective ``kind``'s ring
    model over ``n`` ranks: :func:`sbpflow.planner.cost.steps_and_share`) fitted to
    ``points`` ``[(bytes, sec)]`` by least squares of the relative error (weights
    ``1 / sec^2``): (latency s, bandwidth bytes/s)."""
    from .cost import steps_and_share

    k, share = steps_and_share(kind, n)
    xs = [share * b for b, _ in points]
    ys = [s for _, s in points]
    ws = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / \
        sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return intercept / k, 1.0 / slope


def _agreed(mine: dict) -> dict:
    """Every rank's measurements averaged over the ranks (the all-reduce times too), so
    that every rank builds the same profile."""
    import torch

    world = mine["world"]
    kinds = list(mine["points"])
    vals = torch.tensor([mine["flops"], mine["bandwidth"],
                         *(s for k in kinds for _, s in mine["points"][k]),
                         *(x for pt in mine["wait"] for x in pt)], dtype=torch.float64)
    if world > 1:
        from sbpflow.distributed import _comm

        vals = _comm.all_reduce(vals, list(range(world))) / world
    v = iter(vals.tolist())
    flops, bandwidth = next(v), next(v)
    return {"flops": flops, "bandwidth": bandwidth, "world": world,
            "points": {k: [(b, next(v)) for b, _ in mine["points"][k]] for k in kinds},
            "wait": [(next(v), next(v)) for _ in mine["wait"]]}


def _profile(m: dict, quick: bool) -> dict:
    """The hardware profile (a JSON object of :mod:`sbpflow.planner.hardware`'s fields)
    of agreed measurements ``m``."""
    world = m["world"]
    kinds = {k: _fit(pts, k, world) for k, pts in m["points"].items()}
    if world > 1:
        latency, link_bw = kinds["all_reduce"]
    else:  # no link to measure: a stand-in (the profile format needs one), said so below
        latency, link_bw = 0.0, m["bandwidth"]
    return {
        "name": f"calibrated-{socket.gethostname()}-{world}ranks",
        "description": f"this machine, measured by sbpflow calibrate with {world} rank(s) of "
                       f"one torch thread each, {time.strftime('%Y-%m-%d %H:%M:%S')}",
        "peak_flops": {"float32": m["flops"]},
        "memory_bytes": _memory_bytes() // world,  # the ranks share the machine's
        "memory_bandwidth": m["bandwidth"],
        "devices_per_node": world,
        "intra_node": {"bandwidth": link_bw, "latency": latency},
        "inter_node": {"bandwidth": link_bw, "latency": latency},
        "collectives": {k: {"bandwidth": bw, "latency": lat}
                        for k, (lat, bw) in kinds.items()},
        "op_timing": "measured",
        "matmul_efficiency": 1.0, "memory_efficiency": 1.0, "link_efficiency": 1.0,
        "sources": "measured (sbpflow.planner.calibrate): float32 matmul, a 32 MiB copy, "
                   + ("collectives back to back: " if m["points"] else "")
                   + ("; ".join(f"{k} of " + ", ".join(f"{b} B: {s * 1e6:.0f} us"
                                                       for b, s in pts)
                                for k, pts in m["points"].items())
                      if m["points"] else "no link (1 rank: the links stand in as memory "
                      "copies)")
                   + ("; a 4 KiB all_reduce's wait beyond that after " + ", ".join(
                       f"{g * 1e3:.1f} ms of compute: {w * 1e6:.0f} us" for g, w in m["wait"])
                      if m["wait"] else "") + (" (--quick)" if quick else ""),
        "collective_wait": [[g, w] for g, w in m["wait"] if g > 0],
    }


#: The collective kinds whose latency :func:`_step_terms` fits from compiled steps, in
#: families that share one (a step of tensor parallelism runs the first, ZeRO's the
#: second); the other kinds keep their back-to-back fit.
STEP_KINDS = (("all_reduce",), ("all_gather", "reduce_scatter"))


def _step_terms(profile: dict, rounds: int = 15, steps: int = 10) -> dict:
    """``profile`` with what compiled training steps show: its ``step_seconds`` and the
    latencies of :data:`STEP_KINDS` (each family one, in ``collectives`` and, for the
    all-reduce, ``intra_node``/``inter_node``), fitted to steps timed here.

    Three programs of one small model (:data:`STEP_MODEL`: Linear layers, SGD) are
    timed, each round all, one after the other (paired: the machine's drift between
    rounds hits all): data parallel (the batch split; one gradient all-reduce, the
    update's), tensor parallel (the layers column- then row-split in turns; an
    all-reduce per pair forward and backward) and ZeRO-3 (every parameter sharded:
    all-gathers and reduce-scatters); 1 rank: data parallel alone. Each one's time is
    the median over ``rounds`` of ``steps`` steps, averaged over the ranks (every rank
    calls this, in step). :func:`sbpflow.planner.predict.predict_step` is linear in the
    step term and in each family's latency on these CPU programs (nothing hidden: the
    ranks fill the cores; on a spare core a prefetched gather's latency could hide, and
    the fit would take it as charged), so its total is ``base + step_seconds +
    sum(k_f x latency_f)``, ``k_f`` read off by pricing each program with that latency 1 s.
    The terms are fitted to the programs' times by least squares, each at least 0
    (:func:`_nonnegative_fit`). With the collective check on, as a job runs.

    Why: on this 2-core machine a small collective takes 0.3 to 2.7 ms back to back or
    after a little compute, differently each time it is measured (latency fits of one
    kind 0.2-1.8 ms across calibrations minutes apart), where compiled steps of many
    collectives run steadily (tensor parallel 12.8-15.6 ms, ZeRO-3 39.6-43.3 ms over six
    runs), and the per-kind fits of one calibration priced them 0.3-0.8 ms a collective
    off, either way."""
    import dataclasses

    import torch

    from .. import distributed as sd
    from .. import nn, optim
    from ..distributed import _state
    from ..nn.parallel.style import ColwiseParallel, RowwiseParallel, parallelize_module
    from ..ops.creation import randn
    from ..placement import placement
    from ..sbp import broadcast, split
    from .hardware import Link, _from_dict
    from .predict import predict_step

    width, depth = STEP_MODEL
    world = sd.get_world_size()
    width = -(-width // world) * world  # (tensor parallel splits it over the ranks)
    pl = placement.all("cpu")

    def program(layout: str):
        with torch.random.fork_rng(devices=[]):  # a job calibrating mid-run keeps its draws
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
            if layout == "tp":
                model = parallelize_module(model, pl, {
                    str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                    for i in range(depth)})
            else:
                model = model.to_global(pl, broadcast)
            x = randn(width * world, width, placement=pl,
                      sbp=broadcast if layout == "tp" else split(0))
        opt = optim.SGD(model.parameters(), lr=1e-3)

        # nn.Graph: installed by the sbpflow package above this layer (graph.graph runs
        # this module at a graph's first call, so it is not imported from here)
        class Step(nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                if layout == "zero3":  # (every parameter sharded: none is too small)
                    self.config.enable_zero(True, stage=3, shard_min_size=1)

            def build(self, x):
                loss = self.model(x).square().mean()
                loss.backward()
                return loss
        return Step(), x, opt

    saved = _state._ensure().config.check
    _state.set_check("fast")
    try:
        programs = [program(k) for k in (("dp", "tp", "zero3") if world > 1 else ("dp",))]
        for step, x, _ in programs:
            for _ in range(3):
                step(x)
        times: list[list[float]] = [[] for _ in programs]
        for _ in range(rounds):
            for (step, x, _), ts in zip(programs, times):
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(x)
                ts.append((time.perf_counter() - t0) / steps)
        families = STEP_KINDS if world > 1 else ()
        hw = _from_dict(dict(profile, step_seconds=0.0))  # (the term being fitted)

        def latencies(values):  # hw with each family's latency set
            kinds = dict(hw.collectives)
            for fam, lat in zip(families, values):
                for k in fam:
                    kinds[k] = Link(kinds[k].bandwidth, lat)
            ar = kinds.get("all_reduce", hw.intra_node)
            return dataclasses.replace(hw, collectives=kinds,
                                       intra_node=Link(hw.intra_node.bandwidth, ar.latency),
                                       inter_node=Link(hw.inter_node.bandwidth, ar.latency))
        rows, base = [], []
        for step, x, opt in programs:
            lg = step.lower(x)
            b = predict_step(lg, latencies([0.0] * len(families)), optimizer=opt)["total"]
            base.append(b)
            rows.append([1.0] + [
                predict_step(lg, latencies([float(i == j) for j in range(len(families))]),
                             optimizer=opt)["total"] - b for i in range(len(families))])
    finally:
        _state.set_check(saved)
    mine = torch.tensor([statistics.median(ts) - b for ts, b in zip(times, base)],
                        dtype=torch.float64)
    if world > 1:
        from sbpflow.distributed import _comm

        mine = _comm.all_reduce(mine, list(range(world))) / world
    terms = _nonnegative_fit(rows, mine.tolist())
    out = dict(profile, step_seconds=terms[0])
    if families:
        out["sources"] = profile["sources"] + "; the latencies of " + " and ".join(
            "/".join(f) for f in families) + " and step_seconds fitted to compiled steps (" + \
            ", ".join(f"{k} {statistics.median(ts) * 1e3:.2f} ms" for k, ts in
                      zip(("data parallel", "tensor parallel", "ZeRO-3"), times)) + ")"
        fitted = latencies(terms[1:])
        out["collectives"] = {k: {"bandwidth": v.bandwidth, "latency": v.latency}
                              for k, v in fitted.collectives.items()}
        for k in ("intra_node", "inter_node"):
            out[k] = {"bandwidth": profile[k]["bandwidth"],
                      "latency": getattr(fitted, k).latency}
    return out


def _nonnegative_fit(rows: list, ys: list) -> list:
    """``x >= 0`` minimising ``sum((rows x - ys)^2)`` (a few unknowns: every subset of
    them held at 0 is tried, the best feasible least-squares solution kept)."""
    import itertools

    import torch

    a, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    n = a.shape[1]
    best, err = [0.0] * n, float((y ** 2).sum())
    for r in range(1, n + 1):
        for free in itertools.combinations(range(n), r):
            sol = torch.linalg.lstsq(a[:, list(free)], y.unsqueeze(1)).solution.squeeze(1)
            if (sol < 0).any():
                continue
            x = [0.0] * n
            for i, v in zip(free, sol.tolist()):
                x[i] = v
            e = float(((a @ torch.tensor(x, dtype=torch.float64) - y) ** 2).sum())
            if e < err - 1e-18:
                best, err = x, e
    return best


def _write(profile: dict, out: str, replace: bool) -> bool:
    """Write ``profile`` to ``out`` (its folder made); an existing file is kept unless
    ``replace``. Returns whether it wrote."""
    from .hardware import write_json_object

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return write_json_object(out, profile, replace)


def profile_here():
    """This machine's profile for the running job's world size, from within the job
    (every rank calls it): the cached calibration (``sbpflow calibrate``'s, else its
    ``--quick`` one), or, when neither exists, a ``--quick`` measurement now (a few
    seconds; rank 0 caches it). Returns a :class:`sbpflow.planner.hardware.Hardware`.
    What automatic parallelism prices layouts on by default."""
    import torch

    from sbpflow import distributed as sd

    from .hardware import ProfileError, _from_dict

    world = sd.get_world_size()
    for quick in (False, True):
        if os.path.isfile(cache_path(world, quick)):
            try:
                return load_cached(cache_path(world, quick), world)
            except ProfileError as e:
                raise ProfileError(
                    f"{e}; fix or delete this machine's cached calibration (`sbpflow "
                    f"calibrate --nproc-per-node {world} --force` measures it again)") from None
    threads = torch.get_num_threads()
    try:
        profile = _profile(_agreed(_measure(True)), True)
        profile = _step_terms(profile, rounds=WAIT_ROUNDS_QUICK)
    finally:
        torch.set_num_threads(threads)
    if sd.get_rank() == 0:
        try:
            _write(profile, cache_path(world, True), replace=False)
        except OSError:
            pass  # a cache we cannot write: measured again next time
    return _from_dict(profile)


def _rank_main(argv: list[str]) -> int:
    """A rank of the calibration job: measure; rank 0 writes."""
    from sbpflow import distributed as sd

    args = build_parser().parse_args(argv)
    sd.init()
    m = _agreed(_measure(args.quick))
    profile = _profile(m, args.quick)
    profile = _step_terms(profile, rounds=WAIT_ROUNDS_QUICK if args.quick else WAIT_ROUNDS)
    if sd.get_rank() != 0:
        return 0
    out = args.out or cache_path(m["world"], args.quick)
    _write(profile, out, replace=True)  # main() refused an existing one without --force
    world = m["world"]
    link = ("; ".join(f"{k} latency {v['latency'] * 1e6:.0f} us per step, bandwidth "
                      f"{v['bandwidth'] / 1e9:.2f} GB/s"
                      for k, v in profile["collectives"].items())
            if world > 1 else "no link measured (1 rank)")
    wait = ", ".join(f"{w * 1e6:.0f} us after {g * 1e3:.1f} ms" for g, w in m["wait"])
    print(f"sbpflow calibrate: {world} rank(s): matmul {m['flops'] / 1e9:.1f} GFLOP/s per "
          f"rank, memory {m['bandwidth'] / 1e9:.1f} GB/s, {link}"
          f"{'; each collective waits for the last rank ' + wait if wait else ''}; a "
          f"compiled step {profile['step_seconds'] * 1e6:.0f} us beyond the rest (the "
          f"step term and the all_reduce, all_gather and reduce_scatter latencies fitted "
          f"to compiled steps); wrote {out}")
    return 0


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def main(argv=None, prog: str = "sbpflow calibrate") -> int:
    """Check the arguments, then run the ranks (or, under a launcher, be one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: give at least 1")
    if args.out == "":
        parser.error("--out '': give a file name (or leave --out out: this machine's cache)")
    out = args.out or cache_path(args.nproc_per_node, args.quick)
    from .hardware import ProfileError, unwritable

    if os.path.isfile(out) and not os.path.islink(out) and not args.force:
        if args.out:
            parser.error(f"{out} exists; give --force to measure again and replace it")
        try:
            load_cached(out, args.nproc_per_node)
        except ProfileError as e:
            print(f"sbpflow calibrate: error: the cached profile cannot be used: {e}; "
                  f"--force measures again and replaces it", file=sys.stderr)
            return 2
        print(f"sbpflow calibrate: cached profile {out} (--force measures again)")
        return 0
    why = unwritable(out)  # before measuring (the ranks take seconds to minutes)
    if why:
        fix = "give --out a file in a folder you can write" if args.out else \
            "set SBPFLOW_CACHE to a folder you can write (or measure into a file with " \
            "`sbpflow calibrate --out FILE` and plan with --hardware FILE)"
        parser.error(f"{'--out ' if args.out else 'the cache file '}{out}: cannot write it "
                     f"({why}); {fix}")
    if args.nproc_per_node == 1:
        os.environ.setdefault("SBPFLOW_CHECK", "off")
        return _single(argv)
    from sbpflow.distributed import launch

    return launch.main(["--standalone", "--nproc-per-node", str(args.nproc_per_node),
                        "--threads-per-rank", "1", "-m", "sbpflow.planner.calibrate", *argv],
                       env={"SBPFLOW_CHECK": "off"})


def _single(argv: list[str]) -> int:
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
    try:
        return _rank_main(argv)
    finally:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)


if __name__ == "__main__":
    sys.exit(main())
