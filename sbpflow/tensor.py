"""sbpflow.Tensor: one local torch.Tensor, plus placement and nd-SBP when global.

A *local* tensor is an ordinary single-process tensor. A *global* tensor has a
placement (a device mesh), an nd-SBP (one SBP per mesh axis) and a global shape; the
wrapped torch tensor is this rank's shard (see :func:`sbpflow.placement.shard_slices`).
``Tensor`` is not a subclass of ``torch.Tensor``; autograd runs on the local tensors.

Gradients (ARCHITECTURE "Autograd: the dual rule"): the gradient of a tensor laid out
as ``sbp`` arrives laid out as ``dual(sbp)`` (S->S, B->P, P->B). A global leaf's
``.grad`` is boxed from there to the leaf's gradient layout (its own SBP unless set
with :meth:`Tensor.set_grad_sbp`) as soon as autograd produces it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from . import _grad_sync
from . import distributed as _dist
from . import random as _rng
from .boxing import backend_of, broadcast_from_first, plan_boxing, run_plan
from .distributed import _comm
from .placement import placement as Placement
from .sbp import SBP, broadcast, dual, format_nd_sbp, normalize_nd_sbp

__all__ = ["Tensor", "from_torch", "tensor", "zeros", "ones", "full", "rand", "randint", "randn",
           "zeros_like", "ones_like", "randn_like", "manual_seed"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


class _LeafGrad:
    """Gradient layout of a global leaf; stored on its local torch tensor as
    ``_sbpflow_leaf`` and called by autograd hooks.

    Three paths, decided once per layout:

    * the gradient layout differs from the dual layout only by P -> B on some mesh axes
      (data parallel): the gradient goes to the backward's buckets
      (:mod:`sbpflow._grad_sync`: flat, asynchronous all-reduces overlapped with
      backward) through an ``AccumulateGrad`` pre-hook, which lets autograd accumulate
      zeros; the reduced value is added to ``.grad`` at the end of backward;
    * otherwise, where the gradient layout's shard has the leaf's shard shape, a tensor
      hook boxes each incoming gradient before torch accumulates it into ``.grad``;
    * where it does not (a B leaf whose gradient is laid out S(0), as ZeRO does), torch
      accumulates the dual-layout gradient, and a post-accumulate hook boxes it into a
      separate shard-shaped buffer (``.grad`` of the sbpflow tensor) and frees torch's.
    """

    __slots__ = ("placement", "sbp", "shape", "grad_sbp", "buffer", "_same_shape", "sync_axes",
                 "pending", "tensor", "acc")

    def __init__(self, placement, sbp, shape, grad_sbp):
        self.placement, self.sbp, self.shape = placement, sbp, shape
        self.buffer: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None  # gradients summed under no_sync
        self.tensor = None
        self.acc = None
        self.set_grad_sbp(grad_sbp)

    def set_grad_sbp(self, grad_sbp) -> None:
        # Decided once per layout, not in every backward hook call.
        self.grad_sbp = grad_sbp
        self._same_shape = self.placement.shard_shape(self.shape, self.sbp) == \
            self.placement.shard_shape(self.shape, grad_sbp)
        self.sync_axes = _grad_sync.sync_axes(tuple(dual(s) for s in self.sbp), grad_sbp) \
            if self._same_shape else None

    def attach(self, t: torch.Tensor) -> None:
        """Register the hooks on leaf ``t``."""
        self.tensor = weakref.ref(t)
        t.register_hook(self.before_accumulate)
        t.register_post_accumulate_grad_hook(self.after_accumulate)
        with torch.enable_grad():
            self.acc = t.view_as(t).grad_fn.next_functions[0][0]  # t's AccumulateGrad
        self.acc.register_prehook(self.on_accumulate)

    def same_shape(self) -> bool:
        return self._same_shape

    def bucketed(self) -> bool:
        return self.sync_axes is not None and _grad_sync.BUCKETS.cap > 0

    def box(self, g: torch.Tensor) -> torch.Tensor:
        src = tuple(dual(s) for s in self.sbp)
        if src == self.grad_sbp:
            return g
        plan = plan_boxing(self.shape, g.dtype, self.placement, src, self.placement, self.grad_sbp,
                           backend_of(self.placement))
        with torch.no_grad():
            return run_plan(g, plan)

    def before_accumulate(self, g: torch.Tensor) -> torch.Tensor:
        if self.bucketed():
            return g  # the AccumulateGrad pre-hook takes it (``torch.autograd.grad`` too)
        return self.box(g) if self.same_shape() else g

    def on_accumulate(self, grads):
        if not self.bucketed() or grads[0] is None:
            return None
        return _grad_sync.on_accumulate(self, grads)

    def deliver(self, reduced: torch.Tensor, replace: bool = False) -> None:
        """Put a reduced gradient (from a bucket) into the leaf's ``.grad``."""
        _grad_sync.deliver(self.tensor() if self.tensor is not None else None, reduced,
                           replace)

    def after_accumulate(self, t: torch.Tensor) -> None:
        if self.same_shape() or t.grad is None:
            return
        g = self.box(t.grad)
        t.grad = None
        self.buffer = g if self.buffer is None else self.buffer + g


