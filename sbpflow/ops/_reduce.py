"""Reductions (issue 3): ``prod``, ``max``/``min`` (all, over a dim with ``.values`` and
``.indices``, or elementwise with another tensor), ``argmax``/``argmin``, ``var``/``std``,
``norm``, ``logsumexp``, ``all``/``any`` and ``cumsum``; ``sum``/``mean`` are registered in
:mod:`._core` (their ``dtype=`` casts through :func:`cast`, here).

Every op mirrors the torch function of the same name on local tensors (the kernel *is* the
torch call). On a global tensor, per mesh axis:

============================  ==================================================================
input SBP on the axis         output SBP on the axis, and what runs
============================  ==================================================================
``S(d)``, ``d`` kept          ``S(d')`` (``d`` renumbered when ``keepdim=False``); local only
``S(d)``, ``d`` reduced       linear ops (the sums inside ``var``, ``norm`` with p in {0, 1},
                              ``all``/``any``'s counts): ``P``, no communication, and the next
                              non-linear step all-reduces the *output-sized* summands.
                              ``max``/``min``/``arg*``/``prod``: ``B``; a local reduction, then
                              an all-gather of the per-shard results (output-sized) over that
                              axis, combined locally. ``logsumexp``: an all-reduce MAX of the
                              local maxima. ``cumsum``: stays ``S(d)``; a local cumsum plus the
                              exclusive prefix of the earlier shards' totals (an all-gather of
                              the totals). The input is never gathered.
``B``                         ``B``
``P``                         boxed to ``B`` first where the op is not linear (the max of a sum
                              is not the sum of maxima); ``cumsum`` keeps ``P``.
============================  ==================================================================

Gradients follow torch: ``max(dim)``/``min(dim)`` send the gradient to the selected element
only (the one whose index is returned), ``max()``/``amax``/``norm(p=inf)`` share it evenly
among ties. ``max(dim)`` picks, among equal extrema, the smallest global index (as torch
does), and propagates NaN (a NaN is the extremum and its index is returned).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..distributed import _comm, ensure_groups
from ..sbp import broadcast
from ..tensor import Tensor
from ._dispatch import apply
from ._extremum import _reduced_layout, check_nonempty, extremum
from ._registry import register
from ._rules import elementwise

__all__: list[str] = []


# ----------------------------------------------------------------------------- helpers
def _dims(op: str, dim, ndim: int, *, single: bool = False) -> tuple[int, ...]:
    """``dim`` (int, sequence, or None for every dim) as sorted non-negative dims.

    Raises:
        TypeError: ``dim`` is not an int (or a sequence of ints where allowed).
        ValueError: a dim outside ``[-ndim, ndim - 1]`` or a repeated dim.
    """
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (bool, float)) or not isinstance(dim, (int, tuple, list)):
        raise TypeError(f"{op}: dim must be an int{'' if single else ', a tuple of ints'} or "
                        f"None, got {dim!r}")
    if single and not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be a single int (as in torch.{op}), got {dim!r}; "
                        f"reduce one dim at a time")
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    n = max(ndim, 1)
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"{op}: dim must hold ints, got {dim!r}")
        if not -n <= d < n:
            raise ValueError(f"{op}: dim {d} is out of range for a tensor of {ndim} dims "
                             f"(expected a dim in [{-n}, {n - 1}])")
        out.append(d % n)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: dim {dim!r} names the same dim twice")
    return tuple(sorted(out)) if ndim > 0 else ()


def _unpartial(x: Tensor) -> Tensor:
    """``x`` with every P axis boxed to B (an all-reduce); other axes unchanged."""
    if x.is_global and any(s.is_partial() for s in x.sbp):
        return x.to_global(sbp=tuple(broadcast if s.is_partial() else s for s in x.sbp))
    return x




def _outside(local: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """The empty shard of a rank outside the placement, connected to ``local``'s graph (so
    that this rank's backward reaches the same boxing steps as the members')."""
    empty = (0,) * max(len(shape), 1)
    if local.requires_grad and dtype.is_floating_point:
        return local.reshape(-1)[:0].to(dtype).reshape(empty)
    return torch.empty(empty, dtype=dtype, device=local.device)


def _squeeze(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return t.squeeze(dims) if dims else t


def _gather_axis(t: torch.Tensor, pl, axis: int) -> torch.Tensor:
    """Every member's ``t`` along mesh ``axis``, stacked on a new dim 0 (mesh coordinate
    order): one all-gather of ``t``-sized pieces."""
    ranks = pl.axis_ranks(axis, pl.coord())
    src = t.to(torch.uint8) if t.dtype == torch.bool else t
    out = _comm.all_gather(src.unsqueeze(0).contiguous(), ranks, 0, [1] * len(ranks), axis=axis)
    return out.to(torch.bool) if t.dtype == torch.bool else out


class _AxisCombine(torch.autograd.Function):
    """``combined`` (the same on every member of the mesh-axis group: B on that axis) as a
    function of this rank's partial result ``part``, with elementwise derivative ``weight``.

    The output's gradient arrives as summands (P, the dual of B) and is all-reduced over the
    axis first; then ``d part = g * weight``.
    """

    @staticmethod
    def forward(ctx, part, combined, weight, ranks, axis):
        ctx.save_for_backward(weight)
        ctx.group = (ranks, axis)
        return combined.clone()

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        ranks, axis = ctx.group
        g = _comm.all_reduce(g, ranks, axis=axis)
        return g * weight, None, None, None, None


def _combine(part: torch.Tensor, combined: torch.Tensor, weight: torch.Tensor, pl, axis: int):
    if not part.requires_grad:
        return combined
    return _AxisCombine.apply(part, combined, weight, pl.axis_ranks(axis, pl.coord()), axis)


# ----------------------------------------------------------------------------- cast
def _cast_rule(metas, attrs):
    # Summands cast float -> float sum to the cast of the sum (up to rounding), and integer
    # -> integer casts wrap modulo 2^bits, which commutes with the sum; a float -> integer
    # cast rounds each summand, and a cast to or from bool is not linear: no P for those.
    src, dst = metas[0].dtype, attrs["dtype"]
    ints = not src.is_floating_point and not dst.is_floating_point and torch.bool not in (src, dst)
    linear = (src.is_floating_point and dst.is_floating_point) or ints
    return elementwise("sum" if linear else "none")(metas, attrs)


register("reduce_cast", _cast_rule)(lambda a, *, dtype: a.to(dtype))


def cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``x`` converted to ``dtype`` (``x`` itself when ``dtype`` is None or already its
    dtype): what torch's ``dtype=`` argument of reductions does before reducing. Keeps
    every split and B; keeps P between floating dtypes and between integer dtypes."""
    if dtype is None or dtype == x.dtype:
        return x
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return apply("reduce_cast", x, dtype=dtype)


