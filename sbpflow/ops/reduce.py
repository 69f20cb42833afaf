"""Reductions: ``sum``, ``mean``, ``prod``, ``amax``/``amin``, ``max``/``min`` (all, over
a dim with ``.values`` and ``.indices``, or elementwise with another tensor),
``argmax``/``argmin``, ``aminmax``, ``var``/``std`` (and ``*_mean``), ``norm``,
``logsumexp``, ``all``/``any``, ``nansum``/``nanmean``, ``count_nonzero``.

Every op mirrors the torch function of the same name on local tensors (the kernel *is* the
torch call). On a global tensor, per mesh axis:

============================  ==================================================================
input SBP on the axis         output SBP on the axis, and what runs
============================  ==================================================================
``S(d)``, ``d`` kept          ``S(d')`` (``d`` renumbered when ``keepdim=False``); local only
``S(d)``, ``d`` reduced       ``sum``/``mean`` and the sums inside ``var``, ``norm`` with p in
                              {0, 1}, ``all``/``any``'s counts: ``P``, no communication, and the
                              next non-linear step all-reduces the *output-sized* summands.
                              Global algorithms (registered ops that run their own
                              collectives): ``amax``/``amin``: ``B`` by an all-reduce MAX/MIN of
                              the local results; ``max``/``min``/``argmax``/``argmin``/``prod``:
                              ``B`` by an all-gather of the output-sized per-shard results,
                              combined locally. ``logsumexp``: ``amax``, then a sum (P) that
                              the log all-reduces. The input is never gathered.
``B``                         ``B``
``P``                         boxed away first where the op is not linear (the max of a sum is
                              not the sum of maxima): the chooser takes the cheapest of an
                              all-reduce to B or a reduce-scatter to a split it can reduce
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

from ..distributed import all_reduce
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .algorithms import combine, gather_axis, squeeze_dims, unpartial
from .api import function, method
from .args import norm_dims
from .cast import cast, in_float32
from .chooser import axis_collectives_cost, split_axes
from .dispatch import dispatch
from .pointwise import where
from .registry import register, register_algorithm
from .rules import elementwise, reduction

S, B, P = Split, broadcast, partial_sum


# ----------------------------------------------------------------------------- shared
def _reduce_dims(op: str, dim, ndim: int, *, single: bool = False) -> tuple[int, ...]:
    """``dim`` of a reduction (an int, a sequence, or None for every dim) as sorted
    non-negative dims; a 0-dim tensor takes dim 0 or -1 (as torch) and reduces nothing.

    Raises:
        TypeError: ``dim`` is not an int (or a sequence of ints where allowed).
        ValueError: a dim out of range (also an IndexError) or a repeated dim.
    """
    if dim is None:
        return tuple(range(ndim))
    dims = norm_dims(dim, ndim, f"{op}: dim", single=single)
    return tuple(sorted(dims)) if ndim > 0 else ()


def _reduce_rule(metas, attrs):
    """A reduction over ``attrs['dims']`` that is not linear (max, prod...): a split kept
    dim stays split (renumbered without ``keepdim``); a split reduced dim gives B (the
    op's global algorithm combines the shards); no P."""
    (m,) = metas
    dims, keepdim = attrs["dims"], attrs["keepdim"]
    return [(S(d), S(d if keepdim else d - sum(1 for r in dims if r < d)) if d not in dims
             else B) for d in range(m.ndim)]


def _out_bytes(metas, attrs) -> int:
    (m,) = metas
    return math.prod(n for d, n in enumerate(m.shape) if d not in attrs["dims"]) * \
        m.dtype.itemsize


def _per_axis_cost(factor):
    """Cost of an algorithm that runs ``factor(group size)`` output-sized collectives'
    worth of bytes on each mesh axis splitting a reduced dim."""

    def cost(metas, attrs, ins, out, pl):
        axes = split_axes(ins[0], attrs["dims"], pl)
        nbytes = sum(_out_bytes(metas, attrs) * factor(pl.shape[a]) for a in axes)
        return axis_collectives_cost(pl, nbytes // max(len(axes), 1), len(axes))

    return cost


def check_nonempty(x: Tensor, name: str, dims: tuple[int, ...]) -> None:
    """torch's error for a max/min over nothing (a zero-size reduced dim, or an empty
    tensor reduced whole): there is no value to return.

    Raises:
        RuntimeError: as torch's, naming the shape and the dim."""
    shape = tuple(x.shape)
    if x.numel() == 0 and (not dims or len(dims) == len(shape)):
        raise RuntimeError(f"{name}(): expected reduction dim to be specified for an input "
                           f"with numel() == 0 (shape {shape}); reduce over a non-empty dim")
    for d in dims:
        if shape[d] == 0:
            raise RuntimeError(f"{name}(): expected reduction dim {d} to have non-zero size "
                               f"(shape {shape})")


def _fill(kind: str, dtype: torch.dtype):
    """The identity of max (``kind="max"``) or min for ``dtype``: what an empty shard holds."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return -math.inf if kind == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


# ----------------------------------------------------------------------------- sum, mean
@register("sum", reduction)
def _sum_kernel(a, *, dim=None, keepdim=False):
    return a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)


@register("mean", reduction)
def _mean_kernel(a, *, dim=None, keepdim=False, count=1):
    # ``count`` is the global number of reduced elements, so that on a split reduced dim
    # each rank's local sum / count is an exact summand (P) even for uneven shards.
    s = a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)
    return s / count


def _sum(self, dim=None, keepdim: bool = False, *, dtype=None):
    """Sum over ``dim`` (int, tuple, or None for all); a split reduced dim gives P.
    ``dtype`` casts the input first and is the output dtype (ints and bool sum to int64
    without it, as torch)."""
    dims = None if dim is None else _reduce_dims("sum", dim, self.ndim)
    return cast(dispatch("sum", cast(self, dtype), dim=dims, keepdim=keepdim), dtype)


def _mean(self, dim=None, keepdim: bool = False, *, dtype=None):
    """Mean over ``dim``; exact under uneven splits (divides by the global count).
    ``dtype`` casts the input first; without it the input must be floating (as torch).

    Raises:
        TypeError: an integer or bool input without a floating ``dtype``."""
    self = cast(self, dtype)
    if not (self.dtype.is_floating_point or self.dtype.is_complex):
        raise TypeError(f"mean: could not infer the output dtype from a {self.dtype} input; "
                        f"pass a floating dtype, e.g. x.mean(dtype=torch.float32)")
    dims = _reduce_dims("mean", dim, self.ndim)
    count = math.prod(self.shape[d] for d in dims)
    return dispatch("mean", self, dim=None if dim is None else dims, keepdim=keepdim,
                    count=count)


# ----------------------------------------------------------------------------- amax, amin
class _GlobalExtremum(torch.autograd.Function):
    """amax/amin of a shard, all-reduced MAX/MIN over the mesh axes that split a reduced
    dim. Gradient (torch's rule): shared evenly among the elements equal to the extremum,
    ties counted over the whole tensor (one more output-sized all-reduce, only when the
    input needs a gradient)."""

    @staticmethod
    def forward(ctx, x, kind, dims, keepdim, ranks_axes):
        fn = torch.amax if kind == "max" else torch.amin
        if any(x.shape[d] == 0 for d in dims):  # an empty shard (uneven split): the identity
            local = torch.full([1 if d in dims else n for d, n in enumerate(x.shape)],
                               _fill(kind, x.dtype), dtype=x.dtype, device=x.device)
        else:
            local = fn(x, dim=dims, keepdim=True)
        for ranks, a in ranks_axes:
            local = all_reduce(local, ranks, axis=a, op=kind)
        if ctx.needs_input_grad[0]:
            mask = (x == local).to(x.dtype)
            count = mask.sum(dim=dims, keepdim=True)
            for ranks, a in ranks_axes:
                count = all_reduce(count, ranks, axis=a)
            ctx.save_for_backward(mask, count)
        ctx.meta = (dims, keepdim, ranks_axes)
        return local if keepdim else local.squeeze(dims)

    @staticmethod
    def backward(ctx, g):
        mask, count = ctx.saved_tensors
        dims, keepdim, ranks_axes = ctx.meta
        if not keepdim:
            for d in sorted(dims):
                g = g.unsqueeze(d)
        for ranks, a in ranks_axes:  # the output is B on these axes: its gradient arrives as P
            g = all_reduce(g, ranks, axis=a)
        return g * mask / count, None, None, None, None


def _extremum_kernel(kind: str):
    fn = torch.amax if kind == "max" else torch.amin
    return lambda a, *, dims, keepdim: fn(a, dims, keepdim)


def _extremum_algorithm(kind: str):
    fn = torch.amax if kind == "max" else torch.amin

    def algorithm(call, x, *, dims, keepdim):
        axes = call.axes(0, dims)
        if not axes:
            return fn(x, dims, keepdim)
        return _GlobalExtremum.apply(x, kind, dims, keepdim,
                                     tuple((call.group(a), a) for a in axes))

    return algorithm


for _kind in ("max", "min"):
    register_algorithm(f"a{_kind}", rule=_reduce_rule, cost=_per_axis_cost(lambda n: 2),
                       kernel=_extremum_kernel(_kind))(_extremum_algorithm(_kind))


def extremum(x: Tensor, kind: str, dim=None, keepdim: bool = False) -> Tensor:
    """``amax`` (``kind="max"``) or ``amin`` of ``x`` over ``dim`` (None: all dims).

    SBP: a split reduced dim gives B by an all-reduce MAX/MIN of the output-sized local
    results (no gather); kept splits stay split; a P input is boxed first.

    Raises:
        RuntimeError: a reduction over nothing (as torch). ValueError/TypeError: bad dims.
    """
    dims = _reduce_dims("a" + kind, dim, x.ndim)
    if x.is_global:
        check_nonempty(x, "a" + kind, dims)
    return dispatch("a" + kind, x, dims=dims, keepdim=keepdim)


# ----------------------------------------------------------------------------- max / min
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
        gv, ggi = gather_axis(v.detach(), pl, axis), gather_axis(gi, pl, axis)
        cmp = gv.to(torch.uint8) if gv.dtype == torch.bool else gv
        best = cmp.amax(0) if kind == "max" else cmp.amin(0)
        tie = cmp == best
        if cmp.is_floating_point():
            tie |= cmp.isnan() & best.isnan()
        chosen = torch.where(tie, ggi, torch.iinfo(torch.int64).max).amin(0)
        best = best.to(v.dtype)
        weight = (gi == chosen).to(v.dtype) if v.is_floating_point() else None
    return combine(v, best, weight, pl, axis), chosen


def _select_kernel(kind: str):
    fn = torch.max if kind == "max" else torch.min
    arg = torch.argmax if kind == "max" else torch.argmin

    def kernel(a, *, dims, keepdim):
        if len(dims) == 1 and a.ndim > 0:
            return tuple(fn(a, dims[0], keepdim))
        # every dim (dim=None): the value and the index into the flattened tensor
        v = fn(a)
        i = arg(a.to(torch.uint8) if a.dtype == torch.bool else a, None, keepdim)
        return (v.reshape([1] * a.ndim) if keepdim else v), i

    return kernel


def _select_algorithm(kind: str):
    kernel = _select_kernel(kind)

    def algorithm(call, local, *, dims, keepdim):
        axes = call.axes(0, dims)
        if not axes:
            return kernel(local, dims=dims, keepdim=keepdim)
        slices = call.slices(0)
        v, gi = _local_select(local, kind, dims, [slices[d].start for d in dims],
                              [call.metas[0].shape[d] for d in dims])
        for a in axes:
            v, gi = _combine_select(v, gi, kind, call.placement, a)
        if not keepdim:
            v, gi = squeeze_dims(v, dims), squeeze_dims(gi, dims)
        return v, gi

    return algorithm


def _gather_cost(n: int) -> int:
    return 2 * n  # values and int64 indices (about twice), gathered from n ranks


for _kind in ("max", "min"):
    register_algorithm(_kind, rule=_reduce_rule, cost=_per_axis_cost(_gather_cost),
                       kernel=_select_kernel(_kind))(_select_algorithm(_kind))


def _select(x: Tensor, kind: str, dim, keepdim: bool):
    """(values, indices) of max/min of ``x`` over ``dim`` (None: every dim, with indices
    into the flattened tensor), through the registered ``max``/``min`` op."""
    dims = _reduce_dims(kind, dim, x.ndim, single=dim is not None)
    if x.is_global:
        check_nonempty(x, kind, dims)
    return dispatch(kind, x, dims=dims, keepdim=keepdim)


# ----------------------------------------------------------------------------- prod
def _prod_kernel(a, *, dims, keepdim, dtype):
    if len(dims) == 1 and a.ndim > 0:
        return a.prod(dims[0], keepdim, dtype=dtype)
    return a.prod(dtype=dtype)


@register_algorithm("prod", kernel=_prod_kernel, rule=_reduce_rule,
                    cost=_per_axis_cost(lambda n: n))
def _prod_algorithm(call, local, *, dims, keepdim, dtype):
    """Local products, then per mesh axis splitting a reduced dim one all-gather of the
    output-sized per-shard products; the gradient's factor from the other shards is their
    product (never a division: zeros are exact)."""
    axes = call.axes(0, dims)
    if not axes:
        return _prod_kernel(local, dims=dims, keepdim=keepdim, dtype=dtype)
    if len(dims) == local.ndim and len(dims) != 1:
        p = local.prod(dtype=dtype).reshape([1] * local.ndim)
    else:
        p = local.prod(dims[0], keepdim=True, dtype=dtype)
    pl = call.placement
    for a in axes:
        with torch.no_grad():
            gp = gather_axis(p.detach(), pl, a)
            me = pl.coord()[a]
            total = gp.prod(0)
            others = torch.cat([gp[:me], gp[me + 1:]]).prod(0)
        p = combine(p, total, others, pl, a)
    return p if keepdim else squeeze_dims(p, dims)


def _prod(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.prod``: product over ``dim`` (one int, or None for every element).

    Output dtype as torch: integer and bool inputs give int64 unless ``dtype`` is given
    (the input is cast to ``dtype`` first). SBP: a split reduced dim gives B through a
    local product and one all-gather of the per-shard products (output-sized) per mesh
    axis; P inputs are boxed. Gradient as torch's (zeros handled: the factor of the other
    shards is their product, never a division).

    Raises:
        TypeError: ``dim`` is not an int or None; ``keepdim`` without ``dim`` on a global
            tensor. ValueError: ``dim`` out of range.
    """
    dims = _reduce_dims("prod", dim, self.ndim, single=True)
    if self.is_global and dim is None and keepdim:
        raise TypeError("prod(): keepdim needs a dim, e.g. x.prod(0, keepdim=True)")
    return dispatch("prod", self, dims=dims if dim is not None else tuple(range(self.ndim)),
                    keepdim=keepdim, dtype=dtype)


def _extremum_method(kind: str):
    fn = torch.max if kind == "max" else torch.min
    binary = "maximum" if kind == "max" else "minimum"
    ret = torch.return_types.max if kind == "max" else torch.return_types.min

    def method(self, dim=None, keepdim: bool = False, *, other=None):
        if isinstance(dim, Tensor) or other is not None:
            return dispatch(binary, self, dim if other is None else other)
        if dim is None:
            if keepdim:
                raise TypeError(f"{kind}(): keepdim needs a dim, e.g. x.{kind}(0, keepdim=True)")
            if self.is_local:
                return Tensor(fn(self.to_torch()))
            if self.dtype.is_floating_point:
                return extremum(self, kind)  # the gradient shared among ties, as torch
            return _select(self, kind, None, False)[0]
        return ret(_select(self, kind, dim, keepdim))

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
        if self.is_local:
            _reduce_dims(name, dim, self.ndim, single=True)
            return Tensor(fn(self.to_torch(), dim, keepdim))
        # dim=None: every dim is reduced and the index is flat over the whole tensor.
        return _select(self, kind, dim, keepdim)[1]

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
    dims = _reduce_dims(op, dim, x.ndim)
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise TypeError(f"{op}: only floating point inputs are supported, got {x.dtype}; "
                        f"cast first (x.to(torch.float32))")
    if x.is_local:
        fn = torch.std if op == "std" else torch.var
        return Tensor(fn(x.to_torch(), dims, correction=c, keepdim=keepdim))
    n = math.prod(x.shape[d] for d in dims)

    def variance(x):
        # Two passes, as torch: the mean (P over a split reduced dim, all-reduced:
        # output-sized), then the sum of squared deviations (P), / max(0, n - correction).
        mu = unpartial(dispatch("mean", x, dim=dims, keepdim=True, count=n))
        d = x - mu
        var = dispatch("sum", d * d, dim=dims, keepdim=keepdim) / max(0, n - c)
        return var.sqrt() if op == "std" else var

    return in_float32(unpartial(x), variance)


def _var(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    """``torch.var`` over ``dim`` (int, tuple, None: all) with Bessel's ``correction``
    (default 1; ``unbiased=False`` is 0); torch's forms ``var(dim, unbiased, keepdim)``,
    ``var(unbiased)`` and ``var(dim, correction=c, keepdim=...)`` all work.

    Exact under uneven splits: two passes, the global mean (an all-reduce of the
    output-sized mean when a reduced dim is split) then the sum of squared deviations,
    which is left P over a split reduced dim. Divides by ``max(0, N - correction)`` (so
    ``N <= correction`` gives inf/nan as torch does). fp16/bf16 inputs: computed in
    float32 and rounded once, as torch (the P result then all-reduced in float32: B).

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


def _norm_term(a, *, p):
    """``|a| ** p`` elementwise (``p == 0``: 1 where ``a != 0``, gradient zero)."""
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
    torch's (zero at a zero norm). fp16/bf16: computed in float32 and rounded once, as
    torch (``|x|^2`` of fp16 values above 256 would overflow); the output is then B.

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
    dims = _reduce_dims("norm", dim, self.ndim)
    want = dtype if dtype is not None else self.dtype
    if not (want.is_floating_point or want.is_complex):
        raise TypeError(f"norm: expected a floating point input (or dtype=), got {self.dtype}; "
                        f"cast first (x.to(torch.float32))")
    if self.is_local:
        return Tensor(torch.linalg.vector_norm(self.to_torch(), p, dims, keepdim, dtype=dtype))

    def norm(x):
        if math.isinf(p):
            a = dispatch("norm_term", x, p=1)
            return extremum(a, "max" if p > 0 else "min", dims, keepdim)
        s = dispatch("sum", dispatch("norm_term", x, p=p), dim=dims, keepdim=keepdim)
        return s if p in (0, 1) else dispatch("norm_root", s, p=float(p))

    return in_float32(cast(unpartial(self), dtype), norm)


def _logsumexp(self, dim, keepdim: bool = False):
    """``torch.logsumexp``: ``log(sum(exp(x)))`` over ``dim`` (int or tuple), computed as
    ``m + log(sum(exp(x - m)))`` with ``m`` the max (0 where it is infinite, as torch).
    Integer inputs give the default float dtype.

    SBP: composed of registered ops: ``m`` is ``amax`` (an all-reduce MAX over the mesh axes
    that split a reduced dim: output-sized, not a gather; no gradient, the result does not
    depend on it); the sum is P there and the log all-reduces it (output-sized). Output B
    on those axes; kept split dims stay split; P inputs are boxed first. Gradient
    ``softmax(x)``.

    Raises:
        ValueError: ``dim`` out of range or repeated.
    """
    dims = _reduce_dims("logsumexp", dim, self.ndim)
    if self.is_local:
        return Tensor(torch.logsumexp(self.to_torch(), dims, keepdim))
    x = unpartial(self)
    if not x.dtype.is_floating_point:
        x = cast(x, torch.get_default_dtype())
    if x.numel() == 0:
        return dispatch("sum", x.exp(), dim=dims, keepdim=keepdim).log()
    m = dispatch("amax", x.detach(), dims=dims, keepdim=True)
    m = where(m.isinf(), 0.0, m)
    s = dispatch("sum", (x - m).exp(), dim=dims, keepdim=keepdim)
    return s.log() + (m if keepdim else m.squeeze(dims))


# ----------------------------------------------------------------------------- all / any
def _logical(kind: str):
    fn = torch.all if kind == "all" else torch.any

    def method(self, dim=None, keepdim: bool = False):
        dims = _reduce_dims(kind, dim, self.ndim)
        if self.is_local:
            t = self.to_torch()
            return Tensor(fn(t) if dim is None and not keepdim else fn(t, dims, keepdim))
        # Count the elements that decide (zeros for all, non-zeros for any): a sum, P over
        # a split reduced dim, then one comparison that all-reduces the int64 counts.
        hits = self == 0 if kind == "all" else self != 0
        count = dispatch("sum", hits, dim=dims, keepdim=keepdim)
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


def _nansum(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.nansum``: the sum with NaN counted as zero (gradient 0 there). SBP as
    :meth:`sum` (a split reduced dim gives ``P``)."""
    x = self
    if x.dtype.is_floating_point or x.dtype.is_complex:
        x = where(x.isnan(), 0.0, x)
    return x.sum(dim, keepdim, dtype=dtype)


def _nanmean(self, dim=None, keepdim: bool = False, *, dtype=None):
    """``torch.nanmean``: the mean of the non-NaN elements over ``dim``. SBP: a sum and a
    count as :meth:`sum` (``P`` over a split reduced dim), the count all-reduced for the
    division.

    Raises:
        TypeError: a non-floating input (as torch)."""
    want = dtype or self.dtype
    if not (want.is_floating_point or want.is_complex):
        raise TypeError(f"nanmean: expected a floating point input, got {self.dtype}")
    x = self if dtype is None else self.to(dtype)
    count = x.isnan().logical_not().sum(dim, keepdim).to(x.dtype)
    return _nansum(x, dim, keepdim) / count


def _moments(kind: str):
    def fn(input, dim=None, unbiased=None, keepdim: bool = False, *,  # noqa: A002
           correction=None):
        d = dim
        if isinstance(dim, bool):
            d, unbiased = None, dim
        spread = getattr(input, kind)(d, unbiased, keepdim, correction=correction)
        dims = tuple(range(input.ndim)) if d is None else d
        return spread, input.mean(dims, keepdim)

    fn.__name__ = f"{kind}_mean"
    fn.__doc__ = (f"``torch.{kind}_mean``: ``({kind}, mean)`` over ``dim`` with Bessel's "
                  f"``correction`` (as :meth:`Tensor.{kind}`); each is computed as that op "
                  f"(a split reduced dim: output-sized all-reduces only).")
    return fn


std_mean = _moments("std")


var_mean = _moments("var")


def _aminmax(self, *, dim=None, keepdim: bool = False):
    """``torch.aminmax``: ``(min, max)`` over ``dim`` (None: all elements); as
    :meth:`amin`/:meth:`amax` (an all-reduce MIN/MAX over a split reduced dim, no gather)."""
    if self.is_local:
        out = torch.aminmax(self._local, dim=dim, keepdim=keepdim)
        return torch.return_types.aminmax((Tensor(out.min), Tensor(out.max)))
    dims = None if dim is None else _reduce_dims("aminmax", dim, self.ndim, single=True)
    return torch.return_types.aminmax((extremum(self, "min", dims, keepdim),
                                       extremum(self, "max", dims, keepdim)))


def _count_nonzero(self, dim=None):
    """``torch.count_nonzero``: int64 count of non-zero elements over ``dim`` (int, tuple,
    None: all). Global: a sum of ``x != 0`` (kept dims keep their split, a split counted
    dim gives ``P``), boxed to ``B`` where it would be ``P``."""
    if self.is_local:
        return Tensor(torch.count_nonzero(self._local, dim))
    return unpartial((unpartial(self) != 0).sum(dim))


# ---------------------------------------------------------------- Tensor methods and functions
# ---------------------------------------------------------------- Tensor methods and functions
method("sum")(_sum)
method("mean")(_mean)
method("prod")(_prod)
method("amax")(lambda self, dim=None, keepdim=False: extremum(self, "max", dim, keepdim))
method("amin")(lambda self, dim=None, keepdim=False: extremum(self, "min", dim, keepdim))
method("max")(_extremum_method("max"))
method("min")(_extremum_method("min"))
method("argmax")(_arg_method("max"))
method("argmin")(_arg_method("min"))
method("aminmax")(_aminmax)
method("var")(_var)
method("std")(_std)
function("std_mean")(std_mean)
function("var_mean")(var_mean)
method("norm")(_norm)
method("logsumexp")(_logsumexp)
method("all")(_logical("all"))
method("any")(_logical("any"))
method("nansum")(_nansum)
method("nanmean")(_nanmean)
method("count_nonzero")(_count_nonzero)