class _Retained:
    """``retain_grad`` of a global non-leaf: a tensor hook that leaves the flowing gradient
    alone and accumulates a copy boxed from ``dual(sbp)`` to ``sbp`` (the ``.grad``)."""

    __slots__ = ("placement", "sbp", "shape", "buffer", "handle")

    def __init__(self, placement, sbp, shape):
        self.placement, self.sbp, self.shape = placement, sbp, shape
        self.buffer: torch.Tensor | None = None
        self.handle = None

    def __call__(self, g: torch.Tensor) -> None:
        src = tuple(dual(s) for s in self.sbp)
        with torch.no_grad():
            if src != self.sbp:
                plan = plan_boxing(self.shape, g.dtype, self.placement, src, self.placement,
                                   self.sbp, backend_of(self.placement))
                g = run_plan(g, plan)
            self.buffer = g.clone() if self.buffer is None else self.buffer + g
        return None


class Tensor:
    """A local or global tensor. Build with :func:`sbpflow.tensor`, :func:`zeros`, ... or
    :meth:`to_global`; do not call the constructor directly.

    Attributes:
        shape: the *global* shape (``torch.Size``); the local shard's is ``to_local().shape``.
        dtype, device: of the local shard. placement, sbp: ``None`` for a local tensor;
        ``sbp`` is always a tuple (one SBP per mesh axis).
    """

    __slots__ = ("_local", "_placement", "_sbp", "_shape", "__weakref__")

    # set by sbpflow.ops.api.install: routes torch functions called on sbpflow tensors
    _torch_function = None

    def __init__(self, local: torch.Tensor, placement: Placement | None = None,
                 sbp: tuple[SBP, ...] | None = None, shape: Sequence[int] | None = None):
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"Tensor wraps a torch.Tensor, got {type(local).__name__}")
        self._local = local
        self._placement = placement
        self._sbp = tuple(sbp) if sbp is not None else None
        self._shape = torch.Size(shape) if shape is not None else local.shape

    # ------------------------------------------------------------------ metadata
    @property
    def is_global(self) -> bool:
        return self._placement is not None

    @property
    def is_local(self) -> bool:
        return self._placement is None

    @property
    def placement(self) -> Placement | None:
        return self._placement

    @property
    def sbp(self) -> tuple[SBP, ...] | None:
        return self._sbp

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    @property
    def is_leaf(self) -> bool:
        return self._local.is_leaf

    @property
    def grad_fn(self):
        return self._local.grad_fn

    # ------------------------------------------------------------------ autograd
    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set ``requires_grad`` in place (leaves only); a global leaf's gradient is then
        boxed to its gradient layout (its own SBP by default) as it arrives."""
        self._local.requires_grad_(flag)
        if flag and self.is_global and self._local.is_leaf:
            self._leaf_grad()
        return self

    def _leaf_grad(self) -> _LeafGrad:
        hook = getattr(self._local, "_sbpflow_leaf", None)
        if hook is None:
            hook = _LeafGrad(self._placement, self._sbp, self._shape, self._sbp)
            self._local._sbpflow_leaf = hook
            hook.attach(self._local)
        return hook

    def set_grad_sbp(self, sbp) -> Tensor:
        """Lay out this global leaf's ``.grad`` as ``sbp`` (e.g. ``S(0)`` for ZeRO).

        Raises ``ValueError`` on a local or non-leaf tensor.
        """
        if not self.is_global or not self._local.is_leaf:
            raise ValueError("set_grad_sbp applies to global leaf tensors only")
        if self.grad is not None:
            raise ValueError(f"set_grad_sbp: this tensor already has a gradient laid out "
                             f"{format_nd_sbp(self.grad.sbp)}; set the layout before backward "
                             f"or clear it first (x.grad = None)")
        nd = normalize_nd_sbp(sbp, self._placement.ndim, self.ndim)
        self.requires_grad_(True)
        self._leaf_grad().set_grad_sbp(nd)
        return self

    @property
    def grad_sbp(self) -> tuple[SBP, ...] | None:
        hook = getattr(self._local, "_sbpflow_leaf", None)
        return hook.grad_sbp if hook is not None else None

    @property
    def grad(self) -> Tensor | None:
        """The gradient; for a global leaf, laid out as :attr:`grad_sbp`."""
        hook = getattr(self._local, "_sbpflow_leaf", None)
        retained = getattr(self._local, "_sbpflow_retained", None)
        if retained is not None and not self._local.is_leaf:
            g = retained.buffer
        elif hook is not None and hook.buffer is not None:
            g = hook.buffer
        else:
            g = self._local.grad
        if g is None:
            return None
        if not self.is_global:
            return Tensor(g)
        return Tensor(g, self._placement, self.grad_sbp or self._sbp, self._shape)

    @grad.setter
    def grad(self, value) -> None:
        hook = getattr(self._local, "_sbpflow_leaf", None)
        retained = getattr(self._local, "_sbpflow_retained", None)
        if retained is not None and not self._local.is_leaf:
            retained.buffer = None if value is None else _as_local_torch(value)
            return
        if value is None:
            self._local.grad = None
            if hook is not None:
                hook.buffer = None
                hook.pending = None
            return
        if hook is not None and not hook.same_shape():
            hook.buffer = _as_local_torch(value)
        else:
            self._local.grad = _as_local_torch(value)

    def backward(self, gradient: Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False) -> None:
        """Backpropagate from this tensor. Global tensors: every rank of the world calls it.

        Seeding (ARCHITECTURE): a scalar laid out P is seeded with 1 on every rank (each
        summand's derivative is 1); a scalar laid out B is seeded so the ranks' seeds sum
        to 1: the rank at coordinate 0 of every B mesh axis gets 1, the others 0 (exact,
        no 1/n rounding). A non-scalar needs ``gradient``: a global tensor with the same
        placement and shape (any SBP); it is boxed to ``dual(self.sbp)`` first.

        Raises:
            RuntimeError: non-scalar without ``gradient``, or a tensor that does not
                require grad.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(call requires_grad_() on the inputs first)")
        torch.autograd.backward(self._local, self._seed(gradient), retain_graph, create_graph)

    def _seed(self, gradient) -> torch.Tensor | None:
        """The local torch gradient that starts backward from this tensor (see
        :meth:`backward`; ``None`` for a local tensor without ``gradient``, as torch)."""
        if not self.is_global:
            return None if gradient is None else _as_local_torch(gradient)
        target = tuple(dual(s) for s in self._sbp)
        if gradient is None:
            if self.numel() != 1:
                raise RuntimeError(f"backward() without gradient needs a scalar; this tensor has "
                                   f"shape {tuple(self.shape)}. Pass gradient= (a global tensor)")
            coord = self._placement.coord()
            seed = torch.zeros_like(self._local)
            if coord is not None and all(c == 0 for c, s in zip(coord, self._sbp)
                                         if s.is_broadcast()):
                seed.fill_(1)
            return seed
        if not isinstance(gradient, Tensor) or not gradient.is_global:
            raise TypeError("gradient for a global tensor must be a global sbpflow.Tensor")
        if gradient.placement != self._placement or gradient.shape != self.shape:
            raise ValueError(
                f"gradient has placement {gradient.placement!r} and shape "
                f"{tuple(gradient.shape)}; expected {self._placement!r} and "
                f"{tuple(self.shape)}")
        with torch.no_grad():
            return gradient.to_global(sbp=target).to_local()._local

    def _hook_sbp(self) -> tuple[SBP, ...]:
        """Layout of the gradient that tensor hooks of this global tensor see: a leaf whose
        gradient is boxed before accumulation (:class:`_LeafGrad`, not bucketed) sees its
        gradient layout, every other tensor the dual of its SBP (the layout backward
        carries; bucketed leaves are reduced at the end of backward)."""
        hook = getattr(self._local, "_sbpflow_leaf", None)
        if hook is not None and self._local.is_leaf and hook.same_shape() and \
                not hook.bucketed():  # bucketed leaves are reduced after backward
            return hook.grad_sbp
        return tuple(dual(s) for s in self._sbp)

    def retain_grad(self) -> None:
        """Keep the gradient of this non-leaf tensor in ``.grad`` after backward
        (``torch.Tensor.retain_grad``); a no-op on leaves.

        Global tensors: ``.grad`` is laid out in the tensor's own SBP, like a leaf's (the
        incoming dual-layout gradient is boxed to it as it arrives, e.g. P -> B is an
        all-reduce; the gradient that flows on through the graph is not changed). It
        accumulates over backward calls; ``x.grad = None`` clears it.
        """
        if self._local.is_leaf:
            return
        if not self.is_global:
            self._local.retain_grad()
            return
        if getattr(self._local, "_sbpflow_retained", None) is None:
            retained = _Retained(self._placement, self._sbp, self._shape)
            retained.handle = self._local.register_hook(retained)
            self._local._sbpflow_retained = retained

    @property
    def retains_grad(self) -> bool:
        """Whether :meth:`retain_grad` was called on this non-leaf tensor."""
        if self.is_global:
            return (not self._local.is_leaf
                    and getattr(self._local, "_sbpflow_retained", None) is not None)
        return self._local.retains_grad

    def register_hook(self, hook):
        """Call ``hook(grad)`` when the gradient of this tensor is computed
        (``torch.Tensor.register_hook``); returns a handle with ``.remove()``.

        ``grad`` is an sbpflow Tensor: local for a local tensor; for a global one a global
        tensor with this tensor's placement and shape, laid out as the gradient travels:
        ``dual(sbp)`` for a non-leaf (B -> P, P -> B, S -> S) and for a leaf whose gradient
        is reduced in the backward's buckets (a B parameter: P, as DDP's hooks see local
        gradients), the gradient layout (:attr:`grad_sbp`) for other leaves. The hook may return
        ``None`` (keep the gradient) or a replacement: a global tensor of the same
        placement and shape (boxed to that layout if it is laid out otherwise; every rank
        runs the hook, so a boxing collective is matched), or for a local tensor a local
        sbpflow or torch tensor. Hooks run before the gradient is retained
        (:meth:`retain_grad`) or accumulated into ``.grad``, as in torch.

        Raises:
            TypeError: ``hook`` is not callable, or it returns something else.
            RuntimeError: (torch's) this tensor does not require grad.
        """
        if not callable(hook):
            raise TypeError(f"register_hook takes a callable, got {type(hook).__name__}")
        if self.is_local:
            def wrapped(g):
                out = hook(Tensor(g))
                return None if out is None else _as_local_torch(out)
        else:
            pl, shape = self._placement, self._shape

            def wrapped(g):
                layout = self._hook_sbp()
                out = hook(Tensor(g, pl, layout, shape))
                if out is None:
                    return None
                if not isinstance(out, Tensor) or not out.is_global:
                    raise TypeError(f"a hook on a global tensor must return None or a global "
                                    f"sbpflow.Tensor, got {type(out).__name__}")
                if out.placement != pl or tuple(out.shape) != tuple(shape):
                    raise ValueError(
                        f"hook returned a gradient on {out.placement!r} with shape "
                        f"{tuple(out.shape)}; expected {pl!r} and {tuple(shape)}")
                with torch.no_grad():
                    return (out if out.sbp == layout else out.to_global(sbp=layout))._local

        handle = self._local.register_hook(wrapped)
        retained = getattr(self._local, "_sbpflow_retained", None)
        if retained is not None:  # retain_grad sees the gradient after every hook (torch)
            retained.handle.remove()
            retained.handle = self._local.register_hook(retained)
        return handle

    def detach_(self) -> Tensor:
        """Detach in place (``torch.Tensor.detach_``): this tensor becomes a leaf that does
        not require grad; layout unchanged. Raises torch's RuntimeError on views."""
        self._local.detach_()
        return self

    def detach(self) -> Tensor:
        return Tensor(self._local.detach(), self._placement, self._sbp, self._shape)

    # ------------------------------------------------------------------ conversion
    def to_local(self) -> Tensor:
        """This rank's shard as a local tensor (no copy; differentiable: its gradient flows
        back as this rank's part of the gradient in the dual layout). A local tensor is
        returned as is; a rank outside the placement gets an empty tensor."""
        return Tensor(self._local) if self.is_global else self

    def to_torch(self) -> torch.Tensor:
        """The wrapped ``torch.Tensor`` of a local tensor (no copy).

        Raises ``ValueError`` on a global tensor (use ``to_local().to_torch()`` for the shard).
        """
        if self.is_global:
            raise ValueError("to_torch() is for local tensors; use x.to_local().to_torch() for "
                             "this rank's shard or x.numpy() for the whole value")
        return self._local

    def to_global(self, placement: Placement | None = None, sbp=None, *, grad_sbp=None,
                  check_meta: bool = True, size: Sequence[int] | None = None) -> Tensor:
        """Convert to a global tensor on ``placement`` laid out as ``sbp``.

        From a local tensor (every rank of the world calls this; ``placement`` and ``sbp``
        required):

        * ``S(d)``: the local tensors are the shards, uneven allowed; their shapes are
          exchanged and checked against :func:`sbpflow.placement.shard_shape`
          (``check_meta=False`` skips the exchange: give ``size=`` the global shape, or
          every shard must be equal);
        * ``B``: the value at mesh coordinate 0 of that axis is broadcast (the input is
          not overwritten); by default its gradient goes to that rank and the others'
          inputs get zeros;
        * ``P``: each local is a summand (its gradient is the full gradient).

        From a global tensor: boxing (``placement`` and ``sbp`` default to the current
        ones); differentiable, each step's backward is its dual transition.

        Args:
            grad_sbp: nd-SBP the gradient passes through on its way back. From a local
                tensor it sets what the local input receives (``B`` on a broadcast axis:
                every rank gets the whole gradient; ``P``: each rank its summand). From a
                global tensor it is a layout on the *source* placement that the gradient
                is boxed to before it is boxed to ``dual(source sbp)``: it changes the
                backward's collectives, not its values.
            check_meta: exchange and check local shapes (from local only).
            size: the global shape (from local only).

        Raises:
            ValueError: shapes that do not form the requested layout (names each rank's
                shape and the expected one), split dims out of range, wrong mesh rank.
            TypeError: placement or sbp of the wrong type.
        """
        if self.is_global:
            pl = self._placement if placement is None else placement
            nd = self._sbp if sbp is None else sbp
            return _global_to_global(self, _check_placement(pl), nd, grad_sbp)
        if placement is None or sbp is None:
            raise ValueError("to_global() on a local tensor needs both placement= and sbp=, e.g. "
                             "x.to_global(sbpflow.placement.all('cpu'), sbpflow.sbp.split(0))")
        return _local_to_global(self._local, _check_placement(placement), sbp, grad_sbp,
                                check_meta, size)

    def numpy(self) -> np.ndarray:
        """The whole value as a numpy array (a copy). Collective on a global tensor: every
        rank of the world calls it and gets the full value. Detaches."""
        return self._full().numpy()

    def item(self):
        """The value of a one-element tensor as a Python number (collective if global)."""
        if self.numel() != 1:
            raise ValueError(f"item() needs a one-element tensor, got shape {tuple(self.shape)}")
        return self._full().item()

    def tolist(self):
        """The whole value as nested lists (collective if global)."""
        return self._full().tolist()

    def _full(self) -> torch.Tensor:
        with torch.no_grad():
            if not self.is_global:
                return self._local.detach().cpu()
            pl = self._placement
            b = self.to_global(pl, (broadcast,) * pl.ndim)._local
            world = tuple(range(_dist.get_world_size()))
            if len(pl.rank_list) < len(world):
                # Ranks outside the placement get the value from its first rank.
                _dist.ensure_groups([world])
                if pl.coord() is None:
                    b = torch.empty(self._shape, dtype=self.dtype, device=pl.device)
                else:
                    b = b.clone()  # broadcast writes in place; b may alias a graph tensor
                _comm.broadcast(b, world, pl.rank_list[0])
            return b.detach().cpu()

    def __repr__(self) -> str:
        if not self.is_global:
            return repr(self._local).replace("tensor(", "sbpflow.tensor(", 1)
        return (f"sbpflow.Tensor(shape={tuple(self._shape)}, dtype={self.dtype}, "
                f"placement={self._placement!r}, sbp={format_nd_sbp(self._sbp)}, "
                f"local={self._local!r})")

    # ------------------------------------------------------------------ Python protocols
    __array_ufunc__ = None  # numpy defers to the reflected operators (no object arrays)

    def _scalar(self, what: str):
        if self.numel() != 1:
            raise RuntimeError(f"{what} of a Tensor with {self.numel()} elements is ambiguous "
                               f"(shape {tuple(self.shape)}); reduce it first (.any(), .all(), "
                               f".sum()...)")
        return self.item()  # collective for a global tensor: every rank must reach it

    def __bool__(self) -> bool:
        return bool(self._scalar("Boolean value"))

    def __float__(self) -> float:
        return float(self._scalar("float()"))

    def __int__(self) -> int:
        return int(self._scalar("int()"))

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.dtype.is_complex:
            raise TypeError(f"only integer tensors of a single element can be converted to an "
                            f"index, got {self.dtype}")
        return int(self._scalar("index"))

    def __format__(self, spec: str) -> str:
        if spec and self.numel() == 1:
            return format(self.item(), spec)
        return repr(self) if not spec else object.__format__(self, spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function or ``torch.Tensor`` method called with an sbpflow tensor
        (``torch.exp(x)``, ``torch_tensor + x``, ``torch.nn.functional.softmax(x, -1)``)
        runs sbpflow's op of the same name; torch tensors among the arguments become local
        sbpflow tensors.

        The op layer installs the handler (:func:`sbpflow.ops.api.torch_function`) when
        it loads; tensor.py does not import upwards.

        Raises:
            TypeError: sbpflow has no op for ``func`` (names it and the way out).
        """
        if cls._torch_function is None:
            raise TypeError(f"{func} called with an sbpflow tensor before sbpflow.ops loaded; "
                            f"import sbpflow first")
        return cls._torch_function(func, args, kwargs or {})

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]


# ---------------------------------------------------------------------- helpers


def _as_local_torch(x) -> torch.Tensor:
    if isinstance(x, Tensor):
        return x._local
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"expected an sbpflow.Tensor or torch.Tensor, got {type(x).__name__}")


def _check_placement(pl) -> Placement:
    if not isinstance(pl, Placement):
        raise TypeError(f"placement must be an sbpflow.placement, got {pl!r}; e.g. "
                        f"sbpflow.placement('cpu', [0, 1])")
    return pl


def _global_to_global(x: Tensor, pl: Placement, sbp, grad_sbp) -> Tensor:
    nd = normalize_nd_sbp(sbp, pl.ndim, x.ndim)
    plan = plan_boxing(tuple(x.shape), x.dtype, x.placement, x.sbp, pl, nd, backend_of(pl))
    if grad_sbp is None:
        out = run_plan(x._local, plan)
    else:
        g_nd = normalize_nd_sbp(grad_sbp, x.placement.ndim, x.ndim)
        out = _RoutedBoxing.apply(x._local, plan, (x.placement, x.sbp), (pl, nd), g_nd)
    return Tensor(out, pl, nd, x.shape)


class _RoutedBoxing(torch.autograd.Function):
    """Boxing ``src -> dst`` whose backward goes ``dual(dst)`` (destination placement) ->
    ``grad_sbp`` (source placement) -> ``dual(src)``; values are as without grad_sbp."""

    @staticmethod
    def forward(ctx, local, plan, src, dst, grad_sbp):
        ctx.meta = (plan.shape, src, dst, grad_sbp)
        with torch.no_grad():
            return run_plan(local, plan)

    @staticmethod
    def backward(ctx, g):
        shape, (src_pl, src_sbp), (dst_pl, dst_sbp), g_nd = ctx.meta
        d_dst = tuple(dual(s) for s in dst_sbp)
        d_src = tuple(dual(s) for s in src_sbp)
        via = plan_boxing(shape, g.dtype, dst_pl, d_dst, src_pl, g_nd, backend_of(src_pl))
        back = plan_boxing(shape, g.dtype, src_pl, g_nd, src_pl, d_src, backend_of(src_pl))
        with torch.no_grad():
            return run_plan(run_plan(g, via), back), None, None, None, None


def _dtype_code(dt: torch.dtype) -> int:
    return _DTYPES.index(dt) if dt in _DTYPES else len(_DTYPES)


def _local_to_global(local: torch.Tensor, pl: Placement, sbp, grad_sbp, check_meta, size) -> Tensor:
    ndim = local.dim() if size is None else len(size)
    nd = normalize_nd_sbp(sbp, pl.ndim, ndim)
    coord = pl.coord()
    if check_meta:
        shape, dtype = _exchange_and_check(local, pl, nd, size)
    else:
        dtype = local.dtype
        if size is not None:
            shape = tuple(int(s) for s in size)
        else:
            grown = list(local.shape)
            for a, s in enumerate(nd):
                if s.is_split():
                    grown[s.dim] *= pl.shape[a]
            shape = tuple(grown)
        want = pl.shard_shape(shape, nd)
        if coord is not None and tuple(local.shape) != want:
            raise ValueError(
                f"to_global({format_nd_sbp(nd)}, check_meta=False): rank {pl.rank_at(coord)}'s "
                f"local shape {tuple(local.shape)} is not its shard {want} of the global shape "
                f"{shape}; " + ("check size=" if size is not None else
                                "pass size= (the global shape)") + " or leave check_meta=True")
    b_axes = tuple(a for a, s in enumerate(nd) if s.is_broadcast())
    for a in b_axes:  # every rank makes the same groups in the same order, members or not
        _dist.ensure_groups(pl.axis_groups(a))
    if coord is None:
        # An empty shard of the global dtype, still connected to the input's graph.
        out = local.reshape(-1)[:0].to(dtype).reshape((0,) * max(len(shape), 1))
        return Tensor(out, pl, nd, shape)
    if b_axes:
        out = broadcast_from_first(local, pl, b_axes, pl.shard_shape(shape, nd), dtype)
    else:
        # S and P: the local tensor is the shard (no copy); a new autograd node keeps a
        # grad-requiring input's graph, a detached alias keeps the input untouched.
        out = local.view_as(local) if local.requires_grad else local.detach()
    if grad_sbp is not None:
        g_nd = normalize_nd_sbp(grad_sbp, pl.ndim, len(shape))
        for a, (s, g) in enumerate(zip(nd, g_nd)):
            if (s.is_split() or g.is_split()) and s != g:
                raise ValueError(
                    f"grad_sbp {format_nd_sbp(g_nd)} does not fit sbp {format_nd_sbp(nd)} on mesh "
                    f"axis {a}: a local input's gradient must have its shard's shape, so a split "
                    f"axis keeps its split and a B/P axis takes B or P")
        out = _LocalGradAs.apply(local, out, pl, nd, g_nd, shape)
    return Tensor(out, pl, nd, shape)


class _LocalGradAs(torch.autograd.Function):
    """Identity on the global's shard; the local input's gradient is the shard of the
    incoming gradient (layout dual(sbp)) boxed to ``grad_sbp``."""

    @staticmethod
    def forward(ctx, local, out, pl, nd, g_nd, shape):
        ctx.meta = (pl, nd, g_nd, shape)
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        pl, nd, g_nd, shape = ctx.meta
        plan = plan_boxing(tuple(shape), g.dtype, pl, tuple(dual(s) for s in nd), pl, g_nd,
                           backend_of(pl))
        with torch.no_grad():
            return run_plan(g, plan), None, None, None, None, None


def _exchange_and_check(local, pl, nd, size):
    """All-gather (ndim, dtype, shape) over the world; infer and check the global shape.

    Returns ``(global shape, dtype)``. Over the world rather than the placement, so that
    ranks outside it learn them too (their own local tensors are ignored). Ranks that are
    not at coordinate 0 of a B axis are overwritten by the broadcast: their shapes and
    dtypes are not checked; the others must agree in ndim and dtype and their shapes must
    be the shards of one global shape.
    """
    world = tuple(range(_dist.get_world_size()))
    _dist.ensure_groups([world])
    all_metas = _comm.all_gather_meta([local.dim(), _dtype_code(local.dtype), *local.shape], world)
    b_axes = [a for a, s in enumerate(nd) if s.is_broadcast()]
    live = [(pl.coord(r), all_metas[r]) for r in pl.rank_list]
    live = [(c, m) for c, m in live if all(c[a] == 0 for a in b_axes)]
    ref_c, ref = live[0]

    def describe(c, m) -> str:
        name = str(_DTYPES[m[1]]) if m[1] < len(_DTYPES) else "an unsupported dtype"
        return f"rank {pl.rank_at(c)} has shape {tuple(m[2:])} and dtype {name}"

    odd = [describe(c, m) for c, m in live if m[0] != ref[0] or m[1] != ref[1]]
    if odd:
        raise ValueError(
            f"to_global({format_nd_sbp(nd)}) on {pl!r}: local tensors must agree in number of "
            f"dims and dtype; {describe(ref_c, ref)}, but " + "; ".join(odd))
    if ref[1] >= len(_DTYPES):
        raise TypeError(f"to_global: dtype {local.dtype} is not supported; use one of {_DTYPES}")
    if size is not None:
        shape = tuple(int(s) for s in size)
    else:
        shape = list(ref[2:])
        for d in {s.dim for s in nd if s.is_split()}:
            split_axes = {a for a, s in enumerate(nd) if s.is_split() and s.dim == d}
            shape[d] = sum(m[2 + d] for c, m in live
                           if all(c[a] == 0 for a in range(len(c)) if a not in split_axes))
        shape = tuple(shape)
    bad = []
    for c, m in live:
        want = pl.shard_shape(shape, nd, pl.rank_at(c))
        if tuple(m[2:]) != want:
            bad.append(f"rank {pl.rank_at(c)} has {tuple(m[2:])}, expected {want}")
    if bad:
        hint = (" Split dims follow sbpflow.placement.shard_shape (the first size % n ranks hold "
                "one more element)." if any(s.is_split() for s in nd) else
                " B and P locals hold the whole tensor.")
        raise ValueError(
            f"to_global({format_nd_sbp(nd)}) on {pl!r}: local shapes do not form a global tensor "
            f"of shape {shape}: " + "; ".join(bad) + "." + hint)
    return shape, _DTYPES[ref[1]]


def from_torch(t: torch.Tensor) -> Tensor:
    """Wrap a ``torch.Tensor`` as a local sbpflow tensor (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch takes a torch.Tensor, got {type(t).__name__}")
    return Tensor(t)


# ---------------------------------------------------------------------- creation


_DEFAULT_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("sbpflow_default_placement",
                                                                   default=None)


@contextlib.contextmanager
def default_placement(placement: Placement | None):
    """Inside the block, creation ops called without ``placement=``/``sbp=`` (``arange``,
    ``zeros``, ``tensor``, ``randn``...) make global tensors on ``placement``, broadcast (B)
    on every mesh axis, instead of local ones. This lets model code written for one device
    (``torch.arange(T, device=idx.device)`` in a forward) run unchanged on global tensors.
    ``None`` restores local creation. Scoped to the calling context (thread/task)."""
    token = _DEFAULT_PLACEMENT.set(None if placement is None else _check_placement(placement))
    try:
        yield
    finally:
        _DEFAULT_PLACEMENT.reset(token)


def _resolve(placement, sbp, ndim: int):
    if placement is None:
        if sbp is not None:
            raise ValueError("sbp= given without placement=; give both for a global tensor")
        default = _DEFAULT_PLACEMENT.get()
        if default is not None:
            return default, (broadcast,) * default.ndim
        return None, None
    if sbp is None:
        raise ValueError("placement= given without sbp=; give both, e.g. "
                         "sbp=sbpflow.sbp.broadcast")
    pl = _check_placement(placement)
    return pl, normalize_nd_sbp(sbp, pl.ndim, ndim)


def _device_for(pl: Placement | None, device) -> torch.device | None:
    return pl.device if pl is not None else (torch.device(device) if device is not None else None)


def tensor(data, *, dtype: torch.dtype | None = None, device=None, requires_grad: bool = False,
           placement: Placement | None = None, sbp=None) -> Tensor:
    """Create a tensor from ``data`` (nested lists, numpy array, torch.Tensor, scalar).

    With ``placement``/``sbp``, ``data`` is the *global* value: every rank of the world
    calls this with the same data, and the value at the placement's mesh coordinate
    (0, ..., 0) wins (it is broadcast, then each rank keeps its shard). With ``P`` the rank
    at coordinate 0 of that mesh axis holds the value and the others zeros.
    """
    if isinstance(data, Tensor):
        data = data.numpy() if data.is_global else data._local
    if isinstance(data, torch.Tensor):  # a copy, detached, as torch.tensor(t) makes
        t = data.detach().to(dtype=dtype or data.dtype, copy=True)
    else:
        t = torch.tensor(data, dtype=dtype)
    pl, nd = _resolve(placement, sbp, t.dim())
    if pl is None:
        if device is not None:
            t = t.to(device)
        return Tensor(t.requires_grad_(requires_grad))
    t = t.to(pl.device)
    with torch.no_grad():
        # check_meta: ranks whose data differ in length still get the first rank's value.
        b = Tensor(t).to_global(pl, (broadcast,) * pl.ndim)
        out = b.to_global(pl, nd)._local.detach()
    return _leaf(out, pl, nd, tuple(b.shape), requires_grad)


def _leaf(local, pl, nd, shape, requires_grad) -> Tensor:
    x = Tensor(local.contiguous(), pl, nd, shape)
    if requires_grad:
        x.requires_grad_(True)
    return x


def _shape_arg(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for s in size:
        try:
            n = operator.index(s)  # ints, numpy ints, 0-dim integer tensors
        except TypeError:
            n = -1
        if isinstance(s, bool) or n < 0:
            raise ValueError(f"sizes must be non-negative ints, got {size!r}")
        out.append(n)
    return tuple(out)


def full(size, fill_value, *, dtype=None, device=None, requires_grad=False, placement=None,
         sbp=None) -> Tensor:
    """A tensor of global shape ``size`` filled with ``fill_value``; each rank makes only its
    shard (no communication). ``P``: coordinate 0 of that axis holds the value, others 0."""
    shape = _shape_arg(tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,))
    pl, nd = _resolve(placement, sbp, len(shape))
    if pl is None:
        return Tensor(torch.full(shape, fill_value, dtype=dtype, device=device,
                                 requires_grad=requires_grad))
    coord = pl.coord()
    local_shape = pl.shard_shape(shape, nd)
    local = torch.full(local_shape, fill_value, dtype=dtype, device=pl.device)
    if coord is not None and any(c != 0 for c, s in zip(coord, nd) if s.is_partial()):
        local.zero_()
    return _leaf(local, pl, nd, shape, requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad=False, placement=None, sbp=None) -> Tensor:
    """Zeros of global shape ``size`` (see :func:`full`)."""
    return full(_shape_arg(size), 0.0 if dtype is None else 0, dtype=dtype or torch.float32,
                device=device, requires_grad=requires_grad, placement=placement, sbp=sbp)


def ones(*size, dtype=None, device=None, requires_grad=False, placement=None, sbp=None) -> Tensor:
    """Ones of global shape ``size`` (see :func:`full`)."""
    return full(_shape_arg(size), 1.0 if dtype is None else 1, dtype=dtype or torch.float32,
                device=device, requires_grad=requires_grad, placement=placement, sbp=sbp)


def _random(name: str, draw, shape, dtype, device, requires_grad, placement, sbp,
            generator=None) -> Tensor:
    """Random creation: ``draw(shape, dtype, device, generator)`` on torch's generator.

    Global: :func:`sbpflow.random.draw_shard` (layout invariant by default: every rank of
    the world draws the whole global tensor, so generators stay in step and every rank
    sees the one-process value, then keeps its shard; memory is one global-size tensor
    per rank; under :func:`sbpflow.random.per_shard` only the shard is drawn). ``P``
    raises: a random summand has no single-device meaning."""
    pl, nd = _resolve(placement, sbp, len(shape))
    if pl is None:
        out = draw(shape, dtype, device, generator)
        return Tensor(out.requires_grad_(requires_grad) if requires_grad else out)
    if any(s.is_partial() for s in nd):
        raise ValueError(f"{name} with sbp {format_nd_sbp(nd)}: random creation cannot be "
                         f"partial_sum; create it B or S and box it")
    local = _rng.draw_shard(lambda s, g: draw(s, dtype, pl.device, g), shape, pl, nd, generator)
    return _leaf(local, pl, nd, shape, requires_grad)


def randn(*size, dtype=None, device=None, requires_grad=False, generator=None, placement=None,
          sbp=None) -> Tensor:
    """Standard normal samples of global shape ``size`` (``torch.randn``).

    Layout invariant: with the same seed the global value equals ``torch.randn(size)`` on
    one process (on the placement's device type), whatever the placement and SBP.
    Raises ``ValueError`` with ``P``.
    """
    return _random("randn", lambda s, dt, dev, g: torch.randn(s, dtype=dt, device=dev,
                                                              generator=g),
                   _shape_arg(size), dtype, device, requires_grad, placement, sbp, generator)


def rand(*size, dtype=None, device=None, requires_grad=False, generator=None, placement=None,
         sbp=None) -> Tensor:
    """Uniform [0, 1) samples of global shape ``size`` (``torch.rand``); layout invariant
    as :func:`randn`. Raises ``ValueError`` with ``P``."""
    return _random("rand", lambda s, dt, dev, g: torch.rand(s, dtype=dt, device=dev,
                                                            generator=g),
                   _shape_arg(size), dtype, device, requires_grad, placement, sbp, generator)


def randint(low: int, high: int, size, *, dtype=torch.int64, device=None, generator=None,
            placement=None, sbp=None) -> Tensor:
    """Integers in [low, high) of global shape ``size`` (``torch.randint``); layout
    invariant as :func:`randn`. Raises ``ValueError`` with ``P``."""
    return _random("randint", lambda s, dt, dev, g: torch.randint(low, high, s, dtype=dt,
                                                                  device=dev, generator=g),
                   _shape_arg(tuple(size)), dtype, device, False, placement, sbp, generator)


def _like(name: str, make, x: Tensor, placement, sbp, **kw) -> Tensor:
    """``*_like``: the global shape of ``x``; its placement and SBP unless given (a P
    layout becomes B for random fills, which cannot be partial)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} takes an sbpflow.Tensor, got {type(x).__name__}")
    kw.setdefault("dtype", x.dtype)
    if x.is_local and placement is None:
        return make(*x.shape, **kw)
    pl = x.placement if placement is None else placement
    nd = sbp if sbp is not None else x.sbp if placement is None else None
    return make(*x.shape, placement=pl, sbp=nd, **kw)


def zeros_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """Zeros with the global shape (and by default the placement and SBP) of ``x``."""
    return _like("zeros_like", zeros, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def ones_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """Ones with the global shape (and by default the placement and SBP) of ``x``."""
    return _like("ones_like", ones, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def randn_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """:func:`randn` with the global shape (and by default the placement and SBP, P read
    as B) of ``x``."""
    if sbp is None and placement is None and x.is_global:
        sbp = tuple(broadcast if s.is_partial() else s for s in x.sbp)
    return _like("randn_like", randn, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def manual_seed(seed: int):
    """Seed torch's generators on this rank (call with the same seed on every rank)."""
    return torch.manual_seed(seed)