# ----------------------------------------------------------------------------- prod
def _prod(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.prod``: product over ``dim`` (one int, or None for every element).

    Output dtype as torch: integer and bool inputs give int64 unless ``dtype`` is given
    (the input is cast to ``dtype`` first). SBP: a split reduced dim gives B through a
    local product and one all-gather of the per-shard products (output-sized) per mesh
    axis; P inputs are boxed to B. Gradient as torch's (zeros handled: the factor of the
    other shards is their product, never a division).

    Raises:
        TypeError: ``dim`` is not an int or None. ValueError: ``dim`` out of range.
    """
    dims = _dims("prod", dim, self.ndim, single=True)
    if self.is_local:
        t = self.to_torch()
        return Tensor(t.prod(dtype=dtype) if dim is None else t.prod(dim, keepdim, dtype=dtype))
    if dim is None and keepdim:
        raise TypeError("prod(): keepdim needs a dim, e.g. x.prod(0, keepdim=True)")
    x = _unpartial(self)
    pl = x.placement
    axes, out_sbp, shape = _reduced_layout(x, dims, keepdim)
    local = x.to_local().to_torch()
    out_dtype = torch.empty(0, dtype=x.dtype).prod(dtype=dtype).dtype
    if pl.coord() is None:
        return Tensor(_outside(local, shape, out_dtype), pl, out_sbp, shape)
    if dim is None:
        p = local.prod(dtype=dtype).reshape([1] * local.ndim)
    else:
        p = local.prod(dims[0], keepdim=True, dtype=dtype)
    for a in axes:
        with torch.no_grad():
            gp = _gather_axis(p.detach(), pl, a)
            me = pl.coord()[a]
            total = gp.prod(0)
            others = torch.cat([gp[:me], gp[me + 1:]]).prod(0)
        p = _combine(p, total, others, pl, a)
    return Tensor(p if keepdim else _squeeze(p, dims), pl, out_sbp, shape)


# ----------------------------------------------------------------------------- max / min
def _fill(kind: str, dtype: torch.dtype):
    """The identity of max (``kind="max"``) or min for ``dtype``: what an empty shard holds."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return -math.inf if kind == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def _local_select(local: torch.Tensor, kind: str, dims, starts, sizes):
    """Values and *global* flat indices (over the reduced dims, row-major in the global
    sizes ``sizes``) of the max/min of this shard over ``dims``, keepdim shapes. ``starts``
    are the shard's global offsets along ``dims``. An empty shard gives the identity
    and an index past every element."""
    nd = local.ndim
    kept = [d for d in range(nd) if d not in dims]
    flat = local.permute(kept + list(dims)).reshape(  # (kept..., reduced elements)
        *(local.shape[d] for d in kept), math.prod(local.shape[d] for d in dims))
    keep_shape = [1 if d in dims else local.shape[d] for d in range(nd)]
    if flat.shape[-1] == 0:
        v = torch.full((*flat.shape[:-1], 1), _fill(kind, local.dtype), dtype=local.dtype,
                       device=local.device)
        if local.requires_grad:
            v = v + flat.sum(-1, keepdim=True) * 0
        gi = torch.full_like(v, math.prod(sizes), dtype=torch.int64)
        return v.reshape(keep_shape), gi.reshape(keep_shape)
    v, li = (flat.max if kind == "max" else flat.min)(-1, keepdim=True)
    gi = torch.zeros_like(li)
    rem, coords = li, []
    for d in reversed(dims):
        coords.append(rem % local.shape[d])
        rem = rem // local.shape[d]
    for c, st, n in zip(reversed(coords), starts, sizes):
        gi = gi * n + (c + st)
    return v.reshape(keep_shape), gi.reshape(keep_shape)


