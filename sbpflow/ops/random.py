"""Layout-invariant random ops on tensors (issue 3, "Randomness").

``dropout``: with the same seed the global result equals ``torch.nn.functional.dropout``
on one process, bit for bit (CPU, fp32), whatever the input's placement and SBP. Every
rank of the world draws the whole Bernoulli mask of the global shape from torch's
generator, exactly as torch's dropout does (``empty_like(x).bernoulli_(1 - p)``), and
applies its shard of it: memory is one global-shape mask per rank while it runs (under
:func:`sbpflow.random.per_shard` each rank draws only its shard's mask: cheaper, not equal
to torch's). A P input stays P (the mask is the same on every rank and dropout is linear
in ``x``).
"""

from __future__ import annotations

import torch

from .. import random as _rng
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .dispatch import dispatch
from .registry import register_algorithm
from .rules import keep

S, B, P = Split, broadcast, partial_sum


def memory_order(t: torch.Tensor) -> list[int]:
    """The dims of ``t`` from outermost to innermost in memory, when ``t`` is a dense
    permutation of a contiguous tensor (what ``torch.empty_like`` keeps); else
    ``0..ndim-1`` (empty_like makes such a tensor contiguous)."""
    order = list(range(t.ndim))
    if t.numel() == 0 or t.is_contiguous() and min(t.shape, default=2) > 1:
        return order  # (torch's is_contiguous ignores the strides of size-1 dims)
    # Outer dims first: larger stride, then (ties: a size-1 dim, as a shard of an uneven
    # split may have, has the stride of the dim it sits around) the larger span.
    perm = sorted(order, key=lambda d: (-t.stride(d), -t.stride(d) * t.size(d)))
    return perm if t.permute(perm).is_contiguous() else order


def _dropout_algorithm(call, local, *, p):
    """Every rank of the world draws the whole global mask (layout-invariant randomness;
    ranks outside the placement too, to keep the generators in step) and applies its
    shard."""
    perm = memory_order(local)
    inverse = [perm.index(d) for d in range(len(perm))]

    def mask(size, g):
        # torch draws into empty_like(x): in x's memory order when x is a dense permuted
        # view (e.g. attention's output before its transpose back), so draw that way.
        m = torch.empty([size[d] for d in perm], dtype=local.dtype, device=local.device)
        return m.bernoulli_(1 - p, generator=g).permute(inverse)

    # The shard of the global mask (a P input's ranks all hold the whole mask).
    shard = _rng.draw_shard(mask, call.metas[0].shape, call.placement, call.ins[0])
    if call.placement.coord() is None:
        return local * 0
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return local * shard * scale


# Every layout maps to itself (P too: the mask is the same on every rank and dropout is
# linear in x). ``everywhere``: ranks outside the placement draw too.
register_algorithm("dropout", kernel=lambda a, *, p: torch.nn.functional.dropout(a, p, True),
                   rule=lambda metas, attrs: keep(metas[0].ndim, ()),
                   everywhere=True)(_dropout_algorithm)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``
    (``torch.nn.functional.dropout``; registered op ``dropout``).

    Args:
        x: local or global tensor (floating dtype), any SBP; the output keeps it.
        p: drop probability in [0, 1]. training: identity when False.

    Raises:
        ValueError: ``p`` outside [0, 1].
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
    if not training or p == 0.0:
        return x
    return dispatch("dropout", x, p=float(p))
