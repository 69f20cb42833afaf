"""The op registry: every op sbpflow runs on global tensors is one entry here.

An entry (:class:`OpSpec`) has

* a **kernel**: ``kernel(*local_torch_tensors, **attrs) -> torch.Tensor`` (or a tuple of
  them: ``max`` with ``dim`` gives values and indices). It is torch's own function on one
  process: it runs on local sbpflow tensors, on the shards of global ones, and on
  ``meta`` tensors to infer the global output shapes and dtypes (torch's broadcasting
  and type promotion, for free);
* a **rule**: ``rule(metas, attrs) -> list of 1-D signatures``, each a tuple
  ``(in_0, ..., in_{n-1}, out)`` of SBPs valid on **one mesh axis** for inputs of those
  global metas (:mod:`sbpflow.ops.rules` generates most of them). All-B is always added,
  so an op without rules still runs (it gathers); random ops never take or give P;
* for a **global algorithm** (ARCHITECTURE "Ops and SBP signatures": max over a split
  dim, cumsum, topk, softmax over a split class dim, vocabulary-parallel lookups): an
  ``algorithm(call, *local_shards, **attrs)`` that runs *instead of* the kernel on global
  inputs, after they are boxed to the chosen signature. It may call collectives (only
  through :mod:`sbpflow.distributed`'s public functions) over the mesh axes the
  signature names; ``call`` (:class:`sbpflow.ops.dispatch.Call`) gives the placement,
  the chosen signature and the global metas. Its rule lists the layouts it accepts and
  produces like any op's; its ``cost(metas, attrs, ins, out, placement) -> (bytes,
  collectives)`` is what its own communication adds to the boxing cost the chooser
  minimises.

Every op is run by :func:`sbpflow.ops.dispatch.dispatch` (in-place forms too): one path
for the chooser, the collective recorder, debug output and the graph tracer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..sbp import SBP

__all__ = ["Meta", "OpSpec", "REGISTRY", "get_op", "infer_meta", "probing", "register",
           "register_algorithm"]

log = logging.getLogger("sbpflow.ops")


@dataclass(frozen=True)
class Meta:
    """Global metadata of one tensor: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


Rule = Callable[[Sequence[Meta], dict], list[tuple[SBP, ...]]]


@dataclass(frozen=True, eq=False)
class OpSpec:
    """A registered op (see the module doc). Compared and hashed by identity."""

    name: str
    kernel: Callable[..., torch.Tensor | tuple]
    rule: Rule | None = None
    # random ops never take P inputs or give P outputs
    random: bool = False
    # check(metas, attrs, input nd-SBPs, output nd-SBP, placement) -> bool: whether an nd
    # signature is valid on this mesh (for rules whose validity depends on shard sizes).
    check: Callable | None = None
    # global algorithm (None: the kernel runs on the boxed shards) and its own cost
    algorithm: Callable | None = None
    cost: Callable | None = None
    # the algorithm runs on ranks outside the placement too (with empty shards): random
    # algorithms draw the whole global tensor on every rank to keep generators in step
    everywhere: bool = False
    # meta(metas, attrs) -> Meta: the output's global meta, for kernels torch has no meta
    # implementation of (bincount); None: the kernel runs on meta tensors
    meta: Callable | None = None


REGISTRY: dict[str, OpSpec] = {}


def _add(spec: OpSpec) -> None:
    if spec.name in REGISTRY:
        raise ValueError(f"op {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec


def register(name: str, rule: Rule | None = None, *, random: bool = False, check=None,
             meta=None):
    """Decorator: register ``kernel`` under ``name`` with its one-axis SBP ``rule`` (and an
    optional mesh-level ``check`` of nd signatures, and a ``meta`` function where torch has
    no meta kernel). Returns the kernel unchanged.

    Raises:
        ValueError: ``name`` is already registered."""

    def wrap(kernel):
        _add(OpSpec(name, kernel, rule, random, check, meta=meta))
        return kernel

    return wrap


def register_algorithm(name: str, *, kernel, rule: Rule, cost=None, check=None,
                       everywhere: bool = False):
    """Decorator: register a global algorithm ``algorithm(call, *shards, **attrs)`` under
    ``name``; ``kernel`` is torch's function for local inputs and shape inference,
    ``rule`` the one-axis layouts the algorithm accepts and produces, ``cost`` its own
    communication (see the module doc). Returns the algorithm unchanged.

    Raises:
        ValueError: ``name`` is already registered."""

    def wrap(algorithm):
        _add(OpSpec(name, kernel, rule, False, check, algorithm, cost, everywhere))
        return algorithm

    return wrap


def get_op(name: str) -> OpSpec:
    """The registered op ``name``.

    Raises:
        KeyError: no such op (the message lists the registered names)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no op {name!r}; registered: {sorted(REGISTRY)}") from None


def infer_meta(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...]) -> Meta | tuple[Meta, ...]:
    """Global output shape(s) and dtype(s): the kernel run once on ``meta`` tensors, cached
    (torch's meta kernels cost ~100 us a call, more than the op itself on small shards).
    A kernel that returns a tuple gives a tuple of metas."""
    return _infer_meta(op, attrs_key, metas, _autocast_dtype())


def _autocast_dtype() -> torch.dtype | None:
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _metas_of(out) -> Meta | tuple[Meta, ...]:
    if isinstance(out, (tuple, list)):
        return tuple(Meta(tuple(o.shape), o.dtype) for o in out)
    return Meta(tuple(out.shape), out.dtype)


#: Above 0 while a kernel runs only to learn something about its output (its meta, its
#: FLOPs, the attention kernel torch would choose): not an op of the step, so a count of
#: the step's calls (:class:`sbpflow.graph.ir._CallCounter`) leaves it out.
PROBES = [0]


@contextlib.contextmanager
def probing():
    """Mark the kernels run inside as probes (:data:`PROBES`)."""
    PROBES[0] += 1
    try:
        yield
    finally:
        PROBES[0] -= 1


@lru_cache(maxsize=8192)
def _infer_meta(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                amp_dtype: torch.dtype | None):
    with probing():
        return _infer_meta_probed(op, attrs_key, metas, amp_dtype)


def _infer_meta_probed(op: OpSpec, attrs_key: tuple, metas: tuple[Meta, ...],
                       amp_dtype: torch.dtype | None):
    attrs = dict(attrs_key)
    if op.meta is not None:
        return op.meta(metas, attrs)
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
    return _metas_of(out)
