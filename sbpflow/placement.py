"""Placement: the ranks a global tensor lives on, arranged as a device mesh.

``placement("cpu", [0, 1, 2, 3])`` is a 1-D mesh of 4 ranks;
``placement("cuda", [[0, 1], [2, 3]])`` is a 2x2 mesh (mesh axis 0 has the rows).

This module also holds the one function that maps (global shape, mesh, nd-SBP,
mesh coordinate) to the slice of the global tensor a rank holds:
:func:`shard_slices`. Everything else calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from . import distributed as _dist
from .sbp import SBP

__all__ = ["placement", "shard_slices", "shard_shape", "split_sizes"]

_TYPES = ("cpu", "cuda")


def split_sizes(size: int, n: int) -> list[int]:
    """Sizes of ``n`` contiguous parts of a dim of ``size``: the first ``size % n`` get one more.

    ``split_sizes(10, 4) == [3, 3, 2, 2]`` (ARCHITECTURE "Placement and SBP").
    """
    base, extra = divmod(size, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _split_range(start: int, length: int, n: int, i: int) -> tuple[int, int]:
    base, extra = divmod(length, n)
    return start + i * base + min(i, extra), base + (1 if i < extra else 0)


def shard_slices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    nd_sbp: Sequence[SBP],
    coord: Sequence[int] | None,
) -> tuple[slice, ...]:
    """The slice of the global tensor held at mesh coordinate ``coord``.

    Args:
        shape: global shape ``(d0, d1, ...)``.
        mesh_shape: the placement's mesh shape, e.g. ``(2, 2)``.
        nd_sbp: one SBP per mesh axis, split dims already non-negative.
        coord: the rank's mesh coordinate, or ``None`` for a rank outside the placement
            (which holds an empty shard: every slice is ``slice(0, 0)``).

    Returns:
        One ``slice`` per tensor dim. ``S(d)`` on mesh axis ``a`` splits the current range
        of dim ``d`` into ``mesh_shape[a]`` parts (uneven: first parts one longer); axes are
        applied in order, mesh axis 0 outermost, so dim 6 under ``(S(0), S(0))`` on a 2x2
        mesh gives ranges of 2, 1, 2, 1. ``B`` and ``P`` keep the whole range.
    """
    if coord is None:
        return tuple(slice(0, 0) for _ in shape)
    if len(coord) != len(mesh_shape) or not all(0 <= c < m for c, m in zip(coord, mesh_shape)):
        raise ValueError(f"mesh coordinate {tuple(coord)} is not on a mesh of shape "
                         f"{tuple(mesh_shape)}")
    if len(nd_sbp) != len(mesh_shape):
        raise ValueError(f"{len(nd_sbp)} SBP entries for a mesh of {len(mesh_shape)} axes")
    ranges = [(0, int(s)) for s in shape]
    for axis, s in enumerate(nd_sbp):
        if s.is_split():
            start, length = ranges[s.dim]
            ranges[s.dim] = _split_range(start, length, mesh_shape[axis], coord[axis])
    return tuple(slice(a, a + n) for a, n in ranges)


def shard_shape(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    nd_sbp: Sequence[SBP],
    coord: Sequence[int] | None,
) -> tuple[int, ...]:
    """Shape of the shard at ``coord`` (see :func:`shard_slices`).

    A rank outside the placement (``coord is None``) holds an empty shard of shape
    ``(0,) * ndim`` (``(0,)`` for a 0-dim tensor).
    """
    if coord is None:
        return (0,) * max(len(shape), 1)
    return tuple(s.stop - s.start for s in shard_slices(shape, mesh_shape, nd_sbp, coord))


def _to_array(ranks) -> np.ndarray:
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, np.ndarray):
        arr = ranks
    else:
        try:
            arr = np.array(ranks, dtype=object)
        except ValueError as e:  # numpy refuses some ragged nestings outright
            raise ValueError(f"placement ranks {ranks!r} are ragged: {e}") from None
    if arr.dtype == object:
        flat = arr.reshape(-1)
        if any(isinstance(v, (list, tuple, np.ndarray)) for v in flat):
            raise ValueError(
                f"placement ranks {ranks!r} are a ragged nested list; every row of the mesh "
                f"must have the same length (e.g. [[0, 1], [2, 3]])"
            )
    if arr.size == 0:
        raise ValueError(f"placement ranks {ranks!r} are empty; give at least one rank")
    out = np.empty(arr.shape, dtype=np.int64)
    for idx, v in np.ndenumerate(arr):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"placement ranks must be ints; got {v!r} in {ranks!r}")
        out[idx] = int(v)
    return out


class placement:  # noqa: N801 - OneFlow's spelling
    """The ranks of a global tensor, as a device mesh. Frozen, hashable, printable.

    Args:
        type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; the rank's device is ``cuda:LOCAL_RANK``).
        ranks: an int, a (nested) list or a numpy array of global ranks; its array shape
            is the mesh shape (``[0, 1, 2, 3]`` is 1-D of 4, ``[[0, 1], [2, 3]]`` is 2x2).

    Attributes:
        type (str), ranks (numpy int64 array in mesh shape, read-only), shape (mesh shape
        tuple), ndim (number of mesh axes), size (number of ranks).

    Raises:
        ValueError: unknown type, empty or ragged ranks, duplicate ranks, negative ranks,
            or ranks outside the world (``rank >= world_size``).
        TypeError: ranks that are not ints.
    """

    __slots__ = ("_type", "_ranks", "_key", "__dict__")

    def __init__(self, type: str, ranks):  # noqa: A002 - OneFlow's argument name
        if type not in _TYPES:
            raise ValueError(f"placement type must be one of {_TYPES}, got {type!r}")
        if isinstance(ranks, (int, np.integer)) and not isinstance(ranks, bool):
            ranks = [int(ranks)]
        arr = _to_array(ranks)
        flat = arr.reshape(-1).tolist()
        dup = sorted({r for r in flat if flat.count(r) > 1})
        if dup:
            raise ValueError(f"placement ranks {arr.tolist()} repeat rank(s) {dup}; each rank once")
        if min(flat) < 0:
            raise ValueError(f"placement ranks {arr.tolist()} hold a negative rank")
        world = _dist.get_world_size()
        outside = [r for r in flat if r >= world]
        if outside:
            raise ValueError(
                f"placement ranks {arr.tolist()} name rank(s) {outside} outside the world of "
                f"{world} rank(s) (valid: 0..{world - 1}); launch more ranks "
                f"(sbpflow launch --nproc-per-node N) or use fewer"
            )
        arr.setflags(write=False)
        object.__setattr__(self, "_type", type)
        object.__setattr__(self, "_ranks", arr)
        object.__setattr__(self, "_key", (type, arr.shape, tuple(flat)))

    def __setattr__(self, name, value):
        raise AttributeError("placement is immutable")

    @classmethod
    def all(cls, type: str) -> placement:  # noqa: A002
        """A 1-D placement over every rank of the world."""
        return cls(type, list(range(_dist.get_world_size())))

    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> np.ndarray:
        return self._ranks

    @property
    def shape(self) -> tuple[int, ...]:
        return self._ranks.shape

    @property
    def ndim(self) -> int:
        return self._ranks.ndim

    @property
    def size(self) -> int:
        return self._ranks.size

    @cached_property
    def rank_list(self) -> tuple[int, ...]:
        """The ranks in mesh (row-major) order."""
        return self._key[2]

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        return {int(r): tuple(int(i) for i in idx) for idx, r in np.ndenumerate(self._ranks)}

    def coord(self, rank: int | None = None) -> tuple[int, ...] | None:
        """Mesh coordinate of ``rank`` (default: this process's rank); ``None`` if outside."""
        return self._coords.get(_dist.get_rank() if rank is None else rank)

    def __contains__(self, rank: int) -> bool:
        return rank in self._coords

    def rank_at(self, coord: Sequence[int]) -> int:
        return int(self._ranks[tuple(coord)])

    def axis_ranks(self, axis: int, coord: Sequence[int]) -> tuple[int, ...]:
        """The ranks along mesh axis ``axis`` through ``coord``, in coordinate order."""
        idx = list(coord)
        idx[axis] = slice(None)
        return tuple(int(r) for r in self._ranks[tuple(idx)])

    def axis_groups(self, axis: int) -> list[tuple[int, ...]]:
        """Every group of ranks along mesh axis ``axis`` (each in coordinate order)."""
        moved = np.moveaxis(self._ranks, axis, -1).reshape(-1, self.shape[axis])
        return [tuple(int(r) for r in row) for row in moved]

    @property
    def device(self) -> torch.device:
        """This rank's torch device for this placement (``cpu`` or ``cuda:LOCAL_RANK``).

        Raises ``RuntimeError`` for a cuda placement where torch sees no CUDA device.
        """
        if self._type == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{self!r} needs CUDA, but this torch ({torch.__version__}) sees no CUDA device; "
                f"use placement('cpu', ...) here, or a CUDA build of torch on a GPU machine")
        return torch.device("cuda", _dist.get_local_rank() % max(torch.cuda.device_count(), 1))

    def shard_slices(self, shape, nd_sbp, rank: int | None = None) -> tuple[slice, ...]:
        """:func:`shard_slices` for ``rank`` (default: this process) on this placement."""
        return shard_slices(shape, self.shape, nd_sbp, self.coord(rank))

    def shard_shape(self, shape, nd_sbp, rank: int | None = None) -> tuple[int, ...]:
        """:func:`shard_shape` for ``rank`` (default: this process) on this placement."""
        return shard_shape(shape, self.shape, nd_sbp, self.coord(rank))

    def __eq__(self, other) -> bool:
        return isinstance(other, placement) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"placement(type={self._type!r}, ranks={self._ranks.tolist()})"

    def __reduce__(self):
        return (placement, (self._type, self._ranks.tolist()))
