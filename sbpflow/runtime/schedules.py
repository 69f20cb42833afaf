"""Pipeline schedules as data: per rank a list of actions, and a simulator that checks them.

A schedule is one small generator ``(ranks, micro_batches, virtual_stages) -> per rank
the compute order`` (``F``, ``B``, ``W`` actions) and an entry in :data:`SCHEDULES`;
:func:`build` validates the counts, runs the generator and inserts the communication
(``SEND_*`` / ``RECV_*``) and the ``UPDATE``; :func:`simulate` runs the lists with
durations, checks every send has its receive and every input its producer, reports a
deadlock naming the stuck ranks, and returns a :class:`Timeline` (makespan, idle time,
bubble, activations in flight) that prints as a table. The vocabulary follows
``torch.distributed.pipelining``'s ``_Action`` (there ``I`` is the input-gradient
backward that zero-bubble calls ``B`` here, and ``B`` the full backward).

Stages: ``n = virtual_stages * ranks`` stages, stage ``s`` on rank ``s % ranks``; with
one virtual stage, stage ``r`` is rank ``r``. Micro-batches ``0 .. m-1``.

Communication placement (:func:`build`): each ``RECV`` sits immediately before the action
that consumes it and each ``SEND`` immediately after the action that produced it, so a
rank blocks on a receive only when it needs the data. A later step may post receives
earlier (to overlap the transfer with compute); the simulator accepts any order that does
not deadlock.

The compute orders of ``"1f1b"``, ``"gpipe"`` and ``"interleaved"`` equal
:func:`sbpflow.runtime.actors.plan`'s (which decides them by registers on a timing model)
for ``p <= 4``, ``m <= 8``, ``v <= 2`` (tests/test_schedules.py); see that module for why
its greedy order can differ for larger interleaved pipelines.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["COMM", "COMPUTE", "KINDS", "SCHEDULES", "Action", "ScheduleError", "Timeline",
           "build", "gpipe", "interleaved", "one_f_one_b", "simulate", "zero_bubble"]

# The closed vocabulary. F: forward; B: backward (with zero-bubble the input gradient only,
# otherwise the full backward); W: the weight gradient (zero-bubble only); SEND_F/RECV_F: a
# stage's output activation to/from the next stage's rank; SEND_B/RECV_B: the input
# gradient to/from the previous stage's rank; UPDATE: the optimizer step, last on a rank.
COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM + ("UPDATE",)


class ScheduleError(ValueError):
    """A schedule that cannot run: an unmatched send or receive, a missing or repeated
    task, or a deadlock (raised by :func:`simulate`)."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` (one of :data:`KINDS`) of ``stage`` on
    ``micro_batch``; ``peer`` is the other rank of a send or receive. ``stage`` is always
    a stage of the acting rank: ``SEND_F3@1->r2`` sends stage 1's output of micro-batch 3
    to rank 2, where ``RECV_F3@2<-r1`` receives it for stage 2. ``UPDATE`` has no stage
    or micro-batch."""

    kind: str
    stage: int | None
    micro_batch: int | None
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind == "UPDATE":
            return "UPDATE"
        s = f"{self.kind}{self.micro_batch}@{self.stage}"
        if self.peer is None:
            return s
        return s + (f"->r{self.peer}" if self.kind.startswith("SEND") else f"<-r{self.peer}")


# ---------------------------------------------------------------------------------------
# The generators: (ranks p, micro_batches m, virtual_stages v) -> per rank its F/B/W order.
# Each raises ValueError for the counts it cannot schedule; build() checks the rest.

def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward (full backward), in
    micro-batch order. Every rank holds all ``m`` micro-batches' activations; the bubble
    is ``(p - 1) / m`` of the compute time."""
    _one_chunk("gpipe", v)
    return [[Action("F", r, k) for k in range(m)] + [Action("B", r, k) for k in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021), Megatron's order: rank ``r`` runs
    ``p - r - 1`` warm-up forwards, then alternates one forward and one (full) backward,
    then the remaining backwards. At most ``min(p - r, m)`` micro-batches in flight on
    rank ``r``; the bubble is GPipe's, ``(p - 1) / m``."""
    _one_chunk("1f1b", v)
    return [_warmup_then_alternate([Action("F", r, k) for k in range(m)],
                                   [Action("B", r, k) for k in range(m)], p - r - 1)
            for r in range(p)]


def interleaved(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2), Megatron's order: ``v``
    model chunks per rank (stage ``s`` of the ``v p`` on rank ``s % p``); micro-batches
    in groups of ``p``, each group through the rank's chunks in turn (backward: the last
    chunk first); ``2 (p - r - 1) + (v - 1) p`` warm-up forwards, then one forward and one
    backward alternately. The bubble is ``(p - 1) / (v m)`` of the compute time. With
    ``v = 1`` this is not 1F1B: twice the warm-up, so up to ``2 (p - r - 1) + 1``
    micro-batches in flight on rank ``r`` (Megatron's interleaved code does the same).

    Raises:
        ValueError: ``m`` not a multiple of ``p``.
    """
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) to be a "
                         f"multiple of the pipeline ranks ({p}): micro-batches enter in "
                         f"groups of {p}; set_gradient_accumulation_steps({(m // p + 1) * p})")

    def chunk_order(kind: str, r: int) -> list[Action]:
        chunks = range(v) if kind == "F" else range(v - 1, -1, -1)
        return [Action(kind, c * p + r, k) for g in range(0, m, p) for c in chunks
                for k in range(g, g + p)]

    return [_warmup_then_alternate(chunk_order("F", r), chunk_order("B", r),
                                   2 * (p - r - 1) + (v - 1) * p) for r in range(p)]


def zero_bubble(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1 and
    Figure 3 top): the backward split into ``B`` (input gradient, on the critical path)
    and ``W`` (weight gradient, any time after its ``B``). Rank ``r`` runs, for
    ``x = 0 .. m + p - 2``, the triple ``F(x), B(x - (p - 1 - r)), W(x - (p - 1))``
    (each where its micro-batch is in ``0 .. m-1``): 1F1B's forwards and input-gradient
    backwards, with the ``W``'s delayed by ``r`` more micro-batches than the ``B``'s,
    which fill the cool-down's bubbles. Activations in flight: ``min(p - r, m)`` as
    1F1B (counting to the ``B``; a ``W`` keeps only its weights' inputs, less memory,
    paper's Table 1). Idle time per rank ``(p - 1)(T_F + T_B - T_W)`` against 1F1B's
    ``(p - 1)(T_F + T_B + T_W)`` (paper, section 2.1 and Table 2), a third with equal
    times: a bubble of ``(p - 1) / (3 m)``. The simulator gives exactly that for
    ``m >= p`` and ``T_W <= T_F`` (tests/test_schedules.py); with fewer micro-batches than
    ranks the idle time is larger (at ``m = 1``, ``(p - 1)(T_F + T_B)``), still below
    1F1B's.

    Raises:
        ValueError: ``v > 1`` (the V-shaped ZB-V of the paper's later version is not built).
    """
    if v != 1:
        raise ValueError(f"zero_bubble with virtual_stages={v}: only ZB-H1 (one stage per "
                         f"rank) is built, the V-shaped ZB-V is not; use virtual_stages=1")
    out = []
    for r in range(p):
        order = []
        for x in range(m + p - 1):
            for kind, k in (("F", x), ("B", x - (p - 1 - r)), ("W", x - (p - 1))):
                if 0 <= k < m:
                    order.append(Action(kind, r, k))
        out.append(order)
    return out


def _one_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ValueError(f"virtual_stages={v} needs the 'interleaved' schedule, got {name!r}")


def _warmup_then_alternate(forwards: list[Action], backwards: list[Action], warmup: int
                           ) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest."""
    w = min(warmup, len(forwards))
    out = forwards[:w]
    for f, b in zip(forwards[w:], backwards):
        out += [f, b]
    return out + backwards[len(forwards) - w:]


Generator = Callable[[int, int, int], list[list[Action]]]
SCHEDULES: dict[str, Generator] = {"1f1b": one_f_one_b, "gpipe": gpipe,
                                   "interleaved": interleaved, "zero_bubble": zero_bubble}


def build(schedule: str, ranks: int, micro_batches: int, virtual_stages: int = 1
          ) -> list[list[Action]]:
    """Every pipeline rank's actions for one step: the schedule's compute order with the
    sends and receives, and ``UPDATE`` last.

    After ``F`` of stage ``s`` on micro-batch ``k`` comes ``SEND_F`` to the rank of
    ``s + 1`` (when that stage exists and is on another rank), before it ``RECV_F`` from
    the rank of ``s - 1``; a ``B`` likewise receives (``RECV_B``) the gradient from the
    rank of ``s + 1`` and sends (``SEND_B``) its own to the rank of ``s - 1``. Consecutive
    stages on one rank (``ranks == 1``) exchange nothing.

    Args:
        schedule: a key of :data:`SCHEDULES`.
        ranks: pipeline ranks ``p``; micro_batches: ``m``; virtual_stages: ``v`` stages
            per rank (``"interleaved"`` only), stage ``s`` of the ``v p`` on rank ``s % p``.

    Returns:
        ``actions[r]``: rank ``r``'s list of :class:`Action`.

    Raises:
        ValueError: an unknown schedule (names the known ones), a count < 1 or not an
            integer, or counts the schedule cannot run (``virtual_stages > 1`` except
            interleaved; interleaved ``m`` not a multiple of ``p``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, "
                         f"got {schedule!r}")
    counts = {"ranks": ranks, "micro_batches": micro_batches, "virtual_stages": virtual_stages}
    bad = {k: c for k, c in counts.items()
           if isinstance(c, bool) or not isinstance(c, int) or c < 1}
    if bad:
        raise ValueError(f"pipeline schedule {schedule!r}: {bad} must be integers >= 1 "
                         f"(got {counts})")
    n = ranks * virtual_stages
    out = []
    for r, order in enumerate(SCHEDULES[schedule](ranks, micro_batches, virtual_stages)):
        acts = []
        for a in order:
            if a.kind == "W":  # needs only its B, on this rank
                acts.append(a)
                continue
            s, k, x = a.stage, a.micro_batch, a.kind  # x: "F" or "B"
            # F takes stage s - 1's output and feeds s + 1; B the other way round
            src, dst = (s - 1, s + 1) if x == "F" else (s + 1, s - 1)
            if 0 <= src < n and src % ranks != r:
                acts.append(Action("RECV_" + x, s, k, src % ranks))
            acts.append(a)
            if 0 <= dst < n and dst % ranks != r:
                acts.append(Action("SEND_" + x, s, k, dst % ranks))
        out.append(acts + [Action("UPDATE", None, None)])
    return out


# ---------------------------------------------------------------------------------------
# The simulator.

@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` measured; times in the caller's units.

    Attributes:
        intervals: per rank, ``(start, end, action)`` in the rank's order (a ``RECV``'s
            interval is its wait; sends and the update take no time).
        makespan: the last action's end.
        busy: per rank, the time spent in ``F``/``B``/``W``.
        idle: per rank, ``makespan - busy``.
        peak_in_flight: per rank, the most micro-batches whose forward ran and backward
            (``B``) did not yet, summed over the rank's stages.
    """

    intervals: list[list[tuple[float, float, Action]]]
    makespan: float
    busy: list[float]
    idle: list[float]
    peak_in_flight: list[int]

    @property
    def bubbles(self) -> list[float]:
        """Per rank, idle time over compute time (Narayanan et al. 2021's bubble; the
        idle share of the step is ``b / (1 + b)``)."""
        return [i / b if b else (0.0 if not i else math.inf)
                for i, b in zip(self.idle, self.busy)]

    @property
    def bubble(self) -> float:
        """The worst rank's bubble."""
        return max(self.bubbles)

    def table(self, unit: float | None = None) -> str:
        """The timeline as text: a row per rank, a column per ``unit`` of time (default:
        the shortest compute action), each compute action's label (``F3``; ``F3@5``
        where a rank runs several stages) in its first column, ``-`` where it continues,
        ``.`` where the rank idles (times rounded to a column; a smaller ``unit`` shows
        them finer); then each rank's busy, idle, bubble and peak."""
        spans = [[(s, e, a) for s, e, a in row if a.kind in COMPUTE] for row in self.intervals]
        unit = unit or min((e - s for row in spans for s, e, _ in row if e > s), default=1.0)
        cols = max(1, math.ceil(self.makespan / unit - 1e-9))
        many = [len({a.stage for _, _, a in row}) > 1 for row in spans]
        label = [[f"{a.kind}{a.micro_batch}" + (f"@{a.stage}" if many[r] else "")
                  for _, _, a in row] for r, row in enumerate(spans)]
        w = max([len(x) for row in label for x in row] + [len(f"{(cols - 1) * unit:g}")])
        lines = [f"{'time':>7} " + " ".join(f"{c * unit:<{w}g}" for c in range(cols))]
        for r, row in enumerate(spans):
            cells, free = ["."] * cols, 0  # free: the first column after the last action
            for (s, e, _), text in zip(row, label[r]):
                c0 = max(math.floor(s / unit + 0.5), free)  # rounded, never overlapping
                free = max(c0 + 1, math.floor(e / unit + 0.5))
                cells[c0:free] = [text] + ["-" * w] * (free - c0 - 1)
            lines.append(f"{'rank ' + str(r):>7} " + " ".join(f"{c:<{w}}" for c in cells))
        lines.append(f"makespan {self.makespan:g}; bubble (idle / compute) {self.bubble:.3f} "
                     f"on the worst rank")
        lines += [f"  rank {r}: busy {b:g}, idle {i:g}, bubble {x:.3f}, peak {pk} "
                  f"micro-batches in flight" for r, (b, i, x, pk) in
                  enumerate(zip(self.busy, self.idle, self.bubbles, self.peak_in_flight))]
        return "\n".join(lines)

    __str__ = table


Durations = float | Sequence[float]


def simulate(actions: Sequence[Sequence[Action]], forward: Durations = 1.0,
             backward: Durations = 1.0, weight: Durations = 1.0,
             transfer: Durations = 0.0) -> Timeline:
    """Run every rank's actions in order and time them.

    Each action starts when its rank finished the previous one and its inputs are there
    (nothing else is shared, so the times are the longest paths through these
    dependencies, computed rank by rank as the inputs become known):
    ``F`` of stage ``s`` needs the forward of ``s - 1`` (through a ``RECV_F`` when on
    another rank); ``B`` needs its own forward and the backward of ``s + 1`` (through a
    ``RECV_B``); ``W`` its ``B``; a ``SEND`` its producer; a ``RECV`` blocks until the
    matching ``SEND`` was posted plus ``transfer``. Sends are asynchronous (they take no
    time on the sender), as is ``UPDATE`` (it is last, after all of the rank's work).

    Args:
        actions: per rank its list, e.g. from :func:`build`.
        forward, backward, weight: durations of ``F``, ``B`` and ``W`` (any time unit),
            one for every stage or a sequence of one per stage (``forward[s]``: stage
            ``s``'s forward of one micro-batch). A ``B`` whose stage and micro-batch have
            no ``W`` in the plan is the full backward and takes ``backward + weight``.
        transfer: time from a send's post to the data's arrival: one for every send, or
            one per stage boundary (``transfer[s]``: between stages ``s`` and ``s + 1``,
            either way).

    Returns:
        a :class:`Timeline`.

    Raises:
        ScheduleError: a task missing or repeated, a stage's tasks on several ranks, a
            send or receive without its match (or to the wrong rank), a cross-rank input
            without its receive, ``UPDATE`` not once and last per rank, or a deadlock (no
            rank can progress while some have actions left: each stuck rank's next action
            and what it waits for are named).
        ValueError: durations that are not a number or a sequence of one per stage
            (``transfer``: per boundary), or not finite and >= 0.
    """
    acts = [list(row) for row in actions]
    owner = _check_plan(acts)  # stage -> rank
    n = len(owner)
    fwd, bwd, wgt = (_per(x, n, name) for x, name in ((forward, "forward"),
                                                      (backward, "backward"),
                                                      (weight, "weight")))
    hop = _per(transfer, max(n - 1, 1), "transfer")
    has_w = {(a.stage, a.micro_batch) for row in acts for a in row if a.kind == "W"}
    key_at = {(a.kind, a.stage, a.micro_batch): (r, i)
              for r, row in enumerate(acts) for i, a in enumerate(row) if a.kind != "UPDATE"}

    def inputs(a: Action, r: int) -> list[tuple[str, int, int]]:
        """The actions (kind, stage, micro-batch) that ``a`` on rank ``r`` waits for."""
        s, k = a.stage, a.micro_batch
        if a.kind == "UPDATE":  # last on its rank: after all of the rank's work
            return []
        if a.kind == "F":
            return [] if s == 0 else [("F", s - 1, k) if owner[s - 1] == r else ("RECV_F", s, k)]
        if a.kind == "B":
            return [("F", s, k)] + ([] if s == n - 1 else
                                    [("B", s + 1, k) if owner[s + 1] == r else ("RECV_B", s, k)])
        return {"W": [("B", s, k)], "SEND_F": [("F", s, k)], "SEND_B": [("B", s, k)],
                "RECV_F": [("SEND_F", s - 1, k)], "RECV_B": [("SEND_B", s + 1, k)]}[a.kind]

    def duration(a: Action) -> float:
        s = a.stage
        if a.kind == "B" and (s, a.micro_batch) not in has_w:  # the full backward
            return bwd[s] + wgt[s]
        return {"F": fwd, "B": bwd, "W": wgt}[a.kind][s] if a.kind in COMPUTE else 0.0

    done: dict[tuple[str, int, int], float] = {}  # action -> its end (a send: its post)
    clock = [0.0] * len(acts)
    pos = [0] * len(acts)
    intervals: list[list[tuple[float, float, Action]]] = [[] for _ in acts]
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(acts):
            while pos[r] < len(row):
                a = row[pos[r]]
                deps = inputs(a, r)
                if any(d not in done for d in deps):
                    break
                if a.kind.startswith("RECV"):  # its interval is the wait for the data
                    start = clock[r]
                    b = a.stage - 1 if a.kind == "RECV_F" else a.stage  # the boundary
                    end = max([start] + [done[d] + hop[b] for d in deps])
                else:
                    start = max([clock[r]] + [done[d] for d in deps])
                    end = start + duration(a)
                if a.kind != "UPDATE":
                    done[(a.kind, a.stage, a.micro_batch)] = end
                intervals[r].append((start, end, a))
                clock[r] = end
                pos[r] += 1
                progress = True
    stuck = [r for r, row in enumerate(acts) if pos[r] < len(row)]
    if stuck:
        lines = []
        for r in stuck:
            a = acts[r][pos[r]]
            for d in inputs(a, r):
                if d in done:
                    continue
                q, i = key_at[d]
                want = acts[q][i]
                where = (f"later in rank {r}'s own list (#{i})" if q == r else
                         f"on rank {q}, which is stuck at #{pos[q]} {acts[q][pos[q]]}")
                lines.append(f"  rank {r} at #{pos[r]} {a}: waits for {want}, {where}")
                break
        raise ScheduleError("pipeline schedule deadlocks: no rank can progress\n"
                            + "\n".join(lines) + "\nhint: a receive must come after what "
                            "lets its peer post the send (build() puts each receive right "
                            "before the action that needs it)")
    busy = [sum(e - s for s, e, a in row if a.kind in COMPUTE) for row in intervals]
    makespan = max((row[-1][1] for row in intervals if row), default=0.0)
    peaks = []
    for row in acts:
        held = peak = 0
        for a in row:
            held += (a.kind == "F") - (a.kind == "B")
            peak = max(peak, held)
        peaks.append(peak)
    return Timeline(intervals, makespan, busy, [makespan - b for b in busy], peaks)


def _per(x: Durations, n: int, name: str) -> list[float]:
    """``x`` as ``n`` durations: a number for each, or a sequence of ``n``; each finite
    and >= 0."""
    what = "stage boundary" if name == "transfer" else "stage"
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        x = [float(x)] * n
    elif hasattr(x, "__len__") and hasattr(x, "__iter__") and \
            not isinstance(x, (str, bytes, Mapping)):  # a list, a tuple, an array
        if len(x) != n:
            raise ValueError(f"simulate: {name} has {len(x)} durations; give one number, or "
                             f"{n} (one per {what})")
        x = [float(y) for y in x]
    else:
        raise ValueError(f"simulate: {name} must be a number or a list of {n} (one per "
                         f"{what}), got {x!r:.60}")
    bad = [y for y in x if not math.isfinite(y) or y < 0]
    if bad:
        raise ValueError(f"simulate: {name} durations must be finite and >= 0, got "
                         f"{bad[0]!r}")
    return x


def _check_plan(acts: list[list[Action]]) -> dict[int, int]:
    """The static checks of :func:`simulate`; returns each stage's rank."""
    errors: list[str] = []
    owner: dict[int, int] = {}
    seen: dict[tuple[str, int, int], int] = {}
    for r, row in enumerate(acts):
        for i, a in enumerate(row):
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r} #{i}: unknown action kind {a.kind!r}; "
                                    f"the kinds are {KINDS}")
            if a.kind == "UPDATE":
                if i != len(row) - 1:
                    errors.append(f"rank {r}: UPDATE at #{i} is not its last action")
                continue
            key = (a.kind, a.stage, a.micro_batch)
            if key in seen:
                errors.append(f"{a} appears twice (ranks {seen[key]} and {r})")
            seen[key] = r
            if owner.setdefault(a.stage, r) != r:
                errors.append(f"stage {a.stage} runs on ranks {owner[a.stage]} and {r}")
        if sum(a.kind == "UPDATE" for a in row) != 1:
            errors.append(f"rank {r} has {sum(a.kind == 'UPDATE' for a in row)} UPDATEs, "
                          f"not one")
    n = max(owner, default=-1) + 1
    m = max((a.micro_batch for row in acts for a in row if a.kind != "UPDATE"),
            default=-1) + 1
    for s in range(n):
        for k in range(m):
            errors += [f"{Action(kind, s, k)} is in no rank's list"
                       for kind in "FB" if (kind, s, k) not in seen]
    for (kind, s, k), r in seen.items():
        if kind in ("W",) and ("B", s, k) not in seen:
            errors.append(f"W{k}@{s} on rank {r} has no B")
        if kind not in COMPUTE or kind == "W":
            continue
        # the transfers this task needs: (the other stage, the receive, the send)
        nxt = s - 1 if kind == "F" else s + 1
        prv = s + 1 if kind == "F" else s - 1
        if 0 <= nxt < n and owner.get(nxt) != r and (f"RECV_{kind}", s, k) not in seen:
            errors.append(f"{kind}{k}@{s} on rank {r} needs stage {nxt}'s output from rank "
                          f"{owner.get(nxt)} but rank {r} has no RECV_{kind}{k}@{s}")
        if 0 <= prv < n and owner.get(prv) != r and (f"SEND_{kind}", s, k) not in seen:
            errors.append(f"{kind}{k}@{s} on rank {r} feeds stage {prv} on rank "
                          f"{owner.get(prv)} but rank {r} has no SEND_{kind}{k}@{s}")
    for r, row in enumerate(acts):
        for a in row:
            if a.kind not in COMM:
                continue
            d = 1 if a.kind in ("SEND_F", "RECV_B") else -1  # the peer's stage is s + d
            peer_stage = a.stage + d
            want = owner.get(peer_stage)
            if want is None or want == r or a.peer != want:
                errors.append(f"{a} on rank {r}: stage {peer_stage} is on rank {want}; a "
                              f"transfer goes between the ranks of neighbouring stages")
                continue
            match = ("RECV" if a.kind.startswith("SEND") else "SEND") + a.kind[4:]
            if (match, peer_stage, a.micro_batch) not in seen:
                errors.append(f"{a} on rank {r} has no matching {match}{a.micro_batch}@"
                              f"{peer_stage} on rank {a.peer}")
    if errors:
        raise ScheduleError("pipeline schedule is not consistent:\n  "
                            + "\n  ".join(dict.fromkeys(errors)))
    return owner