def _combine_select(v, gi, kind: str, pl, axis: int):
    """Combine the per-shard (value, global index) of max/min over mesh ``axis``: the
    extremum (NaN wins), and among equal values the smallest index; the gradient goes to
    the shard whose index wins."""
    with torch.no_grad():
        gv, ggi = _gather_axis(v.detach(), pl, axis), _gather_axis(gi, pl, axis)
        cmp = gv.to(torch.uint8) if gv.dtype == torch.bool else gv
        best = cmp.amax(0) if kind == "max" else cmp.amin(0)
        tie = cmp == best
        if cmp.is_floating_point():
            tie |= cmp.isnan() & best.isnan()
        chosen = torch.where(tie, ggi, torch.iinfo(torch.int64).max).amin(0)
        best = best.to(v.dtype)
        weight = (gi == chosen).to(v.dtype) if v.is_floating_point() else None
    return _combine(v, best, weight, pl, axis), chosen


def _select(x: Tensor, kind: str, dims: tuple[int, ...], keepdim: bool):
    """(values, indices) of max/min of global ``x`` over ``dims``; indices are flat over the
    reduced dims (one dim: the index along it). Both laid out as the reduction's output."""
    check_nonempty(x, kind, dims)
    x = _unpartial(x)
    pl = x.placement
    axes, out_sbp, shape = _reduced_layout(x, dims, keepdim)
    local = x.to_local().to_torch()
    if pl.coord() is None:
        return (Tensor(_outside(local, shape, x.dtype), pl, out_sbp, shape),
                Tensor(_outside(local, shape, torch.int64), pl, out_sbp, shape))
    slices = pl.shard_slices(tuple(x.shape), x.sbp)
    v, gi = _local_select(local, kind, dims, [slices[d].start for d in dims],
                          [x.shape[d] for d in dims])
    for a in axes:
        v, gi = _combine_select(v, gi, kind, pl, a)
    if not keepdim:
        v, gi = _squeeze(v, dims), _squeeze(gi, dims)
    return Tensor(v, pl, out_sbp, shape), Tensor(gi, pl, out_sbp, shape)


