"""The pipeline's actors: which task each stage runs when, decided by registers.

Each pipeline stage ``s`` has two actors: ``F(s)`` runs the stage's forward of one
micro-batch, ``B(s)`` its backward. An actor fires when its inputs are ready and, for a
forward, when a free output register exists (ARCHITECTURE "Runtime: actors and
pipelines"):

* ``F(s)`` of micro-batch ``k`` needs the activation of ``F(s-1)`` for ``k`` (stage 0:
  the data) and one of its ``registers(s)`` output registers; the register holds what
  backward needs (the saved activations) until ``B(s)`` of ``k`` frees it;
* ``B(s)`` of ``k`` needs ``F(s)`` of ``k`` and the gradient from ``B(s+1)`` of ``k``
  (the last stage: its own forward, whose loss starts backward).

Micro-batches go through each actor in order. A rank runs one task at a time; when both
of its actors could fire, the schedule's priority decides. The schedules are the register
counts and that priority, nothing else:

* ``"1f1b"``: ``registers(s) = stages - s``, backward first. Stage ``s`` runs
  ``stages - s`` forwards, then alternates one backward and one forward, and holds at most
  ``stages - s`` micro-batches' activations (PipeDream-Flush, Narayanan et al. 2021);
* ``"gpipe"``: ``registers(s) = micro_batches``, forward first: every forward, then
  every backward (Huang et al. 2019); activations of all micro-batches are live at once;
* ``"interleaved"``: ``virtual_stages = v`` model chunks per rank (stage ``s`` of the
  ``v * ranks`` on rank ``s % ranks``). A rank's forwards take micro-batches in groups of
  ``ranks``, each group through the rank's chunks in turn (backwards: the last chunk
  first); its ``2 (ranks - r - 1) + (v - 1) ranks + 1`` registers are shared by its
  chunks, and a forward fires first when it can. This is the order of Narayanan et al.
  2021 (section 2.2), which lowers the bubble to ``(ranks - 1) / (v m)``.

The order is computed once, here, by running these rules on a model of the step
(forward 1 time unit, backward 2, transfers free), rather than decided by arrival times at
run time: every rank of a stage (its data- and tensor-parallel ranks) must issue its
collectives in one order, and arrival times differ between them. The plan each rank then
runs is the order its actors fired in.

:mod:`sbpflow.runtime.schedules` writes the same schedules as data (one generator each,
Megatron's closed-form orders, with the sends and receives and a simulator), and adds
zero-bubble; ``nn.Graph`` runs those lists (``schedules.build``), not :func:`plan`. Its orders
equal :func:`plan`'s for ``p <= 4`` ranks, but this module's timing model makes a
different (equally long) interleaved order from 5 ranks on (e.g. ``p = 5, m = 10,
v = 2``: rank 0's next forward's input has not arrived, so it runs the next backward
first), and its interleaved order depends on ``forward_time / backward_time``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Task", "bubble_fraction", "plan", "registers"]

SCHEDULES = ("1f1b", "interleaved", "gpipe")


@dataclass(frozen=True, order=True)
class Task:
    """One firing of an actor: ``kind`` ``"F"`` or ``"B"`` of ``stage`` (a virtual stage
    with interleaving) on micro-batch ``micro_batch``."""

    kind: str
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


def registers(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Output registers of ``F(stage)``: how many micro-batches' activations the stage may
    hold between its forward and its backward."""
    if schedule == "gpipe":
        return micro_batches
    return min(stages - stage, micro_batches)


def _check(schedule: str, ranks: int, micro_batches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    if ranks < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pipeline: ranks ({ranks}), micro-batches ({micro_batches}) and "
                         f"virtual stages ({virtual_stages}) must be >= 1")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule, "
                         f"got {schedule!r}")
    if schedule == "interleaved" and micro_batches % ranks:
        raise ValueError(f"the interleaved schedule needs micro-batches ({micro_batches}) to "
                         f"be a multiple of the pipeline ranks ({ranks}): micro-batches enter "
                         f"in groups of {ranks}; set_gradient_accumulation_steps("
                         f"{(micro_batches // ranks + 1) * ranks})")


