"""The op registry: one kernel over local torch tensors + SBP rules for one mesh axis.

An op is registered with

* a **kernel**: ``kernel(*local_torch_tensors, **attrs) -> torch.Tensor``; it also runs
  on ``meta`` tensors to infer the global output shape and dtype (torch's broadcasting
  and type promotion, for free);
* a **rule**: ``rule(metas, attrs) -> list of 1-D signatures``, each a tuple
  ``(in_0, ..., in_{n-1}, out)`` of SBPs valid on **one mesh axis** for inputs of those
  global metas. All-B is always added, so an op without rules still runs (it gathers).

nd signatures are the product of 1-D signatures over the mesh axes (DTensor's
``expand_to_full_mesh_op_strategy``). The chooser takes the signature whose input
layouts already match, else the one with the fewest boxing bytes (same cost model as
boxing), and caches its choice per (op, attrs, input metas, placement).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..boxing import backend_of, plan_boxing
from ..boxing.plan import LATENCY_BYTES
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, format_nd_sbp

__all__ = ["Meta", "OpSpec", "register", "get_op", "choose_signature", "infer_meta", "REGISTRY"]

log = logging.getLogger("sbpflow.ops")


@dataclass(frozen=True)
class Meta:
    """Global metadata of one tensor input: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


Rule = Callable[[Sequence[Meta], dict], list[tuple[SBP, ...]]]


@dataclass(frozen=True)
class OpSpec:
    """A registered op: name, local kernel, one-axis SBP rule, and whether it draws random
    numbers (random ops never take P inputs or give P outputs)."""

    name: str
    kernel: Callable[..., torch.Tensor]
    rule: Rule | None = None
    random: bool = False
    # check(metas, attrs, input nd-SBPs, output nd-SBP, placement) -> bool: whether an nd
    # signature is valid on this mesh (for rules whose validity depends on shard sizes).
    check: Callable | None = None


REGISTRY: dict[str, OpSpec] = {}


def register(name: str, rule: Rule | None = None, random: bool = False, check=None):
    """Decorator: register ``kernel`` under ``name`` with its one-axis SBP ``rule`` (and an
    optional mesh-level ``check`` of nd signatures)."""

    def wrap(kernel):
        if name in REGISTRY:
            raise ValueError(f"op {name!r} is registered twice")
        REGISTRY[name] = OpSpec(name, kernel, rule, random, check)
        return kernel

    return wrap


def get_op(name: str) -> OpSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no op {name!r}; registered: {sorted(REGISTRY)}") from None


def _one_axis_signatures(op: OpSpec, metas: tuple[Meta, ...], attrs: dict) -> list[tuple]:
    n = len(metas)
    sigs = [(broadcast,) * (n + 1)]
    for sig in op.rule(metas, attrs) if op.rule else []:
        if op.random and any(s.is_partial() for s in sig):
            continue
        if sig not in sigs:
            sigs.append(tuple(sig))
    return sigs


def _boxing_cost(meta: Meta, pl: Placement, src, dst) -> tuple[int, int]:
    if src == dst:
        return 0, 0
    plan = plan_boxing(meta.shape, meta.dtype, pl, src, pl, dst, backend_of(pl))
    comms = len(plan.collectives())
    return plan.bytes + comms * LATENCY_BYTES[backend_of(pl)], comms


def _makes_partial(have, want) -> bool:
    """Would boxing turn a split input into P on some axis? S -> P (the shard padded with
    zeros) moves no bytes, so the cost model would call it free, but its P output then
    costs a full all-reduce downstream: slicing an S(1) tensor would give a P summand of
    the whole output instead of gathering the input once. Such signatures are not
    considered. (B -> P stays: one rank keeps the value, as scatter_add into a P output
    needs.)"""
    return any(w.is_partial() and h.is_split()
               for hs, ws in zip(have, want) for h, w in zip(hs, ws))


@lru_cache(maxsize=8192)
def choose_signature(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                     sbps: tuple[tuple[SBP, ...], ...], pl: Placement) -> tuple[tuple, tuple]:
    """The nd signature for ``op`` on inputs laid out as ``sbps`` on ``pl``.

    Returns ``(input nd-SBPs, output nd-SBP)``. Signatures that would box a non-P input
    to P are skipped (see :func:`_makes_partial`). Cheapest boxing first (bytes plus a
    start-up cost per collective), then the fewest collectives, then a signature the
    inputs already match (so ``relu`` of a B tensor stays B rather than slicing to S),
    then the order of the rule's list.
    """
    attrs = dict(attrs_key)
    per_axis = _one_axis_signatures(op, metas, attrs)
    best, best_key = None, None
    for k, combo in enumerate(itertools.product(per_axis, repeat=pl.ndim)):
        ins = tuple(tuple(sig[i] for sig in combo) for i in range(len(metas)))
        if _makes_partial(sbps, ins):
            continue
        out = tuple(sig[-1] for sig in combo)
        if op.check is not None and not op.check(metas, attrs, ins, out, pl):
            continue
        cost = [_boxing_cost(m, pl, s, want) for m, s, want in zip(metas, sbps, ins)]
        exact = all(s == want for s, want in zip(sbps, ins))
        key = (sum(c[0] for c in cost), sum(c[1] for c in cost), not exact, k)
        if best_key is None or key < best_key:
            best, best_key = (ins, out), key
    if log.isEnabledFor(logging.DEBUG):
        note = " (all-B fallback)" if all(s.is_broadcast() for s in best[1]) else ""
        log.debug("%s%s: inputs %s -> %s, output %s%s", op.name, attrs,
                  [format_nd_sbp(s) for s in sbps], [format_nd_sbp(s) for s in best[0]],
                  format_nd_sbp(best[1]), note)
    return best


def infer_meta(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...]) -> Meta:
    """Global output shape and dtype: the kernel run once on ``meta`` tensors, cached
    (torch's meta kernels cost ~100 us a call, more than the op itself on small shards)."""
    return _infer_meta(op, attrs_key, metas, _autocast_dtype())


def _autocast_dtype() -> torch.dtype | None:
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


@lru_cache(maxsize=8192)
def _infer_meta(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                amp_dtype: torch.dtype | None) -> Meta:
    attrs = dict(attrs_key)
    try:
        out = op.kernel(*(torch.empty(m.shape, dtype=m.dtype, device="meta") for m in metas),
                        **attrs)
    except RuntimeError:
        if amp_dtype is None:
            raise
        # torch.autocast acts on CPU/CUDA tensors, not on meta ones: inputs of mixed float
        # dtypes that autocast would cast to one reach the meta kernel as they are; retry
        # with the floating inputs in the autocast dtype (the local kernel runs autocast).
        out = op.kernel(*(torch.empty(m.shape, dtype=amp_dtype if m.dtype.is_floating_point
                                      else m.dtype, device="meta") for m in metas), **attrs)
    return Meta(tuple(out.shape), out.dtype)