def _extremum_method(kind: str):
    fn = torch.max if kind == "max" else torch.min
    binary = "maximum" if kind == "max" else "minimum"
    ret = torch.return_types.max if kind == "max" else torch.return_types.min

    def method(self, dim=None, keepdim: bool = False, *, other=None):
        if isinstance(dim, Tensor) or other is not None:
            return apply(binary, self, dim if other is None else other)
        if dim is None:
            if keepdim:
                raise TypeError(f"{kind}(): keepdim needs a dim, e.g. x.{kind}(0, keepdim=True)")
            if self.is_local:
                return Tensor(fn(self.to_torch()))
            if self.dtype.is_floating_point:
                return extremum(self, kind)
            return _select(self, kind, _dims(kind, None, self.ndim), False)[0]
        dims = _dims(kind, dim, self.ndim, single=True)
        if self.is_local:
            out = fn(self.to_torch(), dim, keepdim)
            return ret((Tensor(out.values), Tensor(out.indices)))
        return ret(_select(self, kind, dims, keepdim))

    method.__name__ = kind
    method.__doc__ = f"""``torch.{kind}``, in its three forms.

    * ``x.{kind}()``: the {kind} of every element (0-dim). Gradient shared evenly among
      ties (torch's rule); on a split input an all-reduce {kind.upper()}, not a gather.
    * ``x.{kind}(dim, keepdim=False)``: ``torch.return_types.{kind}`` with ``.values`` and
      ``.indices`` (int64, global indices along ``dim``; among equal values the first;
      NaN propagates). Gradient to the selected element only. On a split ``dim``: a local
      {kind} and argument, the shard's offset added, then an all-gather of the
      (output-sized) per-shard results over that mesh axis; both outputs are B there,
      kept split dims stay split, P inputs are boxed to B.
    * ``x.{kind}(other)`` (a Tensor): elementwise ``torch.{binary}`` with broadcasting.

    Raises:
        TypeError: ``dim`` not an int; ``keepdim`` without ``dim``.
        ValueError: ``dim`` out of range.
    """
    return method


def _arg_method(kind: str):
    name = f"arg{kind}"
    fn = torch.argmax if kind == "max" else torch.argmin

    def method(self, dim=None, keepdim: bool = False):
        dims = _dims(name, dim, self.ndim, single=True)
        if self.is_local:
            return Tensor(fn(self.to_torch(), dim, keepdim))
        # dim=None: every dim is reduced and the index is flat over the whole tensor.
        return _select(self, kind, dims, keepdim)[1]

    method.__name__ = name
    method.__doc__ = f"""``torch.{name}``: the int64 index of the first {kind} along ``dim``
    (``None``: the index into the flattened tensor; ``keepdim`` then keeps every dim as 1).
    Global: as ``x.{kind}(dim).indices`` (an all-gather of output-sized per-shard results
    over each mesh axis that splits a reduced dim; output B there).

    Raises:
        TypeError: ``dim`` not an int or None. ValueError: ``dim`` out of range.
    """
    return method


# ----------------------------------------------------------------------------- var / std
def _correction(op: str, unbiased, correction) -> float:
    if unbiased is not None and correction is not None:
        raise TypeError(f"{op}: give either unbiased= or correction=, not both "
                        f"(unbiased=True is correction=1, unbiased=False is correction=0)")
    if correction is not None:
        if isinstance(correction, bool) or not isinstance(correction, numbers.Real):
            raise TypeError(f"{op}: correction must be a number, got {correction!r}")
        return correction
    return 1 if unbiased is None else int(bool(unbiased))


