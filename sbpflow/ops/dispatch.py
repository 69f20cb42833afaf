"""The one dispatch path: every registered op, out of place and in place, local and
global, global algorithms included, runs through :func:`dispatch` or
:func:`dispatch_inplace`.

Local inputs: the kernel runs on the wrapped torch tensors. Global inputs: they must
share one placement; the chooser (:mod:`sbpflow.ops.chooser`) picks an nd signature
(cached), the inputs are boxed to it (differentiable), the kernel (or the op's global
algorithm) runs on the local shards, and the output takes the signature's nd-SBP and the
global shape that the kernel gives on ``meta`` tensors. A rank outside the placement
holds an empty shard (:func:`outside_shards`).

:func:`observe` records each dispatch (op, layouts, chosen signature): what tests count,
what debug output and the graph tracer build on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..boxing.steps import HALF, upcast
from ..distributed import ensure_groups
from ..distributed._state import _state as _dstate
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, format_nd_sbp
from ..tensor import Tensor
from .chooser import choose_signature
from .registry import Meta, OpSpec, get_op, infer_meta

__all__ = ["Call", "DispatchRecord", "check_writable", "coerce_operand", "dispatch",
           "dispatch_inplace", "inplace_by_copy", "mark_view_copies", "observe",
           "outside_shards"]

# Methods that return a view in torch (an in-place write through the result changes the
# input). On a global tensor whose layout needs a gather first, sbpflow's result is a copy.
VIEW_METHODS = frozenset({
    "__getitem__", "view", "view_as", "transpose", "swapaxes", "permute", "t", "narrow",
    "select", "squeeze", "unsqueeze", "expand", "expand_as", "unflatten", "split", "chunk",
    "unbind", "movedim", "diagonal"})


def _storage(t: torch.Tensor):
    return t.untyped_storage().data_ptr() if t.numel() else None


def mark_view_copies(name: str, x, out):
    """Mark the results of view method ``name`` of global ``x`` that are copies (their local
    shard does not share ``x``'s storage), so in-place writes into them raise instead of
    silently not reaching ``x``. Returns ``out``."""
    if not isinstance(x, Tensor) or not x.is_global:
        return out
    base = _storage(x._local)
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, Tensor) and o.is_global and base is not None and \
                _storage(o._local) not in (None, base):
            o._local._sbpflow_copy_of = name
    return out


def coerce_operand(self: Tensor, other):
    """A ``torch.Tensor`` or numpy array operand of an operator: a local sbpflow tensor
    when ``self`` is local (torch converts them the same way).

    Raises:
        TypeError: with a global ``self`` (the array's layout is unknown), naming the fix.
    """
    if isinstance(other, (torch.Tensor, np.ndarray)):
        if self.is_global:
            raise TypeError(f"an operator between a global sbpflow tensor and a "
                            f"{type(other).__module__}.{type(other).__name__}: the array's "
                            f"layout is unknown; make it global first, e.g. sbpflow.tensor("
                            f"a, placement=x.placement, sbp=...) (the same value on every rank)")
        return Tensor(torch.as_tensor(other))
    return other


def check_writable(x: Tensor, name: str) -> None:
    """Raise if ``x`` is a copy made by a view method (see :func:`mark_view_copies`).

    Raises:
        ValueError: names the view method and the fixes.
    """
    src = getattr(x._local, "_sbpflow_copy_of", None)
    if src is not None:
        raise ValueError(
            f"{name}: this tensor came from {src}() of a global tensor whose layout ("
            f"the indexed or viewed dim was split) needed a gather, so it is a copy, not a "
            f"view: writing into it would not change the original as in torch. Write into the "
            f"original with x[...] = value, or call .clone() first if a copy is what you want")


# ====================================================================== records


@dataclass(frozen=True)
class DispatchRecord:
    """One dispatched op: its name, whether in place, the inputs' nd-SBPs (None for local
    inputs) and the chosen ``(input nd-SBPs, output nd-SBP)`` signature (None for local
    inputs, and for an in-place op with no signature that keeps its tensor's layout)."""

    op: str
    inplace: bool
    inputs: tuple | None
    signature: tuple | None


_OBSERVERS: list[Callable[[DispatchRecord], None]] = []


@contextlib.contextmanager
def observe(sink: Callable[[DispatchRecord], None] | None = None
            ) -> Iterator[list[DispatchRecord]]:
    """Record every op dispatched inside the block (a list of :class:`DispatchRecord`,
    filled as ops run), or hand each record to ``sink`` (then the list stays empty).
    Nested blocks each see every op."""
    records: list[DispatchRecord] = []
    fn = sink or records.append
    _OBSERVERS.append(fn)
    try:
        yield records
    finally:
        _OBSERVERS.remove(fn)


def _notify(op: OpSpec, inplace: bool, inputs, signature) -> None:
    rec = DispatchRecord(op.name, inplace, inputs, signature)
    for fn in list(_OBSERVERS):
        fn(rec)


# ====================================================================== global algorithms


@dataclass(frozen=True)
class Call:
    """What a global algorithm gets besides its shards: the placement, the chosen
    signature (``ins``: each input's nd-SBP, ``out``: the output's) and the global metas of
    the inputs and the output(s)."""

    placement: Placement
    ins: tuple[tuple[SBP, ...], ...]
    out: tuple[SBP, ...]
    metas: tuple[Meta, ...]
    meta_out: Meta | tuple[Meta, ...]

    def axes(self, i: int, dims) -> tuple[int, ...]:
        """The mesh axes on which input ``i`` is split along one of ``dims``."""
        return tuple(a for a, s in enumerate(self.ins[i]) if s.is_split() and s.dim in dims)

    def slices(self, i: int) -> tuple[slice, ...]:
        """This rank's slices of input ``i`` (global indices)."""
        return self.placement.shard_slices(self.metas[i].shape, self.ins[i])

    def group(self, axis: int) -> tuple[int, ...]:
        """The ranks of this rank's group along mesh ``axis`` (mesh coordinate order)."""
        return self.placement.axis_ranks(axis, self.placement.coord())


@lru_cache(maxsize=256)
def _axis_groups(pl: Placement) -> tuple:
    return tuple(g for a in range(pl.ndim) for g in pl.axis_groups(a))


def _ensure_axis_groups(pl: Placement) -> None:
    # Every world rank runs the same dispatch, so every rank creates the groups of every
    # mesh axis here, in the same order, before any algorithm (or any rank outside the
    # placement) branches away (see sbpflow.distributed.ensure_groups).
    ensure_groups(list(_axis_groups(pl)))


# ====================================================================== dispatch


@lru_cache(maxsize=8192)
def _local_shape(shape, pl, nd_sbp) -> torch.Size:
    return torch.Size(pl.shard_shape(shape, nd_sbp))


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def outside_shards(meta_out, *locals_: torch.Tensor):
    """The empty shard(s) of a rank outside the placement, of the dtype(s) in ``meta_out``
    (a :class:`Meta` or a tuple of them), connected to the floating inputs' graph so that
    this rank's backward reaches the same boxing steps as the members'."""
    if isinstance(meta_out, tuple):
        return tuple(outside_shards(m, *locals_) for m in meta_out)
    device = locals_[0].device if locals_ else None
    out = torch.empty((0,) * max(meta_out.ndim, 1), dtype=meta_out.dtype, device=device)
    if out.is_floating_point():
        for x in locals_:
            if x.requires_grad:
                out = out + x.reshape(-1)[:0].sum().to(out.dtype)
    return out


def _placement_of(name: str, inputs) -> Placement | None:
    """The inputs' common placement, None when all are local.

    Raises:
        TypeError: an input is not an sbpflow Tensor, or local and global inputs mix.
        ValueError: global inputs on different placements."""
    pl, n_local = None, 0
    for i, t in enumerate(inputs):  # one pass: this runs for every op
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: input {i} is a {type(t).__name__}, expected an "
                            f"sbpflow.Tensor (wrap torch tensors with sbpflow.from_torch)")
        p = t._placement
        if p is None:
            n_local += 1
        elif pl is None:
            pl = p
        elif p is not pl and p != pl:
            raise ValueError(f"{name}: inputs live on different placements, {pl!r} and "
                             f"{p!r}; move one with x.to_global(placement=...)")
    if pl is not None and n_local:
        kinds = ", ".join("global" if t.is_global else "local" for t in inputs)
        raise TypeError(
            f"{name}: inputs mix local and global tensors ({kinds}); convert the local ones "
            f"with x.to_global(placement, sbp) (or the global ones with .to_local())")
    return pl


def _wrap(out, pl=None, sbp=None, meta=None):
    if isinstance(out, (tuple, list)):
        metas = meta if meta is not None else (None,) * len(out)
        return tuple(_wrap(o, pl, sbp, m) for o, m in zip(out, metas))
    if pl is None:
        return Tensor(out)
    return Tensor(out, pl, sbp, meta.shape)


def _check_shapes(op: OpSpec, ins, out_sbp, pl, out, meta_out) -> None:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    metas = meta_out if isinstance(meta_out, tuple) else (meta_out,)
    for o, m in zip(outs, metas):
        want = _local_shape(m.shape, pl, out_sbp)
        if o.shape != want:  # a wrong rule must fail loudly, never give wrong shards
            raise RuntimeError(
                f"internal: {op.name} signature {[format_nd_sbp(s) for s in ins]} -> "
                f"{format_nd_sbp(out_sbp)} gave a local shape {tuple(o.shape)}, expected "
                f"{tuple(want)} for the global shape {m.shape}")


def _global_meta(op: OpSpec, attrs_key, metas, inputs):
    try:
        return infer_meta(op, attrs_key, metas)
    except RuntimeError as e:  # torch's message, with the global shapes and layouts
        raise ValueError(
            f"{op.name}: invalid inputs of global shapes "
            f"{', '.join(str(tuple(m.shape)) for m in metas)} laid out "
            f"{', '.join(format_nd_sbp(t.sbp) for t in inputs)} ({e})") from None


def dispatch(name: str, *inputs: Tensor, **attrs):
    """Run registered op ``name`` on sbpflow tensors ``inputs`` with non-tensor ``attrs``.

    Returns a Tensor, or a tuple of them for an op whose kernel returns a tuple (all laid
    out as the signature's output).

    Raises:
        TypeError: an input is not an sbpflow Tensor, or local and global inputs are mixed.
        ValueError: global inputs on different placements, or shapes/dtypes the op rejects
            (torch's message on the global shapes, plus the shapes and layouts).
    """
    op = get_op(name)
    pl = _placement_of(name, inputs)
    if pl is None:
        if _OBSERVERS:
            _notify(op, False, None, None)
        out = op.kernel(*(t._local for t in inputs), **attrs)
        return Tensor(out) if isinstance(out, torch.Tensor) else _wrap(out)
    _dstate.activity = name
    attrs = {k: _hashable(v) for k, v in attrs.items()}
    attrs_key = tuple(sorted(attrs.items()))
    metas = tuple(Meta(tuple(t.shape), t.dtype) for t in inputs)
    meta_out = _global_meta(op, attrs_key, metas, inputs)
    sbps = tuple(t.sbp for t in inputs)
    ins, out_sbp = choose_signature(op, attrs_key, metas, sbps, pl)
    if _OBSERVERS:
        _notify(op, False, sbps, (ins, out_sbp))
    planner = _dstate.tracer if getattr(_dstate.tracer, "planning", False) else None
    if planner is not None and not all(t._local.is_meta for t in inputs):
        # a logical graph's meta stand-ins beside a tensor build() made with data (a
        # creation function's shard: a causal mask): priced as a meta tensor too
        inputs = tuple(t if t._local.is_meta else
                       Tensor(t._local.to("meta"), t.placement, t.sbp, tuple(t.shape))
                       for t in inputs)
    out = _run_global(op, attrs, inputs, ins, out_sbp, pl, metas, meta_out)
    if planner is not None:  # sbpflow.graph.ir: the op as a node of the logical graph
        planner.on_op(op, attrs_key, metas, sbps, pl, (ins, out_sbp), inputs, out)
    return out


def _run_global(op: OpSpec, attrs: dict, inputs, ins, out_sbp, pl: Placement, metas,
                meta_out):
    """Box ``inputs`` to the signature's ``ins`` and run ``op`` (its kernel on the shards,
    or its global algorithm); the output laid out ``out_sbp``."""
    locals_ = [t._local if t.sbp == s else t.to_global(pl, s)._local for t, s in zip(inputs, ins)]
    if type(meta_out) is Meta and meta_out.dtype in HALF and op.algorithm is None:
        new_partial = _new_partial_axes(ins, out_sbp)
        if new_partial:
            return _half_partial(op, attrs, new_partial, locals_, pl, out_sbp, meta_out)
    member = pl.coord() is not None
    if op.algorithm is None and member and type(meta_out) is Meta:  # the common case, fast
        out = op.kernel(*locals_, **attrs)
        if out.shape != _local_shape(meta_out.shape, pl, out_sbp):
            _check_shapes(op, ins, out_sbp, pl, out, meta_out)  # raises, naming the rule
        return Tensor(out, pl, out_sbp, meta_out.shape)
    if op.algorithm is not None:
        _ensure_axis_groups(pl)
    if member or op.everywhere:
        if op.algorithm is not None:
            call = Call(pl, ins, out_sbp, metas, meta_out)
            out = op.algorithm(call, *locals_, **attrs)
        else:
            out = op.kernel(*locals_, **attrs)
        if member:
            _check_shapes(op, ins, out_sbp, pl, out, meta_out)
    else:
        out = outside_shards(meta_out, *locals_)
    return _wrap(out, pl, out_sbp, meta_out)


def _new_partial_axes(ins, out_sbp) -> tuple[int, ...]:
    """Mesh axes where the output is a partial sum the inputs are not (a sum over a split
    dim, a split-K matmul): the kernel makes new partial sums there."""
    return tuple(a for a, s in enumerate(out_sbp)
                 if s.is_partial() and not any(i[a].is_partial() for i in ins))


def _half_partial(op: OpSpec, attrs, axes, locals_, pl: Placement, out_sbp, meta_out):
    """An fp16/bf16 op whose signature makes new partial sums: run the kernel in float32
    (autocast off for it), sum the partials across ranks in float32 (P -> B on those
    axes), then cast to the half dtype once. One device accumulates such a sum or matmul
    in float32 and rounds once; fp16 partials would overflow where the total does not
    (the 65504 limit), and half partials are rounded once per rank (in bf16 one rank's
    256 + 1 rounds to 256: with another rank's -256 the total 1 reads 0). The output is B
    on those axes instead of P (its all-reduce runs now, in float32: twice the bytes of a
    half one)."""
    if pl.coord() is not None:
        up = [upcast(x) for x in locals_]
        with torch.autocast(pl.device.type, enabled=False):
            out = op.kernel(*up, **attrs)
    else:
        out = outside_shards(Meta(meta_out.shape, torch.float32), *locals_)
    reduced = tuple(broadcast if a in axes else s for a, s in enumerate(out_sbp))
    full = Tensor(out, pl, out_sbp, meta_out.shape).to_global(pl, reduced)
    return Tensor(full._local.to(meta_out.dtype), pl, reduced, meta_out.shape)


def dispatch_inplace(x: Tensor, name: str, op_name: str, others: tuple, attrs: dict, run):
    """``x.<name>(...)`` in place: ``x`` <- op ``op_name`` of ``(x, *others)`` with
    ``attrs``; ``run(x_local, *other_locals)`` is torch's in-place op on the shards.
    Returns ``x``.

    Local: ``run`` on the wrapped tensors (torch's semantics and errors). Global: ``x``
    keeps its layout and its storage. The chooser takes the cheapest signature whose first
    input and output are ``x``'s layout, boxes the others to it and runs ``run`` on the
    shard. For a global algorithm (``cumsum_`` along a split dim), and where the op has no
    such signature (``clamp_`` or ``relu_`` of a P tensor: not
    linear; ``tril_`` of a tensor split on a matrix dim), the logical value is computed
    out of place (the chooser's cheapest layout, e.g. the P summands all-reduced), boxed
    back to ``x``'s layout (B -> P: the rank at coordinate 0 of that mesh axis holds it,
    the others zeros) and copied into ``x``'s shard, as torch's in-place semantics
    promise: ``s = x.sum(); s.clamp_(max=2)`` leaves ``s`` reading at most 2. Autograd
    sees the op either way (a leaf that requires grad raises torch's RuntimeError).

    Raises:
        ValueError: shapes that do not broadcast to ``x``'s, or a result of another shape.
        RuntimeError: a result dtype that cannot be cast to ``x``'s (torch's check, before
            any collective).
        TypeError: mixed local and global inputs.
    """
    op = get_op(op_name)
    pl = _inplace_placement(name, x, others)
    if pl is None:
        if _OBSERVERS:
            _notify(op, True, None, None)
        run(x._local, *(o._local for o in others))
        return x
    check_writable(x, name)
    if torch.is_grad_enabled() and x._local.is_leaf and x._local.requires_grad:
        raise RuntimeError(f"a leaf Variable that requires grad is being used in an in-place "
                           f"operation ({name}); update parameters under sbpflow.no_grad(), or "
                           f"use the out-of-place op")
    attrs = {k: _hashable(v) for k, v in attrs.items()}
    attrs_key = tuple(sorted(attrs.items()))
    metas = (Meta(tuple(x.shape), x.dtype),) + tuple(Meta(tuple(o.shape), o.dtype)
                                                     for o in others)
    shapes = ", ".join(str(tuple(m.shape)) for m in metas)
    try:
        out = infer_meta(op, attrs_key, metas)
    except RuntimeError as e:
        raise ValueError(f"{name}: input shapes {shapes} do not broadcast ({e})") from None
    if not torch.can_cast(out.dtype, x.dtype):  # torch's check, before any collective
        raise RuntimeError(f"{name}: result type {out.dtype} can't be cast to the desired "
                           f"output type {x.dtype}")
    if out.shape != tuple(x.shape):
        raise ValueError(f"{name}: the result would have shape {out.shape} but x has shape "
                         f"{tuple(x.shape)} (inputs {shapes}); an in-place op cannot change "
                         f"the shape, use the out-of-place op")
    sbps = (x.sbp,) + tuple(o.sbp for o in others)
    sig = choose_signature(op, attrs_key, metas, sbps, pl, inplace=True)
    if _OBSERVERS:
        _notify(op, True, sbps, sig)
    member = pl.coord() is not None
    if sig is None or op.algorithm is not None:
        # No signature keeps x's layout (or a global algorithm, which needs its own
        # collectives): the logical value, boxed back into x's layout.
        value = dispatch(op_name, x, *others, **attrs)
        if value.sbp != x.sbp:
            value = value.to_global(pl, x.sbp)
        if member:
            x._local.copy_(value._local)
        else:
            _link_outside(x, (value._local,))
        return x
    boxed = [o._local if o.sbp == s else o.to_global(pl, s)._local
             for o, s in zip(others, sig[0][1:])]
    if member:
        run(x._local, *boxed)
    else:
        _link_outside(x, boxed)
    if getattr(_dstate.tracer, "planning", False):
        _dstate.tracer.on_op(op, attrs_key, metas, sbps, pl, sig, (x, *others), x,
                             inplace=True)
    return x


def _inplace_placement(name: str, x: Tensor, others) -> Placement | None:
    """``x``'s placement (None when local), the arguments checked against it.

    Raises:
        TypeError: an argument is not a Tensor, or local and global mix (naming which).
        ValueError: an argument on another placement."""
    for i, o in enumerate(others):
        if not isinstance(o, Tensor):
            raise TypeError(f"{name}: argument {i} is a {type(o).__name__}, expected an "
                            f"sbpflow.Tensor")
    if x.is_local:
        if any(o.is_global for o in others):
            raise TypeError(f"{name}: x is local but an argument is global; convert x with "
                            f"x.to_global(placement, sbp) or the argument with .to_local()")
        return None
    if any(o.is_local for o in others):
        raise TypeError(f"{name}: x is global but an argument is local; convert it with "
                        f"arg.to_global(x.placement, sbp)")
    for o in others:
        if o.placement != x.placement:
            raise ValueError(f"{name}: x lives on {x.placement!r} but an argument on "
                             f"{o.placement!r}; move it with arg.to_global(placement="
                             f"x.placement, sbp=...)")
    return x.placement


def _link_outside(x: Tensor, locals_) -> None:
    """Outside the placement: keep ``x``'s empty shard connected to the arguments' graph
    so that this rank's backward reaches the same boxing steps as the members'."""
    links = [b.reshape(-1)[:0].sum() for b in locals_ if b.requires_grad]
    if links and x._local.is_floating_point():
        x._local.add_(sum(links).to(x.dtype))



def inplace_by_copy(name: str):
    """The Tensor method ``x.<name>_(...)``: ``x.copy_(x.<name>(...))``, the out-of-place
    op's value written back into ``x``'s layout by :func:`dispatch_inplace` (``copy_``):
    for ops whose torch in-place form has no cheaper shard-local equivalent here."""

    def method(self, *args, **kwargs):
        return self.copy_(getattr(self, name)(*args, **kwargs))

    method.__name__ = f"{name}_"
    method.__doc__ = (f"In place ``torch.Tensor.{name}_``: ``x.copy_(x.{name}(...))`` (same "
                      f"values, gradients and layout rules as :meth:`{name}`; x keeps its "
                      f"layout).")
    return method
