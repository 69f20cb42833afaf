"""sbpflow.autograd: torch.autograd's functional surface for local and global tensors,
and the gradient members of :class:`sbpflow.Tensor`.

Layer: above :mod:`sbpflow.tensor` (which does not import it), below ``ops/``.
Modules: :mod:`.leaf` (leaf-gradient layouts, backward seeding, hooks; the Tensor members
``backward``, ``grad``, ``register_hook``...), :mod:`.grad_sync` (bucketed gradient
all-reduces, :func:`no_sync`); :func:`install` puts the Tensor members into the class
(called once, from ``sbpflow/__init__.py``).

Autograd runs on the local torch tensors (ARCHITECTURE "Autograd: the dual rule"): the
gradient of a global tensor laid out ``sbp`` travels laid out ``dual(sbp)``. These
functions seed global outputs as :meth:`sbpflow.Tensor.backward` does and hand back
gradients laid out like ``.grad``:

* :func:`backward` (``torch.autograd.backward``): several roots at once;
* :func:`grad` (``torch.autograd.grad``): the gradients of ``outputs`` w.r.t. ``inputs``,
  returned instead of accumulated.

Tensor-side: ``x.retain_grad()``, ``x.register_hook(fn)``, ``x.detach()``/``detach_()``,
``requires_grad_``, ``is_leaf``, ``grad_fn`` (see :class:`sbpflow.Tensor`); grad-mode
switches are torch's (``no_grad``, ``enable_grad``, ``set_grad_enabled``,
``inference_mode``), re-exported here and in ``sbpflow``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import enable_grad, inference_mode, no_grad, set_grad_enabled

from ..tensor import Tensor
from . import grad_sync, leaf  # noqa: F401 - the package's modules
from .grad_sync import get_bucket_size, no_sync, set_bucket_size

__all__ = ["backward", "enable_grad", "get_bucket_size", "grad", "inference_mode", "install",
           "no_grad", "no_sync", "set_bucket_size", "set_grad_enabled"]


def install() -> None:
    """Give :class:`sbpflow.Tensor` its gradient members (:data:`leaf.MEMBERS`: ``backward``,
    ``grad``, ``grad_sbp``, ``set_grad_sbp``, ``requires_grad_``, ``retain_grad``,
    ``retains_grad``, ``register_hook`` and their helpers). Called once, from
    ``sbpflow/__init__.py``; the Tensor layer is below this one and cannot import it."""
    for name in leaf.MEMBERS:
        setattr(Tensor, name, leaf.GradMembers.__dict__[name])


def _tensors(name: str, what: str, value) -> list[Tensor]:
    items = [value] if isinstance(value, Tensor) else list(value) if isinstance(
        value, Sequence) else None
    if items is None or not all(isinstance(t, Tensor) for t in items):
        raise TypeError(f"{name}: {what} must be an sbpflow.Tensor or a sequence of them, got "
                        f"{value!r}")
    return items


def _grads_for(name: str, outputs: list[Tensor], grads) -> list:
    if grads is None:
        return [None] * len(outputs)
    items = [grads] if isinstance(grads, (Tensor, torch.Tensor)) else list(grads)
    if len(items) != len(outputs):
        raise ValueError(f"{name}: got {len(items)} gradients for {len(outputs)} outputs; give "
                         f"one per output (None for a scalar)")
    return items


def _seeds(outputs: list[Tensor], grads: list) -> list:
    return [o._seed(g) for o, g in zip(outputs, grads)]


def backward(tensors, grad_tensors=None, retain_graph: bool | None = None,
             create_graph: bool = False, inputs=None) -> None:
    """``torch.autograd.backward`` for sbpflow tensors: accumulate into the leaves'
    ``.grad`` the gradient of ``sum_i <tensors[i], grad_tensors[i]>``.

    Args:
        tensors: a Tensor or a sequence; each a scalar or given a gradient.
        grad_tensors: per tensor None (a scalar: seeded as :meth:`Tensor.backward` does,
            e.g. a B scalar's seeds sum to 1 over the ranks) or a gradient (for a global
            tensor a global one of the same placement and shape, any SBP).
        retain_graph, create_graph: torch's. inputs: accumulate only into these leaves.

    Global tensors: every rank of the world calls it. Raises RuntimeError (torch's, or
    ``Tensor.backward``'s) for a non-scalar without a gradient or a tensor that does not
    require grad; TypeError/ValueError for gradients of the wrong kind or shape.
    """
    outs = _tensors("backward", "tensors", tensors)
    for o in outs:
        if not o.requires_grad:
            raise RuntimeError("backward: element of tensors does not require grad and does "
                               "not have a grad_fn (call requires_grad_() on the inputs first)")
    seeds = _seeds(outs, _grads_for("backward", outs, grad_tensors))
    ins = None if inputs is None else [t._local for t in _tensors("backward", "inputs", inputs)]
    torch.autograd.backward([o._local for o in outs], seeds, retain_graph, create_graph,
                            inputs=ins)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool | None = None) -> tuple:
    """``torch.autograd.grad`` for sbpflow tensors: the gradients of ``outputs`` (seeded
    with ``grad_outputs``) w.r.t. ``inputs``, returned rather than accumulated.

    Args:
        outputs: a Tensor or a sequence; seeded as in :func:`backward`.
        inputs: a Tensor or a sequence (leaves or not, local or global).
        grad_outputs: per output None (scalars) or a gradient, as ``grad_tensors``.
        retain_graph: keep the graph (default: ``create_graph``).
        create_graph: build the graph of the gradients (higher-order derivatives); local
            tensors only.
        allow_unused: return None for an input the outputs do not depend on instead of
            raising (torch's RuntimeError).

    Returns:
        A tuple with one entry per input: a local Tensor for a local input; for a global
        one a global Tensor laid out like its ``.grad`` would be (the input's gradient
        layout: its own SBP, or ``grad_sbp`` for a leaf that set one), i.e. the dual-layout
        gradient boxed (e.g. P -> B, an all-reduce, for a B input); None if unused.

    Raises:
        NotImplementedError: ``create_graph=True`` with a global output or input (the
            boxing steps' backward is not itself differentiable yet).
    """
    outs = _tensors("grad", "outputs", outputs)
    ins = _tensors("grad", "inputs", inputs)
    if create_graph and any(t.is_global for t in outs + ins):
        raise NotImplementedError(
            "sbpflow.autograd.grad(create_graph=True) is supported on local tensors only: the "
            "collectives of global tensors have no double backward yet; compute higher-order "
            "derivatives on local tensors (x.to_local()) or without create_graph")
    seeds = _seeds(outs, _grads_for("grad", outs, grad_outputs))
    got = torch.autograd.grad([o._local for o in outs], [t._local for t in ins], seeds,
                              retain_graph=retain_graph, create_graph=create_graph,
                              allow_unused=allow_unused)
    return tuple(_as_grad_of(t, g) for t, g in zip(ins, got))


def _as_grad_of(x: Tensor, g: torch.Tensor | None):
    if g is None:
        return None
    if x.is_local:
        return Tensor(g)
    target = x.grad_sbp if x.is_leaf and x.grad_sbp is not None else x.sbp
    # The tensor hooks of x ran on g: a leaf whose gradient is boxed before accumulation
    # already holds its gradient layout, every other tensor the dual of its SBP.
    layout = x._hook_sbp()
    out = Tensor(g, x.placement, layout, x.shape)
    if layout == target:
        return out
    with torch.no_grad():
        return out.to_global(sbp=target)
