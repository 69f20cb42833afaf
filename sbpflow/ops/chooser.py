"""The signature chooser: which nd-SBP signature an op runs under, for inputs laid out as
they are (ARCHITECTURE "Ops and SBP signatures").

nd signatures are the product of an op's 1-D signatures over the mesh axes (DTensor's
``expand_to_full_mesh_op_strategy``). The cost of a signature is the boxing that brings
the inputs to it (bytes moved plus a start-up cost per collective, the same cost model as
:func:`sbpflow.boxing.plan_boxing`), then, for a global algorithm, its own collectives
(see :func:`choose_signature` for the order).
The choice is cached per (op, attrs, input metas, input layouts, placement, in place).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from functools import lru_cache

from ..boxing import backend_of, plan_boxing
from ..boxing.plan import LATENCY_BYTES
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, format_nd_sbp
from .registry import Meta, OpSpec

__all__ = ["Candidate", "axis_collectives_cost", "boxing_cost", "choose_signature",
           "one_axis_signatures", "rank_signatures", "split_axes"]

log = logging.getLogger("sbpflow.ops")


def one_axis_signatures(op: OpSpec, metas: tuple[Meta, ...], attrs: dict) -> list[tuple]:
    """The op's 1-D signatures for these inputs: all-B first, then its rule's (without P
    for random ops), duplicates removed."""
    n = len(metas)
    sigs = [(broadcast,) * (n + 1)]
    for sig in op.rule(metas, attrs) if op.rule else []:
        if op.random and any(s.is_partial() for s in sig):
            continue
        if sig not in sigs:
            sigs.append(tuple(sig))
    return sigs


def boxing_cost(meta: Meta, pl: Placement, src, dst) -> tuple[int, int]:
    """``(bytes + latency bytes, collectives)`` of boxing a tensor of ``meta`` from nd-SBP
    ``src`` to ``dst`` on ``pl``."""
    if src == dst:
        return 0, 0
    plan = plan_boxing(meta.shape, meta.dtype, pl, src, pl, dst, backend_of(pl))
    comms = len(plan.collectives())
    return plan.bytes + comms * LATENCY_BYTES[backend_of(pl)], comms


def split_axes(nd_sbp, dims, pl: Placement) -> list[int]:
    """The mesh axes (of more than one rank) on which ``nd_sbp`` splits a dim in ``dims``:
    where a global algorithm communicates."""
    return [a for a, s in enumerate(nd_sbp)
            if pl.shape[a] > 1 and s.is_split() and s.dim in dims]


def axis_collectives_cost(pl: Placement, nbytes: int, count: int) -> tuple[int, int]:
    """``(bytes + latency bytes, collectives)`` of ``count`` collectives that each move
    ``nbytes`` (a global algorithm's own communication, in the boxing cost model's units)."""
    return count * (nbytes + LATENCY_BYTES[backend_of(pl)]), count


def _makes_partial(have, want) -> bool:
    """Would boxing turn a split input into P on some axis? S -> P (the shard padded with
    zeros) moves no bytes, so the cost model would call it free, but its P output then
    costs a full all-reduce downstream: slicing an S(1) tensor would give a P summand of
    the whole output instead of gathering the input once. Such signatures are not
    considered for out-of-place ops. (B -> P stays: one rank keeps the value, as
    scatter_add into a P output needs.)"""
    return any(w.is_partial() and h.is_split()
               for hs, ws in zip(have, want) for h, w in zip(hs, ws))


@lru_cache(maxsize=8192)
def choose_signature(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                     sbps: tuple[tuple[SBP, ...], ...], pl: Placement,
                     inplace: bool = False) -> tuple[tuple, tuple] | None:
    """The nd signature for ``op`` on inputs laid out as ``sbps`` on ``pl``.

    Returns ``(input nd-SBPs, output nd-SBP)``. Out of place: signatures that would box a
    split input to P are skipped (see :func:`_makes_partial`); there is always one (all-B).
    ``inplace``: only signatures whose first input and output are both ``sbps[0]`` (the
    tensor written into keeps its layout and shard); None when the op has none.

    Order: the cheapest boxing of the inputs (bytes plus a start-up cost per collective),
    then the fewest boxing collectives, then the global algorithm's own cost, then a
    signature the inputs already match (so ``relu`` of a B tensor stays B rather than
    slicing to S), then the order of the rule's list. A global algorithm is registered to
    avoid moving its input (its collectives move output-sized data: a softmax over a
    split vocabulary all-reduces two ``(batch, 1)`` tensors instead of re-splitting the
    logits), so moving the input comes first in the order: an input already laid out for
    the algorithm runs it, as Megatron's vocabulary-parallel cross entropy does; its own
    cost decides among signatures whose boxing costs the same (a P input boxed to B or
    to a split).
    """
    ranked = rank_signatures(op, attrs_key, metas, sbps, pl, inplace)
    if not ranked:
        return None
    best = (ranked[0].ins, ranked[0].out)
    if log.isEnabledFor(logging.DEBUG):
        note = " (all-B fallback)" if all(s.is_broadcast() for s in best[1]) else ""
        log.debug("%s%s%s: inputs %s -> %s, output %s%s", op.name, " in place" if inplace else "",
                  dict(attrs_key), [format_nd_sbp(s) for s in sbps],
                  [format_nd_sbp(s) for s in best[0]], format_nd_sbp(best[1]), note)
    return best


@dataclass(frozen=True)
class Candidate:
    """One nd signature the chooser considered for an op, with its cost terms.

    Attributes:
        ins, out: the inputs' nd-SBPs and the output's.
        boxing: per input, ``(cost, collectives)`` of boxing it from its layout to ``ins``:
            cost in bytes each rank sends plus a start-up cost per collective expressed in
            bytes (:data:`sbpflow.boxing.plan.LATENCY_BYTES`), as
            :func:`sbpflow.boxing.plan_boxing` costs plans.
        own: the global algorithm's own collectives, ``(cost, collectives)`` in the same
            units (``(0, 0)`` for an op whose kernel runs on the shards alone).
        exact: the inputs already have this signature's layouts (nothing to box).
    """

    ins: tuple
    out: tuple
    boxing: tuple
    own: tuple
    exact: bool
    order: int  # position in the rule's product (the last tie-break)

    @property
    def boxing_cost(self) -> int:
        return sum(c for c, _ in self.boxing)

    @property
    def key(self) -> tuple:
        """The chooser's order: boxing cost, boxing collectives, own cost, exactness, rule
        order."""
        return (self.boxing_cost, sum(n for _, n in self.boxing), self.own, not self.exact,
                self.order)


@lru_cache(maxsize=8192)
def rank_signatures(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                    sbps: tuple[tuple[SBP, ...], ...], pl: Placement,
                    inplace: bool = False) -> tuple[Candidate, ...]:
    """Every signature :func:`choose_signature` considers for these inputs, cheapest
    first (its order); empty for an in-place op with none that keeps its tensor's layout.
    The logical graph (:mod:`sbpflow.graph.ir`) shows the first and the runner-up."""
    attrs = dict(attrs_key)
    per_axis = one_axis_signatures(op, metas, attrs)
    if inplace:
        per_axis = [[s for s in per_axis if s[0] == own and s[-1] == own] for own in sbps[0]]
        if not all(per_axis):
            return ()
    else:
        per_axis = [per_axis] * pl.ndim
    out_list = []
    for k, combo in enumerate(itertools.product(*per_axis)):
        ins = tuple(tuple(sig[i] for sig in combo) for i in range(len(metas)))
        if not inplace and _makes_partial(sbps, ins):
            continue
        out = tuple(sig[-1] for sig in combo)
        if op.check is not None and not op.check(metas, attrs, ins, out, pl):
            continue
        cost = tuple(boxing_cost(m, pl, s, want) for m, s, want in zip(metas, sbps, ins))
        own = op.cost(metas, attrs, ins, out, pl) if op.cost is not None else (0, 0)
        exact = all(s == want for s, want in zip(sbps, ins))
        out_list.append(Candidate(ins, out, cost, tuple(own), exact, k))
    return tuple(sorted(out_list, key=lambda c: c.key))
