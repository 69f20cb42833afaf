"""Ops whose output shape depends on the data: ``masked_select``, ``nonzero``,
``argwhere``, ``unique``, and the counting ops ``bincount`` and ``histc``.

On a global tensor the input is boxed to ``B`` (gathered) and every rank computes the
whole result, a ``B`` global tensor equal to torch's. ``bincount`` and ``histc`` gather
*counts* instead: the global max (bincount) or min/max (histc with ``min == max``) first
(an all-reduce), then each rank counts its shard into a fixed number of bins (``P`` over
the axes that split the input) and the counts are all-reduced to ``B``. Ranks outside the
placement hold an empty shard (and, for the data-dependent shapes, an empty global shape).
"""

from __future__ import annotations

import torch

from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .algorithms import all_b, b_result, unpartial
from .api import method
from .args import check_global_pair, norm_dim
from .dispatch import dispatch
from .registry import Meta, register

S, B, P = Split, broadcast, partial_sum


def _masked_select(self, mask):
    """``torch.masked_select``: the 1-D elements of x where the bool ``mask`` (broadcast
    with x) is True. Global: x and mask are boxed to ``B`` (the result's length depends on
    the data); the result is ``B``. Differentiable in x."""
    check_global_pair("masked_select", self, mask)
    if self.is_local:
        return Tensor(torch.masked_select(self._local, mask._local))
    x, m = all_b(self), all_b(mask)
    return b_result(torch.masked_select(x._local, m._local), x.placement)


def _nonzero(self, *, as_tuple: bool = False):
    """``torch.nonzero``: int64 ``(N, ndim)`` coordinates of the non-zero elements
    (``as_tuple``: one 1-D tensor per dim). Global: x is boxed to ``B``; results ``B``."""
    x = all_b(self)
    out = torch.nonzero(x._local, as_tuple=as_tuple)
    wrap = Tensor if self.is_local else (lambda t: b_result(t, x.placement))
    return tuple(wrap(t) for t in out) if as_tuple else wrap(out)


def _argwhere(self):
    """``torch.argwhere``: :meth:`nonzero` (``(N, ndim)`` int64)."""
    return _nonzero(self)


def _unique(self, sorted: bool = True, return_inverse: bool = False,  # noqa: A002
            return_counts: bool = False, dim=None):
    """``torch.unique``: the distinct elements (``dim``: distinct slices), sorted, with the
    inverse indices (x's shape, or ``(x.shape[dim],)``) and counts when asked. Global: x
    is boxed to ``B``; every result is ``B``. Not differentiable (as torch)."""
    x = all_b(self)
    if dim is not None:
        dim = norm_dim(dim, self.ndim)
    out = torch.unique(x._local.detach(), sorted=sorted, return_inverse=return_inverse,
                       return_counts=return_counts, dim=dim)
    wrap = Tensor if self.is_local else (lambda t: b_result(t, x.placement))
    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _bincount_rule(metas, attrs):
    """Counting a split input gives summands of the counts (P); summed weights are linear
    in the weights (B ids, P weights -> P)."""
    if len(metas) == 1:
        return [(S(0), P)]
    return [(S(0), S(0), P), (B, P, P)]


def _bincount_meta(metas, attrs):
    """torch has no meta kernel for bincount: ``(minlength,)`` (the front end passes the
    final length), int64 counts or the weights' float dtype (float64 for int weights)."""
    if len(metas) == 1:
        dtype = torch.int64
    else:
        w = metas[1].dtype
        dtype = w if w in (torch.float32, torch.float64) else torch.float64
    return Meta((attrs["minlength"],), dtype)


@register("bincount", _bincount_rule, meta=_bincount_meta)
def _bincount_kernel(a, *weights, minlength):
    return torch.bincount(a, weights[0] if weights else None, minlength)


@register("histc", lambda metas, attrs: [(S(d), P) for d in range(metas[0].ndim)])
def _histc_kernel(a, *, bins, lo, hi):
    return torch.histc(a, bins, lo, hi)


def _bincount(self, weights=None, minlength: int = 0):
    """``torch.bincount``: counts (or summed ``weights``) of each value of a 1-D
    non-negative int x, length ``max(x.max() + 1, minlength)``. Global: the max is
    all-reduced first, each rank counts its shard into that many bins (``P`` over split
    axes; x is never gathered) and the counts are all-reduced: the result is ``B``.
    Not differentiable (as torch).

    Raises:
        ValueError: x not 1-D, negative values, weights of another shape."""
    if self.ndim != 1:
        raise ValueError(f"bincount: expected a 1-D int tensor, got shape {tuple(self.shape)}")
    if weights is not None:
        check_global_pair("bincount", self, weights)
        if tuple(weights.shape) != tuple(self.shape):
            raise ValueError(f"bincount: weights of shape {tuple(weights.shape)} must match x "
                             f"of shape {tuple(self.shape)}")
    if self.is_local:
        return Tensor(torch.bincount(self._local, None if weights is None else
                                     weights._local, minlength))
    x = unpartial(self)
    if x.numel():
        if x.amin().item() < 0:
            raise ValueError("bincount: x must hold non-negative ints")
        top = int(x.amax().item()) + 1
    else:
        top = 0
    n = max(top, int(minlength))
    extra = () if weights is None else (weights.detach(),)
    return unpartial(dispatch("bincount", x.detach(), *extra, minlength=n))


def _histc(self, bins: int = 100, min=0, max=0):  # noqa: A002 - torch's names
    """``torch.histc``: a float histogram of ``bins`` equal bins over ``[min, max]``
    (``min == max``: the data's min and max; elements outside are ignored). Global: the
    min/max are all-reduced first when needed, each rank counts its shard (``P`` over split
    axes), the counts are all-reduced: the result is ``B``. Not differentiable."""
    x = unpartial(self.detach())
    lo, hi = min, max
    if lo == hi and x.numel() and x.is_global:
        lo, hi = x.amin().item(), x.amax().item()
        if lo == hi:
            lo, hi = lo - 1, hi + 1
    return unpartial(dispatch("histc", x, bins=int(bins), lo=lo, hi=hi))


# ---------------------------------------------------------------- Tensor methods
method("masked_select")(_masked_select)
method("nonzero")(_nonzero)
method("argwhere")(_argwhere)
method("unique")(_unique)
method("bincount")(_bincount)
method("histc")(_histc)