def plan(schedule: str, ranks: int, micro_batches: int, virtual_stages: int = 1,
         forward_time: float = 1.0, backward_time: float = 2.0) -> list[list[Task]]:
    """Each pipeline rank's tasks in the order its actors fire.

    Args:
        schedule: one of :data:`SCHEDULES`.
        ranks: pipeline ranks ``p`` (stages per model copy, without virtual stages).
        micro_batches: ``m``.
        virtual_stages: model chunks per rank ``v`` (``"interleaved"`` only); stage
            ``s`` of the ``v * p`` runs on rank ``s % p``.
        forward_time, backward_time: the model's task durations (any units).

    Returns:
        ``plan[r]``: rank ``r``'s tasks, ``2 * v * m`` of them. Run with the given
        durations (a chunk's taking ``1/v`` of a stage's), the plans give the theory's
        bubble (:func:`bubble_fraction`) for every schedule (tests/test_runtime.py).

    Raises:
        ValueError: an unknown schedule, counts < 1, ``virtual_stages > 1`` without the
            interleaved schedule, or an interleaved ``m`` not a multiple of ``p``.
    """
    _check(schedule, ranks, micro_batches, virtual_stages)
    n = ranks * virtual_stages
    m = micro_batches
    regs = [registers(schedule, s, n, m) for s in range(n)]
    next_f, next_b = [0] * n, [0] * n
    held = [0] * n  # registers in use
    f_done: set[tuple[int, int]] = set()  # (stage, micro-batch) whose forward finished
    b_done: set[tuple[int, int]] = set()
    busy_until = [0.0] * ranks
    order: list[list[Task]] = [[] for _ in range(ranks)]
    events: list[tuple[float, int, int, Task]] = []  # (finish time, seq, rank, task)
    seq = 0
    now = 0.0
    remaining = 2 * n * m

    if schedule == "interleaved":  # per rank: one order of forwards, one of backwards
        f_seq = [_chunk_order(r, ranks, m, virtual_stages, forward=True) for r in range(ranks)]
        b_seq = [_chunk_order(r, ranks, m, virtual_stages, forward=False)
                 for r in range(ranks)]
        pos_f, pos_b = [0] * ranks, [0] * ranks
        rank_regs = [min((ranks - r - 1) * 2 + (virtual_stages - 1) * ranks + 1, n * m)
                     for r in range(ranks)]
        rank_held = [0] * ranks

    def ready(r: int) -> list[Task]:
        out = []
        if schedule == "interleaved":
            if pos_b[r] < len(b_seq[r]):
                s, k = b_seq[r][pos_b[r]]
                if (s, k) in f_done and (s == n - 1 or (s + 1, k) in b_done):
                    out.append(Task("B", s, k))
            if pos_f[r] < len(f_seq[r]) and rank_held[r] < rank_regs[r]:
                s, k = f_seq[r][pos_f[r]]
                if s == 0 or (s - 1, k) in f_done:
                    out.append(Task("F", s, k))
            return out
        for s in range(r, n, ranks):
            k = next_b[s]
            if k < m and (s, k) in f_done and (s == n - 1 or (s + 1, k) in b_done):
                out.append(Task("B", s, k))
            k = next_f[s]
            if k < m and held[s] < regs[s] and (s == 0 or (s - 1, k) in f_done):
                out.append(Task("F", s, k))
        return out

    def pick(cands: list[Task]) -> Task:
        if schedule in ("gpipe", "interleaved"):  # forward first
            return min(cands, key=lambda t: (t.kind != "F", t.micro_batch, t.stage))
        # backward first (frees a register); among forwards, the lower micro-batch, then
        # the earlier chunk; among backwards the later chunk (its gradient arrived first)
        return min(cands, key=lambda t: (t.kind != "B", t.micro_batch,
                                         -t.stage if t.kind == "B" else t.stage))

    while remaining:
        for r in range(ranks):
            if busy_until[r] <= now:
                cands = ready(r)
                if cands:
                    t = pick(cands)
                    if t.kind == "F":
                        next_f[t.stage] += 1
                        held[t.stage] += 1
                        if schedule == "interleaved":
                            pos_f[r] += 1
                            rank_held[r] += 1
                    else:
                        next_b[t.stage] += 1
                        if schedule == "interleaved":
                            pos_b[r] += 1
                    dur = forward_time if t.kind == "F" else backward_time
                    busy_until[r] = now + dur
                    order[r].append(t)
                    heapq.heappush(events, (now + dur, seq, r, t))
                    seq += 1
        if not events:
            raise RuntimeError(f"pipeline plan deadlocked: {schedule}, {ranks} ranks, {m} "
                               f"micro-batches, {virtual_stages} virtual stages (a bug)")
        now, _, r, t = heapq.heappop(events)
        finished = [(r, t)]
        while events and events[0][0] == now:
            _, _, r2, t2 = heapq.heappop(events)
            finished.append((r2, t2))
        for _, t in finished:
            remaining -= 1
            if t.kind == "F":
                f_done.add((t.stage, t.micro_batch))
            else:
                b_done.add((t.stage, t.micro_batch))
                held[t.stage] -= 1
                if schedule == "interleaved":
                    rank_held[t.stage % ranks] -= 1
    return order


def _chunk_order(rank: int, ranks: int, m: int, v: int, forward: bool
                 ) -> list[tuple[int, int]]:
    """Interleaved: rank ``rank``'s (stage, micro-batch) order of forwards (or
    backwards): micro-batches in groups of ``ranks``, each group through the rank's chunks
    in turn (forward: chunk 0 first; backward: the last chunk first), as Narayanan et al.
    2021 (section 2.2) order them."""
    chunks = range(v) if forward else range(v - 1, -1, -1)
    return [(c * ranks + rank, k) for g in range(0, m, ranks) for c in chunks
            for k in range(g, min(g + ranks, m))]


def bubble_fraction(schedule: str, ranks: int, micro_batches: int,
                    virtual_stages: int = 1) -> float:
    """The theory's bubble: a rank's idle time over its compute time in one step,
    ``(p - 1) / m`` for 1F1B and GPipe and ``(p - 1) / (v m)`` interleaved (Narayanan et
    al. 2021, section 2.2; the idle share of the whole step is then
    ``b / (1 + b)``)."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (ranks - 1) / (v * micro_batches)