def _variance(x: Tensor, op: str, dim, unbiased, keepdim, correction) -> Tensor:
    if isinstance(dim, bool):  # torch's var(unbiased) form
        dim, unbiased = None, dim
    c = _correction(op, unbiased, correction)
    dims = _dims(op, dim, x.ndim)
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(f"{op}: only floating point inputs are supported, got {x.dtype}; "
                        f"cast first (x.to(torch.float32))")
    if x.is_local:
        fn = torch.std if op == "std" else torch.var
        return Tensor(fn(x.to_torch(), dims, correction=c, keepdim=keepdim))
    x = _unpartial(x)
    n = math.prod(x.shape[d] for d in dims)
    # Two passes, as torch: the mean (P over a split reduced dim, all-reduced: output-sized),
    # then the sum of squared deviations (P), divided by max(0, n - correction).
    mu = _unpartial(apply("mean", x, dim=dims, keepdim=True, count=n))
    d = x - mu
    var = apply("sum", d * d, dim=dims, keepdim=keepdim) / max(0, n - c)
    return var.sqrt() if op == "std" else var


def _var(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    """``torch.var`` over ``dim`` (int, tuple, None: all) with Bessel's ``correction``
    (default 1; ``unbiased=False`` is 0); torch's forms ``var(dim, unbiased, keepdim)``,
    ``var(unbiased)`` and ``var(dim, correction=c, keepdim=...)`` all work.

    Exact under uneven splits: two passes, the global mean (an all-reduce of the
    output-sized mean when a reduced dim is split) then the sum of squared deviations,
    which is left P over a split reduced dim. Divides by ``max(0, N - correction)`` (so
    ``N <= correction`` gives inf/nan as torch does).

    Raises:
        TypeError: a non-floating input; both ``unbiased`` and ``correction``.
        ValueError: ``dim`` out of range or repeated.
    """
    return _variance(self, "var", dim, unbiased, keepdim, correction)


def _std(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    """``torch.std``: ``var(...).sqrt()`` (same arguments and errors as :meth:`var`); the
    square root needs the whole variance, so a P variance is all-reduced (output-sized)."""
    return _variance(self, "std", dim, unbiased, keepdim, correction)


# ----------------------------------------------------------------------------- norm
class _Root(torch.autograd.Function):
    """``s ** (1 / p)`` for ``s >= 0`` with a zero gradient where ``s == 0`` (torch's
    vector-norm backward masks a zero norm the same way)."""

    @staticmethod
    def forward(ctx, s, p):
        out = s.pow(1.0 / p)
        ctx.save_for_backward(s, out)
        ctx.p = p
        return out

    @staticmethod
    def backward(ctx, g):
        s, out = ctx.saved_tensors
        grad = g * out / (s * ctx.p)
        return torch.where(s == 0, torch.zeros_like(grad), grad), None


def _norm_term(a, *, p, dtype=None):
    """``|a| ** p`` elementwise (``p == 0``: 1 where ``a != 0``, gradient zero)."""
    if dtype is not None:
        a = a.to(dtype)
    if p == 0:
        zero_grad = torch.where(torch.zeros_like(a, dtype=torch.bool), a, 0)
        return (a != 0).to(a.dtype) + zero_grad
    if p == 1:
        return a.abs()
    return a.abs().pow(p)


register("norm_term", elementwise())(_norm_term)
register("norm_root", elementwise())(lambda s, *, p: _Root.apply(s, p))


def _norm(self, p="fro", dim=None, keepdim: bool = False, dtype=None):
    """Vector norm, as ``torch.norm`` / ``torch.linalg.vector_norm``: ``p`` = 2 or
    ``'fro'`` (with ``dim`` None or up to 2 dims: the 2-norm of those elements), 1,
    ``inf`` (max |x|), ``-inf`` (min |x|), 0 (count of non-zeros), any other float
    (``sum(|x|^p)^(1/p)``); ``None`` is 2. ``dtype`` casts the input first.

    SBP: ``|x|^p`` is elementwise and its sum over a split reduced dim is P (no comm); p in
    {0, 1} stop there (P output), other p take the root of the all-reduced (output-sized)
    sum (B); inf/-inf run an all-reduce MAX/MIN. P inputs are boxed to B. Gradient as
    torch's (zero at a zero norm).

    Raises:
        TypeError: a non-floating input (as torch). ValueError: ``p`` is ``'nuc'`` or
        another matrix norm, or ``'fro'`` over more than 2 dims; ``dim`` out of range.
    """
    if isinstance(p, str):
        if p != "fro":
            raise ValueError(f"norm: p={p!r} is a matrix norm, which is not supported; "
                             f"use p='fro', a number, inf or -inf (vector norms)")
        if dim is not None and not isinstance(dim, int) and len(dim) > 2:
            raise ValueError(f"norm: p='fro' takes at most 2 dims, got dim={dim!r}")
        p = 2.0
    elif p is None:
        p = 2.0
    elif isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"norm: p must be a number, inf, -inf or 'fro', got {p!r}")
    dims = _dims("norm", dim, self.ndim)
    want = dtype if dtype is not None else self.dtype
    if not (want.is_floating_point or want.is_complex):
        raise TypeError(f"norm: expected a floating point input (or dtype=), got {self.dtype}; "
                        f"cast first (x.to(torch.float32))")
    if self.is_local:
        return Tensor(torch.linalg.vector_norm(self.to_torch(), p, dims, keepdim, dtype=dtype))
    x = _unpartial(self)
    if math.isinf(p):
        a = apply("norm_term", x, p=1, dtype=dtype)
        return extremum(a, "max" if p > 0 else "min", dims, keepdim)
    s = apply("sum", apply("norm_term", x, p=p, dtype=dtype), dim=dims, keepdim=keepdim)
    return s if p in (0, 1) else apply("norm_root", s, p=float(p))


# ----------------------------------------------------------------------------- logsumexp
def _logsumexp(self, dim, keepdim: bool = False):
    """``torch.logsumexp``: ``log(sum(exp(x)))`` over ``dim`` (int or tuple), computed as
    ``m + log(sum(exp(x - m)))`` with ``m`` the max (0 where it is infinite, as torch).
    Integer inputs give the default float dtype.

    SBP: ``m`` is a local max plus an all-reduce MAX over the mesh axes that split a
    reduced dim (output-sized, not a gather); the sum is P there and the log all-reduces
    it (output-sized). Output B on those axes; kept split dims stay split; P inputs are
    boxed to B. Gradient ``softmax(x)`` (``m`` is a constant).

    Raises:
        ValueError: ``dim`` out of range or repeated.
    """
    dims = _dims("logsumexp", dim, self.ndim)
    if self.is_local:
        return Tensor(torch.logsumexp(self.to_torch(), dims, keepdim))
    x = _unpartial(self)
    if not x.dtype.is_floating_point:
        x = cast(x, torch.get_default_dtype())
    pl = x.placement
    axes, keep_sbp, keep_shape = _reduced_layout(x, dims, True)
    _, out_sbp, out_shape = _reduced_layout(x, dims, keepdim)
    local = x.to_local().to_torch()
    with torch.no_grad():
        if pl.coord() is None:
            m = _outside(local, keep_shape, x.dtype).detach()
        else:
            if local.numel() == 0 or any(local.shape[d] == 0 for d in dims):
                m = torch.full([1 if d in dims else n for d, n in enumerate(local.shape)],
                               -math.inf, dtype=local.dtype, device=local.device)
            else:
                m = local.amax(dims, keepdim=True)
            for a in axes:
                m = _comm.all_reduce(m, pl.axis_ranks(a, pl.coord()), axis=a, op="max")
            m = torch.where(m.isinf(), torch.zeros_like(m), m)
    m_keep = Tensor(m, pl, keep_sbp, keep_shape)
    m_out = Tensor(m if keepdim or pl.coord() is None else _squeeze(m, dims), pl, out_sbp,
                   out_shape)
    s = apply("sum", (x - m_keep).exp(), dim=dims, keepdim=keepdim)
    return s.log() + m_out


# ----------------------------------------------------------------------------- all / any
def _logical(kind: str):
    fn = torch.all if kind == "all" else torch.any

    def method(self, dim=None, keepdim: bool = False):
        dims = _dims(kind, dim, self.ndim)
        if self.is_local:
            t = self.to_torch()
            return Tensor(fn(t) if dim is None and not keepdim else fn(t, dims, keepdim))
        # Count the elements that decide (zeros for all, non-zeros for any): a sum, P over
        # a split reduced dim, then one comparison that all-reduces the int64 counts.
        hits = self == 0 if kind == "all" else self != 0
        count = apply("sum", hits, dim=dims, keepdim=keepdim)
        out = count == 0 if kind == "all" else count > 0
        return cast(out, torch.uint8) if self.dtype == torch.uint8 else out

    method.__name__ = kind
    method.__doc__ = f"""``torch.{kind}``: whether {kind} elements over ``dim`` (int, tuple,
    None: every element) are non-zero (NaN counts as non-zero). Output bool (uint8 for
    uint8 inputs, as torch).

    Global: a count of the deciding elements, P over a split reduced dim (no comm), then
    one all-reduce of the int64 counts (output-sized); output B there, kept split dims
    stay split, P inputs are boxed to B first.

    Raises:
        ValueError: ``dim`` out of range or repeated.
    """
    return method


# ----------------------------------------------------------------------------- cumsum
def _prefix_pass(t: torch.Tensor, pl, axes, suffix: bool) -> torch.Tensor:
    """For each rank, the sum of ``t`` over the shards *before* it (``suffix``: after it)
    in the global order of a dim split over mesh ``axes`` (mesh axis 0 outermost): one
    all-gather of ``t``-sized totals per axis, innermost axis first."""
    coord = pl.coord()
    acc = torch.zeros_like(t)
    for a in reversed(axes):
        g = _gather_axis(t, pl, a)
        me = coord[a]
        acc = acc + (g[me + 1:] if suffix else g[:me]).sum(0)
        t = g.sum(0)
    return acc


class _ExclusivePrefix(torch.autograd.Function):
    """The offset of each shard's local cumsum: the sum of the earlier shards' totals. It
    is linear; its adjoint gives each shard the sum of the later shards' gradients."""

    @staticmethod
    def forward(ctx, total, pl, axes):
        ctx.meta = (pl, axes)
        return _prefix_pass(total, pl, axes, suffix=False)

    @staticmethod
    def backward(ctx, g):
        pl, axes = ctx.meta
        return _prefix_pass(g.contiguous(), pl, axes, suffix=True), None, None


def _cumsum(self, dim, *, dtype=None):
    """``torch.cumsum`` along ``dim`` (``dtype`` casts the input first; integer and bool
    inputs give int64 as torch).

    SBP: the output keeps the input's layout. Along a split ``dim`` each shard adds to its
    local cumsum the sum of the earlier shards' totals (an all-gather of the output-sized
    totals per mesh axis splitting ``dim``, not of the input); backward does the same with
    the later shards' gradient totals. P stays P (cumsum is linear).

    Raises:
        TypeError: ``dim`` not an int. ValueError: ``dim`` out of range.
    """
    (d,) = _dims("cumsum", dim, self.ndim, single=True) or (0,)
    if self.is_local:
        return Tensor(torch.cumsum(self.to_torch(), dim, dtype=dtype))
    pl = self.placement
    axes = tuple(a for a, s in enumerate(self.sbp) if s.is_split() and s.dim == d)
    for a in axes:
        ensure_groups(pl.axis_groups(a))
    local = self.to_local().to_torch()
    out_dtype = torch.empty(0, dtype=self.dtype).cumsum(0, dtype=dtype).dtype
    if pl.coord() is None:
        return Tensor(_outside(local, self.shape, out_dtype), pl, self.sbp, self.shape)
    out = torch.cumsum(local, d, dtype=dtype)
    if axes:
        total = local.sum(d, keepdim=True, dtype=out.dtype)
        out = out + _ExclusivePrefix.apply(total, pl, axes)
    return Tensor(out, pl, self.sbp, self.shape)


# ----------------------------------------------------------------------------- table
# Tensor methods contributed by this module (installed by sbpflow.ops._methods.install);
# ``sbpflow.<name>(x, ...)`` is generated from each.
METHODS: dict = {
    "all": _logical("all"),
    "any": _logical("any"),
    "argmax": _arg_method("max"),
    "argmin": _arg_method("min"),
    "cumsum": _cumsum,
    "logsumexp": _logsumexp,
    "max": _extremum_method("max"),
    "min": _extremum_method("min"),
    "norm": _norm,
    "prod": _prod,
    "std": _std,
    "var": _var,
}
