"""The cost model's terms, each a named function of sizes and a link or device.

Collectives follow the ring (bandwidth-optimal) algorithms NCCL and gloo use for large
messages (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005; Patarasuk and Yuan 2009 for the all-reduce): over ``n``
ranks a message of ``nbytes`` bytes costs ``steps * latency + volume / bandwidth``, where
each rank sends ``volume``:

========================  =====================  ==========
collective                volume sent per rank   steps
========================  =====================  ==========
all-reduce                2 (n-1)/n nbytes       2 (n-1)
all-gather (output size)  (n-1)/n nbytes         n-1
reduce-scatter (input)    (n-1)/n nbytes         n-1
all-to-all                (n-1)/n nbytes         n-1
broadcast (pipelined)     nbytes                 n-1
send / receive            nbytes                 1
========================  =====================  ==========

An op costs the larger of its FLOPs at the achieved matrix-multiply rate and its bytes at
the achieved memory bandwidth (the roofline; Williams, Waterman and Patterson, CACM 2009).
"""

from __future__ import annotations

from .hardware import COLLECTIVES, Hardware, Link

__all__ = ["COLLECTIVES", "collective_time", "op_time", "sent_time", "steps_and_share"]


def _check(kind: str, nbytes: float, n: int, what: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"{what}: unknown kind {kind!r}; one of {COLLECTIVES}")
    if n < 1 or nbytes < 0:
        raise ValueError(f"{what}({kind!r}): n={n} ranks and nbytes={nbytes} must "
                         f"be >= 1 and >= 0")


def _steps(kind: str, n: int) -> int:
    return 1 if kind == "send_recv" else 2 * (n - 1) if kind == "all_reduce" else n - 1


def steps_and_share(kind: str, n: int) -> tuple[int, float]:
    """The table above for ``kind`` over ``n`` ranks: (latency steps, bytes each rank
    sends per byte of the full buffer)."""
    share = {"send_recv": 1.0, "broadcast": 1.0,
             "all_reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
    return _steps(kind, n), share


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for collective ``kind`` (one of :data:`COLLECTIVES`) of ``nbytes`` bytes
    (the full buffer: an all-gather's output, a reduce-scatter's input) over ``n`` ranks
    joined by ``link`` (bandwidth per rank and direction, latency per step). One rank:
    no cost. ``send_recv`` is one transfer between two ranks whatever ``n``.

    Raises:
        ValueError: an unknown kind, or ``n < 1`` / ``nbytes < 0``.
    """
    _check(kind, nbytes, n, "collective_time")
    if n == 1:
        return 0.0
    return sent_time(kind, steps_and_share(kind, n)[1] * nbytes, n, link)


def sent_time(kind: str, sent: float, n: int, link: Link) -> float:
    """Seconds for collective ``kind`` over ``n`` ranks in which each rank sends ``sent``
    bytes (the volume column above: what a boxing plan's step counts), its steps'
    latency included. One rank: no cost.

    Raises:
        ValueError: an unknown kind, or ``n < 1`` / ``sent < 0``.
    """
    _check(kind, sent, n, "sent_time")
    if n == 1:
        return 0.0
    return _steps(kind, n) * link.latency + sent / link.bandwidth


def op_time(flops: float, nbytes: float, hw: Hardware, dtype: str = "bfloat16") -> float:
    """Seconds for an op of ``flops`` floating-point operations that moves ``nbytes``
    bytes through device memory on ``hw``: the larger of the two at the achieved rates."""
    return max(flops / hw.flops(dtype), nbytes / hw.bandwidth())
