"""Random delays in pipeline programs (a test of a plan's robustness to timing).

``with random_delays(0.02): ...`` inside a rank's body: every pipeline program that
``nn.Graph`` compiles in the block gets, after the pipeline pass orders it, a sleep of a
random time in ``[0, 0.02)`` s before each task (the first node of each run of nodes
with one ``node.meta["pp_task"]``) and before each point-to-point transfer's start. The
draws come from :data:`RNG` (seeded by the OS: different on every rank and step); a test
may replace ``RNG.random`` to act at the n-th delay point (``test_pipeline``'s rank
that dies mid-step). The pass is wrapped only inside the block, and only in the process
that runs it.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

#: Where the delays draw from; each call of ``RNG.random()`` is one delay point.
RNG = random.Random()


def sleep_up_to(seconds: float) -> None:
    """Sleep a random time in ``[0, seconds)``."""
    time.sleep(RNG.random() * seconds)


def add_delays(gm, seconds: float):
    """Insert :func:`sleep_up_to` ``(seconds)`` before each pipeline task and each
    point-to-point start of the ordered program ``gm`` (in place); returns ``gm``."""
    from sbpflow.graph import passes

    g = gm.graph
    starts, last = [], None
    for n in g.nodes:
        lab = n.meta.get("pp_task")
        if n.op == "call_function" and (lab != last or n.target is passes._P2P):
            starts.append(n)
        if lab is not None:
            last = lab
    for n in starts:
        with g.inserting_before(n):
            g.call_function(sleep_up_to, (seconds,))
    g.lint()
    gm.recompile()
    return gm


@contextlib.contextmanager
def random_delays(seconds: float) -> Iterator[None]:
    """Within the block, the graphs that compile add :func:`add_delays` to their pipeline
    pass (``seconds`` <= 0: nothing changes)."""
    if seconds <= 0:
        yield
        return
    from sbpflow.graph import passes

    orig = passes.pipeline

    def pipeline(gm, *args, **kwargs):
        return add_delays(orig(gm, *args, **kwargs), seconds)

    passes.pipeline = pipeline
    try:
        yield
    finally:
        passes.pipeline = orig
