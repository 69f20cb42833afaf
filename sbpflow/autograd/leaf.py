"""Gradients of global tensors: leaf-gradient layouts, backward seeding, hooks.

The gradient of a tensor laid out ``sbp`` arrives laid out ``dual(sbp)`` (ARCHITECTURE
"Autograd: the dual rule": S->S, B->P, P->B). A global leaf's ``.grad`` is boxed from there
to the leaf's gradient layout (its own SBP unless set with ``set_grad_sbp``) as soon as
autograd produces it (:class:`_LeafGrad`; data-parallel P -> B reductions go to the
buckets of :mod:`sbpflow.autograd.grad_sync`); ``retain_grad`` of a global non-leaf keeps a
copy boxed to its own SBP (:class:`_Retained`).

:class:`GradMembers` holds the gradient members of :class:`sbpflow.Tensor` (``backward``,
``grad``, ``grad_sbp``, ``set_grad_sbp``, ``requires_grad_``, ``retain_grad``,
``retains_grad``, ``register_hook``); :func:`sbpflow.autograd.install` puts them into the
class (the Tensor layer is below this one and does not import it).
"""

from __future__ import annotations

import weakref

import torch

from ..boxing import backend_of, plan_boxing, run_plan
from ..distributed._state import _state as _dstate
from ..sbp import SBP, dual, format_nd_sbp, normalize_nd_sbp
from ..tensor import Tensor, _as_local_torch
from . import grad_sync

__all__ = ["GradMembers"]


class _LeafGrad:
    """Gradient layout of a global leaf; stored on its local torch tensor as
    ``_sbpflow_leaf`` and called by autograd hooks.

    Three paths, decided once per layout:

    * the gradient layout differs from the dual layout only by P -> B on some mesh axes
      (data parallel): the gradient goes to the backward's buckets
      (:mod:`sbpflow.autograd.grad_sync`: flat, asynchronous all-reduces overlapped with
      backward) through an ``AccumulateGrad`` pre-hook, which lets autograd accumulate
      zeros; the reduced value is added to ``.grad`` at the end of backward;
    * otherwise, where the gradient layout's shard has the leaf's shard shape, a tensor
      hook boxes each incoming gradient before torch accumulates it into ``.grad``;
    * where it does not (a B leaf whose gradient is laid out S(0), as ZeRO does), torch
      accumulates the dual-layout gradient, and a post-accumulate hook boxes it into a
      separate shard-shaped buffer (``.grad`` of the sbpflow tensor) and frees torch's.
    """

    __slots__ = ("placement", "sbp", "shape", "grad_sbp", "buffer", "_same_shape", "sync_axes",
                 "pending", "tensor", "acc", "post", "owners")

    def __init__(self, placement, sbp, shape, grad_sbp):
        self.placement, self.sbp, self.shape = placement, sbp, shape
        self.buffer: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None  # gradients summed under no_sync
        self.tensor = None
        self.acc = None
        self.post: list = []  # register_post_accumulate_grad_hook's hooks, called with no args
        self.owners: dict = {}  # id -> weakref of each sbpflow tensor that made it (own())
        self.set_grad_sbp(grad_sbp)

    def set_grad_sbp(self, grad_sbp) -> None:
        # Decided once per layout, not in every backward hook call.
        self.grad_sbp = grad_sbp
        self._same_shape = self.placement.shard_shape(self.shape, self.sbp) == \
            self.placement.shard_shape(self.shape, grad_sbp)
        self.sync_axes = grad_sync.sync_axes(tuple(dual(s) for s in self.sbp), grad_sbp) \
            if self._same_shape else None

    def attach(self, t: torch.Tensor) -> None:
        """Register the hooks on leaf ``t``."""
        self.tensor = weakref.ref(t)
        t.register_hook(self.before_accumulate)
        t.register_post_accumulate_grad_hook(self.after_accumulate)
        self._hold_accumulator(t)

    def _hold_accumulator(self, t: torch.Tensor) -> None:
        """Put the pre-hook on ``t``'s ``AccumulateGrad`` node and keep the node (torch
        keeps a leaf's node only while a graph uses it; a new one has no hooks)."""
        with torch.enable_grad():
            self.acc = t.view_as(t).grad_fn.next_functions[0][0]  # t's AccumulateGrad
        self.acc.register_prehook(self.on_accumulate)

    def own(self, owner) -> None:
        """Count sbpflow tensor ``owner`` (one wrapping the leaf) among those that keep
        the ``AccumulateGrad`` node held. The node holds the leaf in C++ and the leaf
        holds this object, a cycle Python's collector cannot see: when the last owner is
        collected the node is dropped (:meth:`_owner_gone`), so that a discarded module's
        parameters are freed (before, every global parameter that required grad lived
        until the process ended)."""
        key = id(owner)
        if key not in self.owners:
            self.owners[key] = weakref.ref(owner, lambda _r, k=key: self._owner_gone(k))

    def _owner_gone(self, key: int) -> None:
        self.owners.pop(key, None)
        if not self.owners:
            self.acc = None

    def before_accumulate(self, g: torch.Tensor) -> torch.Tensor:
        if self.acc is None and self.bucketed():
            # the owners are gone but another wrapper of this leaf runs a backward: the
            # node in use gets the pre-hook now (torch runs a node's pre-hooks after its
            # tensor pre-hooks, this one among them) and is held again
            t = self.tensor() if self.tensor is not None else None
            if t is not None:
                self._hold_accumulator(t)
        if self.bucketed():
            return g  # the AccumulateGrad pre-hook takes it (``torch.autograd.grad`` too)
        return self.box(g) if self.same_shape() else g

    def same_shape(self) -> bool:
        return self._same_shape

    def bucketed(self) -> bool:
        return self.sync_axes is not None and grad_sync.BUCKETS.cap > 0

    def box(self, g: torch.Tensor) -> torch.Tensor:
        src = tuple(dual(s) for s in self.sbp)
        if src == self.grad_sbp:
            return g
        plan = plan_boxing(self.shape, g.dtype, self.placement, src, self.placement, self.grad_sbp,
                           backend_of(self.placement))
        with torch.no_grad():
            return run_plan(g, plan, deferred=True)  # (.grad: read by the update)

    def on_accumulate(self, grads):
        if not self.bucketed() or grads[0] is None:
            return None
        return grad_sync.on_accumulate(self, grads)

    def deliver(self, reduced: torch.Tensor, replace: bool = False) -> None:
        """Put a reduced gradient (from a bucket) into the leaf's ``.grad``."""
        grad_sync.deliver(self.tensor() if self.tensor is not None else None, reduced,
                           replace)
        self._posted()

    def after_accumulate(self, t: torch.Tensor) -> None:
        if self.bucketed():
            return  # torch accumulated zeros; the bucket's deliver() posts
        if not self.same_shape() and t.grad is not None:
            g = self.box(t.grad)
            t.grad = None
            # in place, as torch's AccumulateGrad: a graph's copies of a micro-batch
            # then chain their accumulations (``g`` is the box of .grad, now ours)
            self.buffer = g if self.buffer is None else self.buffer.add_(g)
        self._posted()

    def _posted(self) -> None:
        """Run the post-accumulate hooks: ``.grad`` holds this backward's gradient."""
        for hook in list(self.post):
            hook()


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
            self.buffer = g.clone() if self.buffer is None else self.buffer.add_(g)
        return None


