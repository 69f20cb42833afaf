"""SBP: how a global tensor is laid out over one mesh axis of its placement.

Three layouts, one per mesh axis (OneFlow's vocabulary):

========== ====== =================================================================
value      repr   each rank along that mesh axis holds
========== ====== =================================================================
split(d)   S(d)   a contiguous slice of tensor dim ``d`` (uneven: the first
                  ``size % n`` ranks hold one more element)
broadcast  B      the whole value (replicated)
partial_sum P     a summand; the value is the sum over the axis
========== ====== =================================================================

``broadcast`` and ``partial_sum`` are values that may also be called (``broadcast()`` is
``broadcast``), as OneFlow code writes them both ways; ``split(d)`` is a function. ``sbp``
is OneFlow's name of the type (:class:`SBP`).

An *nd-SBP* is a tuple with one entry per mesh axis. A dim split on several mesh
axes is split hierarchically, mesh axis 0 outermost (see :func:`sbpflow.placement.shard_slices`).

The gradient of a tensor is laid out in the *dual* of its SBP:
``dual(S(d)) = S(d)``, ``dual(B) = P``, ``dual(P) = B`` (ARCHITECTURE "Autograd: the dual rule").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SBP",
    "Split",
    "Broadcast",
    "PartialSum",
    "split",
    "broadcast",
    "partial_sum",
    "sbp",
    "dual",
    "normalize_nd_sbp",
    "format_nd_sbp",
]


class SBP:
    """Base class of the three SBP values; frozen and hashable."""

    __slots__ = ()

    def is_split(self) -> bool:
        return False

    def is_broadcast(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Split(SBP):
    """``S(dim)``: each rank on the mesh axis holds a contiguous slice of ``dim``."""

    dim: int

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(
                f"S(dim) takes an int dim, got {self.dim!r} ({type(self.dim).__name__})")

    def is_split(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast(SBP):
    """``B``: each rank on the mesh axis holds the whole value."""

    def is_broadcast(self) -> bool:
        return True

    def __call__(self) -> Broadcast:
        """``broadcast()`` is ``broadcast`` (OneFlow code writes both)."""
        return self

    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class PartialSum(SBP):
    """``P``: each rank on the mesh axis holds a summand; the value is their sum."""

    def is_partial(self) -> bool:
        return True

    def __call__(self) -> PartialSum:
        """``partial_sum()`` is ``partial_sum`` (OneFlow code writes both)."""
        return self

    def __repr__(self) -> str:
        return "P"


broadcast = Broadcast()
partial_sum = PartialSum()

#: OneFlow's name of the SBP type (``isinstance(s, oneflow.sbp.sbp)``).
sbp = SBP


def split(dim: int) -> Split:
    """Return ``S(dim)``, the layout that splits tensor dim ``dim`` over a mesh axis.

    ``dim`` may be negative; it is normalised against the tensor's rank when the
    layout is applied to a tensor. Raises ``TypeError`` if ``dim`` is not an int.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"sbp.split(dim) takes an int, got {dim!r} ({type(dim).__name__})")
    return Split(int(dim))


def dual(s: SBP) -> SBP:
    """The layout of the gradient of a tensor laid out as ``s``: S(d)->S(d), B->P, P->B."""
    if s.is_broadcast():
        return partial_sum
    if s.is_partial():
        return broadcast
    return s


def normalize_nd_sbp(sbp, mesh_ndim: int, tensor_ndim: int | None = None) -> tuple[SBP, ...]:
    """Turn ``sbp`` (one SBP or a sequence, one per mesh axis) into a checked nd-SBP tuple.

    With ``tensor_ndim`` given, negative split dims are normalised and out-of-range
    ones raise ``ValueError``. A single SBP on an N-D mesh is an error (say one per
    mesh axis), except on a 1-D mesh.
    """
    if isinstance(sbp, SBP):
        items: Sequence = (sbp,)
    elif isinstance(sbp, Sequence) and not isinstance(sbp, str):
        items = tuple(sbp)
    else:
        raise TypeError(
            f"sbp must be an SBP (sbpflow.sbp.split(d), broadcast, partial_sum) or a "
            f"sequence of them, one per mesh axis; got {sbp!r}"
        )
    for s in items:
        if not isinstance(s, SBP):
            raise TypeError(
                f"sbp entries must be sbpflow.sbp values (split(d), broadcast, partial_sum); "
                f"got {s!r} ({type(s).__name__}) in {sbp!r}"
            )
    if len(items) != mesh_ndim:
        raise ValueError(
            f"nd-SBP {format_nd_sbp(items)} has {len(items)} entries but the placement's mesh "
            f"has {mesh_ndim} axes; give one SBP per mesh axis"
        )
    if tensor_ndim is None:
        return tuple(items)
    out = []
    for s in items:
        if s.is_split():
            d = s.dim
            if tensor_ndim == 0:
                raise ValueError(f"{s!r} cannot split a 0-dim tensor; use broadcast or "
                                 f"partial_sum for scalars")
            if not -tensor_ndim <= d < tensor_ndim:
                raise ValueError(
                    f"{s!r} splits dim {d}, but the tensor has {tensor_ndim} dims "
                    f"(valid: {-tensor_ndim}..{tensor_ndim - 1})"
                )
            s = Split(d % tensor_ndim)
        out.append(s)
    return tuple(out)


def format_nd_sbp(nd_sbp) -> str:
    """``(S(0), B)`` style string for an nd-SBP."""
    return "(" + ", ".join(repr(s) for s in nd_sbp) + ("," if len(nd_sbp) == 1 else "") + ")"
