"""Boxing plans: a change of layout as data.

A plan is a tuple of :class:`Step` values, planned from metadata alone (global shape,
dtype, source and destination placement and nd-SBP, backend), so every rank computes
the same plan. Plans are cached per those keys and costed in bytes each rank sends.

One mesh axis changes per :class:`Step` on a placement. The 1-D transitions and the
collective each runs (ARCHITECTURE "Boxing"; backward = the dual transition):

============ ================================== ===========================================
from -> to   collective on that mesh axis       backward: dual(to) -> dual(from)
============ ================================== ===========================================
P -> B       all-reduce                         P -> B   (all-reduce)
P -> S(i)    reduce-scatter                     S(i) -> B (all-gather)
S(i) -> B    all-gather                         P -> S(i) (reduce-scatter)
S(i) -> S(j) all-to-all                         S(j) -> S(i) (all-to-all)
B -> S(i)    local slice, no comm               S(i) -> P (pad with zeros, no comm)
B -> P       coordinate 0 keeps, others zeros   B -> P
S(i) -> P    place shard in zeros, no comm      B -> S(i) (local slice)
============ ================================== ===========================================

nd-SBP: a step on mesh axis ``a`` that touches tensor dim ``d`` (its source or target
splits ``d``) is only valid while no *inner* axis ``b > a`` splits ``d``: the ranks
along axis ``a`` then hold the same outer chunk of ``d`` and the step is exactly the
1-D transition on that chunk. The planner is a shortest-path search over nd-SBP states
with those valid steps, cheapest first (bytes plus a start-up cost per collective,
:data:`LATENCY_BYTES`), then fewest steps; it finds the direct
step where one exists and routes cyclic or nested cases (``(S(0), S(1)) -> (S(1), S(0))``)
through intermediate layouts.

Changes of placement or device type (ARCHITECTURE "Different placements"):

* same mesh shape: box on the source to the destination nd-SBP, then move each shard
  to the rank at the same mesh coordinate (send/recv; a local device copy where the
  rank is the same);
* otherwise: box the source to all-B, send the whole value to every destination rank
  that does not hold it (from source ranks round-robin), then take the destination
  layout locally (B -> S slices, B -> P zero-fills).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..placement import placement as Placement
from ..placement import shard_shape
from ..sbp import SBP, Split, broadcast, format_nd_sbp, partial_sum

__all__ = ["Step", "Plan", "plan_boxing", "axis_collective", "transition_cost"]

# 1-D transition -> what runs on that mesh axis
_COLLECTIVE = {
    ("P", "B"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "B"): "all_gather",
    ("S", "S"): "all_to_all",
    ("B", "S"): "slice",
    ("B", "P"): "zero_fill",
    ("S", "P"): "pad",
}


def _kind(s: SBP) -> str:
    return "S" if s.is_split() else "B" if s.is_broadcast() else "P"


def axis_collective(src: SBP, dst: SBP) -> str:
    """The collective (or local op) a 1-D transition ``src -> dst`` runs on its mesh axis."""
    return _COLLECTIVE[(_kind(src), _kind(dst))]


@dataclass(frozen=True)
class Step:
    """One boxing step.

    ``kind == "axis"``: change mesh axis ``axis`` of ``placement`` from ``in_sbp[axis]``
    to ``out_sbp[axis]``. ``kind == "transfer"``: move shards from ``placement`` (laid
    out as ``in_sbp``) to ``dst_placement`` (laid out as ``out_sbp``) along ``pairs``
    of (source rank, destination rank). ``bytes`` is the step's cost per rank.
    """

    kind: str
    placement: Placement
    in_sbp: tuple[SBP, ...]
    out_sbp: tuple[SBP, ...]
    axis: int | None = None
    collective: str = ""
    bytes: int = 0
    dst_placement: Placement | None = None
    pairs: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        if self.kind == "axis":
            return (f"axis {self.axis}: {self.in_sbp[self.axis]!r} -> {self.out_sbp[self.axis]!r} "
                    f"({self.collective}, {self.bytes} B) on {self.placement!r}")
        return (f"transfer {format_nd_sbp(self.in_sbp)} on {self.placement!r} -> "
                f"{format_nd_sbp(self.out_sbp)} on {self.dst_placement!r} "
                f"({len(self.pairs)} pair(s), {self.bytes} B)")


@dataclass(frozen=True)
class Plan:
    """A boxing plan: its steps, in order, and their total cost in bytes per rank."""

    steps: tuple[Step, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    def collectives(self) -> list[str]:
        """Collectives the plan runs (local steps left out), in order."""
        local = ("slice", "zero_fill", "pad")
        return [s.collective for s in self.steps if s.collective not in local]

    def __str__(self) -> str:
        if not self.steps:
            return "Plan(no-op)"
        return "Plan(\n  " + "\n  ".join(str(s) for s in self.steps) + f"\n  total {self.bytes} B)"


def transition_cost(collective: str, nbytes: int, n: int, backend: str) -> int:
    """Bytes one rank sends for ``collective`` over a mesh axis of ``n`` ranks.

    ``nbytes`` is the size of the value on that axis (the tensor with this axis not
    split). Ring algorithms (Patarasuk & Yuan 2009): all-reduce 2(n-1)/n, all-gather and
    reduce-scatter (n-1)/n, all-to-all (n-1)/n^2 of it. gloo's reduce-scatter runs as a
    full all-reduce followed by a local slice, so it is costed as one on gloo.
    """
    if n == 1 or collective in ("slice", "zero_fill", "pad", "none"):
        return 0
    f = (n - 1) / n
    if collective == "all_reduce":
        return int(2 * f * nbytes)
    if collective == "reduce_scatter":
        return int((2 if backend == "gloo" else 1) * f * nbytes)
    if collective == "all_gather":
        return int(f * nbytes)
    if collective == "all_to_all":
        return int(f * nbytes / n)
    raise ValueError(f"unknown collective {collective!r}")


# Start-up cost of one collective, in bytes that could have moved meanwhile (alpha/beta
# of the alpha-beta model): ~100 us at ~1 GB/s for gloo on loopback/Ethernet (measured
# here: 16 MB all-reduce in 17.6 ms on 2 ranks), ~10 us at ~100 GB/s for NCCL on NVLink.
# It keeps small changes on the direct one-collective route.
LATENCY_BYTES = {"gloo": 128 * 1024, "nccl": 1024 * 1024}


def _step_valid(state: tuple[SBP, ...], axis: int, new: SBP) -> bool:
    dims = {s.dim for s in (state[axis], new) if s.is_split()}
    return not any(s.is_split() and s.dim in dims for s in state[axis + 1 :])


def _axis_nbytes(shape, mesh_shape, state, axis, itemsize) -> int:
    full = list(state)
    full[axis] = broadcast
    sub = shard_shape(shape, mesh_shape, full, (0,) * len(mesh_shape))
    return math.prod(sub) * itemsize


def _plan_same_placement(shape, itemsize, pl: Placement, src, dst, backend) -> tuple[Step, ...]:
    if src == dst:
        return ()
    ndim = len(shape)
    mesh = pl.shape

    def choices(axis):
        out = [broadcast] + [Split(d) for d in range(ndim)]
        if src[axis].is_partial() or dst[axis].is_partial():
            out.append(partial_sum)
        return out

    start, goal = tuple(src), tuple(dst)
    best = {start: (0, 0)}
    heap = [(0, 0, 0, start, ())]
    counter = 0
    while heap:
        cost, nsteps, _, state, steps = heapq.heappop(heap)
        if state == goal:
            return steps
        if best.get(state, (math.inf, math.inf)) < (cost, nsteps):
            continue
        for axis in range(len(mesh)):
            cur = state[axis]
            for new in choices(axis):
                if new == cur or not _step_valid(state, axis, new):
                    continue
                # P is only introduced on axes where the destination has it: an
                # intermediate P never beats the direct route and would make plans opaque.
                if new.is_partial() and not dst[axis].is_partial():
                    continue
                coll = axis_collective(cur, new)
                nbytes = _axis_nbytes(shape, mesh, state, axis, itemsize)
                c = transition_cost(coll, nbytes, mesh[axis], backend)
                latency = LATENCY_BYTES.get(backend, 0) if c else 0
                nxt = state[:axis] + (new,) + state[axis + 1 :]
                key = (cost + c + latency, nsteps + 1)
                if key < best.get(nxt, (math.inf, math.inf)):
                    best[nxt] = key
                    counter += 1
                    step = Step("axis", pl, state, nxt, axis=axis, collective=coll, bytes=c)
                    heapq.heappush(heap, (key[0], key[1], counter, nxt, steps + (step,)))
    raise RuntimeError(f"internal: no boxing plan {format_nd_sbp(src)} -> {format_nd_sbp(dst)}")


@lru_cache(maxsize=4096)
def plan_boxing(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    src_placement: Placement,
    src_sbp: tuple[SBP, ...],
    dst_placement: Placement,
    dst_sbp: tuple[SBP, ...],
    backend: str = "gloo",
) -> Plan:
    """Plan the change of a global tensor's layout; cached per its arguments.

    Args:
        shape: global shape. dtype: element type (sets bytes).
        src_placement, src_sbp: where and how the tensor is laid out now (split dims
            non-negative). dst_placement, dst_sbp: where and how it should be.
        backend: ``"gloo"`` or ``"nccl"``; sets the cost of a reduce-scatter.

    Returns:
        A :class:`Plan`; same on every rank for the same arguments.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = tuple(shape)
    if src_placement == dst_placement:
        return Plan(_plan_same_placement(shape, itemsize, src_placement, src_sbp, dst_sbp, backend),
                    shape, dtype)
    steps: list[Step] = []
    if src_placement.shape == dst_placement.shape:
        steps += _plan_same_placement(shape, itemsize, src_placement, src_sbp, dst_sbp, backend)
        pairs = tuple(zip(src_placement.rank_list, dst_placement.rank_list))
        moved = sum(math.prod(src_placement.shard_shape(shape, dst_sbp, s))
                    for s, d in pairs if s != d)
        steps.append(Step("transfer", src_placement, tuple(dst_sbp), tuple(dst_sbp),
                          collective="send_recv", bytes=moved * itemsize // len(pairs),
                          dst_placement=dst_placement, pairs=pairs))
        return Plan(tuple(steps), shape, dtype)
    all_b_src = (broadcast,) * src_placement.ndim
    all_b_dst = (broadcast,) * dst_placement.ndim
    steps += _plan_same_placement(shape, itemsize, src_placement, src_sbp, all_b_src, backend)
    srcs = src_placement.rank_list
    pairs, k = [], 0
    for d in dst_placement.rank_list:
        if d in src_placement:
            pairs.append((d, d))
        else:
            pairs.append((srcs[k % len(srcs)], d))
            k += 1
    nbytes = math.prod(shape) * itemsize
    steps.append(Step("transfer", src_placement, all_b_src, all_b_dst, collective="send_recv",
                      bytes=nbytes * k // max(len(srcs), 1), dst_placement=dst_placement,
                      pairs=tuple(pairs)))
    steps += _plan_same_placement(shape, itemsize, dst_placement, all_b_dst, dst_sbp, backend)
    return Plan(tuple(steps), shape, dtype)