class _PostHookHandle:
    """The handle :meth:`GradMembers.register_post_accumulate_grad_hook` returns."""

    __slots__ = ("hooks", "hook")

    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class GradMembers:
    """The gradient members of :class:`sbpflow.Tensor`, written as its methods; not a base
    class: :func:`sbpflow.autograd.install` copies them into ``Tensor`` (see
    :data:`MEMBERS`)."""

    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set ``requires_grad`` in place (leaves only); a global leaf's gradient is then
        boxed to its gradient layout (its own SBP by default) as it arrives."""
        self._local.requires_grad_(flag)
        if flag and self.is_global and self._local.is_leaf:
            self._leaf_grad()
        return self

    def register_post_accumulate_grad_hook(self, hook):
        """``torch.Tensor.register_post_accumulate_grad_hook``: ``hook(tensor)`` runs after
        a backward has put this leaf's gradient into ``.grad``; for a global leaf that is
        the gradient in its gradient layout (after the data-parallel bucket's all-reduce
        or the ZeRO reduce-scatter). Returns a handle with ``remove()``.

        Raises:
            RuntimeError: a non-leaf tensor (torch's refusal)."""
        if not self._local.is_leaf:
            raise RuntimeError("post accumulate grad hooks cannot be registered on non-leaf "
                               "tensors")
        me = weakref.ref(self)
        if not self.is_global:
            return self._local.register_post_accumulate_grad_hook(lambda _t: hook(me()))
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require "
                               "gradient")
        leaf = self._leaf_grad()

        def call():
            t = me()
            if t is not None:
                hook(t)

        leaf.post.append(call)
        return _PostHookHandle(leaf.post, call)

    def _leaf_grad(self) -> _LeafGrad:
        hook = getattr(self._local, "_sbpflow_leaf", None)
        if hook is None:
            hook = _LeafGrad(self._placement, self._sbp, self._shape, self._sbp)
            self._local._sbpflow_leaf = hook
            hook.attach(self._local)
        hook.own(self)
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
        ctx = getattr(_dstate.tracer, "context", None)
        if ctx is not None and ctx.backward_scopes:  # inside a graph's traced step
            with ctx.backward_scope(self) as t:  # (sbpflow.graph.compiler: loss scaling)
                torch.autograd.backward(t._local, t._seed(gradient), retain_graph,
                                        create_graph)
            return
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


# What install() copies into sbpflow.Tensor, in one list.
MEMBERS = ("requires_grad_", "_leaf_grad", "set_grad_sbp", "grad_sbp", "grad", "backward",
           "_seed", "_hook_sbp", "retain_grad", "retains_grad", "register_hook",
           "register_post_accumulate_grad_hook")
