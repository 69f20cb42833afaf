"""Randomness of global tensors: seeds, generator state, and the two draw modes.

**Layout-invariant mode (default).** With ``sbpflow.manual_seed(s)`` on every rank, a
random op (``rand``, ``randn``, ``randint``, ``randperm``, ``normal``, ``bernoulli``,
``multinomial``, the ``*_like`` forms, dropout) gives the global tensor that
``torch.manual_seed(s)`` and the same torch op give on one process, bit for bit on CPU,
whatever the placement and SBP: every rank of the world draws the *whole global tensor*
from torch's generator (so all generators stay in step) and keeps its shard. Random ops
with tensor inputs first make those inputs whole (``B``) and replay torch's draw on
them. Ranks outside the placement draw too (on stand-in inputs of the same shapes) and
keep an empty shard. **Cost:** one global-size draw per rank per op (time and peak
memory of the whole tensor, not of the shard), plus gathering the tensor inputs.

**Per-shard mode** (:func:`per_shard`, for tensors too big to draw whole on one rank):
every rank draws only the region it holds, from a private generator seeded with
``(base, region)``: ``base`` is one 62-bit integer drawn from torch's generator (so the
global generator still advances identically on every rank and successive ops differ),
``region`` is the slice of the global tensor the rank draws (with the global shape).
Memory and time are shard-sized. Properties: deterministic for a given seed and layout;
ranks holding the same region (``B`` axes, ``P`` inputs of dropout) draw the same values;
different regions draw independent streams. The global value depends on the layout and
is **not** the one-process torch value. ``randperm`` always draws whole (a permutation has
no per-shard meaning); local (non-global) tensors are always drawn as torch draws them.

``seed()``, ``initial_seed()``, ``get_rng_state()``, ``set_rng_state()`` mirror torch's
(CPU default generator); ``seed()`` agrees across ranks (rank 0 picks, the world gets it).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Iterator, Sequence

import torch

from . import distributed as _dist
from .distributed import _comm
from .placement import placement as Placement
from .sbp import SBP

__all__ = ["manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state",
           "per_shard", "is_per_shard", "draw_shard"]

_PER_SHARD: contextvars.ContextVar[bool] = contextvars.ContextVar("sbpflow_per_shard",
                                                                   default=False)


def manual_seed(seed: int) -> torch.Generator:
    """Seed torch's generators on this rank (``torch.manual_seed``); call it with the same
    seed on every rank so that random ops agree (see the module doc)."""
    return torch.manual_seed(seed)


def seed() -> int:
    """Seed torch's generators with a non-deterministic seed and return it
    (``torch.seed``). Collective when the world has several ranks: every rank calls it;
    rank 0 picks the seed and the others receive it, so the ranks stay in agreement."""
    world = _dist.get_world_size()
    if world == 1:
        return torch.seed()
    # torch.seed() gives up to 64 bits; keep 63 so that the seed fits an int64 tensor.
    own = torch.seed() & (2 ** 63 - 1) if _dist.get_rank() == 0 else 0
    picked = torch.tensor([own], dtype=torch.int64)
    ranks = tuple(range(world))
    _dist.ensure_groups([ranks])
    _comm.broadcast(picked, ranks, 0)
    s = int(picked.item())
    torch.manual_seed(s)
    return s


def initial_seed() -> int:
    """The seed of torch's default CPU generator (``torch.initial_seed``)."""
    return torch.initial_seed()


def get_rng_state() -> torch.Tensor:
    """torch's default CPU generator state (``torch.get_rng_state``), a uint8 tensor."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    """Restore torch's default CPU generator state (``torch.set_rng_state``). Restore the
    same state on every rank to keep random ops layout invariant."""
    torch.set_rng_state(state)


@contextlib.contextmanager
def per_shard(enabled: bool = True) -> Iterator[None]:
    """Context manager: random ops on global tensors draw only each rank's shard.

    See the module doc for the properties (shard-sized memory; deterministic per seed and
    layout; ranks with the same shard agree; not equal to the one-process torch draw).
    ``per_shard(False)`` restores the layout-invariant mode inside an outer ``per_shard()``.
    The mode is scoped to the ``with`` block (a context variable, not process state).
    """
    token = _PER_SHARD.set(bool(enabled))
    try:
        yield
    finally:
        _PER_SHARD.reset(token)


def is_per_shard() -> bool:
    """Whether random ops are in per-shard mode here (see :func:`per_shard`)."""
    return _PER_SHARD.get()


def _per_shard_here() -> bool:
    """:func:`is_per_shard` for the random ops themselves: per-shard draws seed a
    generator per shard from values read on the host, which an ``nn.Graph`` program cannot
    replay, so tracing one raises.

    Raises:
        sbpflow.graph.GraphError: per-shard mode inside a graph's ``build`` (raised by
            the tracer).
    """
    on = _PER_SHARD.get()
    if on:
        from .distributed._state import _state as dstate

        if dstate.tracer is not None and not dstate.untraced:
            raise dstate.tracer.unsupported(
                "sbpflow.random.per_shard() inside nn.Graph: per-shard draws are seeded on "
                "the host per shard, which a compiled program cannot replay; use the "
                "default (layout-invariant) random mode in build(), or run this part "
                "eagerly")
    return on


def _region_seed(base: int, shape: Sequence[int], region: Sequence[slice]) -> int:
    key = ",".join([str(base), *(str(int(s)) for s in shape), "|",
                    *(f"{r.start}:{r.stop}" for r in region)])
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def region_generator(shape: Sequence[int], region: Sequence[slice], device: torch.device,
                     generator: torch.Generator | None = None) -> torch.Generator:
    """Per-shard mode: a fresh generator for ``region`` of a global tensor of ``shape``.

    Draws one integer from ``generator`` (torch's default generator when ``None``) on
    every call, so every rank of the world must call it, in the same order, as it does
    for any random op."""
    base = int(torch.randint(0, 2 ** 62, (), generator=generator).item())
    return torch.Generator(device=device).manual_seed(_region_seed(base, shape, region))


def draw_shard(draw: Callable[[tuple[int, ...], torch.Generator | None], torch.Tensor],
               shape: Sequence[int], pl: Placement, nd: Sequence[SBP],
               generator: torch.Generator | None = None) -> torch.Tensor:
    """This rank's shard of a random tensor of global ``shape`` laid out ``nd`` on ``pl``.

    ``draw(size, generator)`` makes a tensor of ``size`` on ``pl.device`` from
    ``generator`` (``None``: torch's default). Layout-invariant mode: draws the whole
    ``shape`` (on every rank of the world) and returns the shard (a copy). Per-shard
    mode: draws only the shard's region (see :func:`region_generator`); ``P`` axes hold
    the whole range, like ``B``. A rank outside ``pl`` gets an empty tensor. Every rank
    of the world calls this, in the same order.
    """
    shape = tuple(int(s) for s in shape)
    region = pl.shard_slices(shape, nd)
    local_shape = pl.shard_shape(shape, nd)
    if _per_shard_here():
        return draw(local_shape, region_generator(shape, region, pl.device, generator))
    whole = draw(shape, generator)
    if pl.coord() is None:
        return whole.reshape(-1)[:0].reshape(local_shape)
    return whole[region].clone()
