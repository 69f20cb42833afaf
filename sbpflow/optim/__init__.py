"""sbpflow.optim: torch's optimizers, run on the local shards of global parameters.

An optimizer update is elementwise in the parameter, its gradient and its state, so on a
global parameter it is exactly torch's update applied to each rank's shard, with the
state laid out like the gradient. sbpflow's optimizers therefore *are* torch's
(``SGD``, ``Adam``, ``AdamW`` subclass ``torch.optim.SGD``...): same arguments, defaults,
``foreach`` multi-tensor paths, ``param_groups`` and ``add_param_group``, and
``torch.optim.lr_scheduler`` works on them unchanged (re-exported as
:mod:`sbpflow.optim.lr_scheduler`). What sbpflow adds:

* the optimizer steps each global parameter's local shard (``param_groups`` hold those
  torch tensors; :attr:`Optimizer.sbpflow_params` maps back to the sbpflow Parameters);
* **ZeRO** falls out of the gradient layout: a parameter whose gradient layout has a
  smaller shard than the parameter (``p.set_grad_sbp(split(0))`` on a B parameter:
  gradients arrive reduce-scattered) is stepped as an fp32 *master shard* in the
  gradient's layout (state shard-sized: ZeRO-1/2), and the updated shard is boxed back
  to the parameter's layout (an all-gather) after each step;
* :meth:`state_dict` gives state tensors as **global** tensors (placement and SBP of the
  gradient layout), so checkpoints reshard; :meth:`load_state_dict` takes global, local or
  torch tensors (whole values) and boxes or slices them to each shard.

**Sparse gradients** (``nn.EmbeddingBag(sparse=True)``, ``nn.EmbeddingBagCollection(
sparse=True)``, ``nn.PartialFC`` with sampling): a table's gradient on each rank is a
``torch.sparse_coo_tensor`` of its own shard holding only the touched rows. ``SGD`` with
``momentum=0`` and ``weight_decay=0``, and ``Adagrad``, step it with torch's own sparse
kernels; ``SGD`` with momentum or weight decay uses sbpflow's **lazy momentum** (only the
touched rows and their ``momentum_buffer`` rows change; see :class:`SGD`). ``SparseAdam`` is
torch's lazy Adam and ``SparseAdamW`` adds decoupled weight decay on the touched rows (see
their docs). In all of them the other rows, and their state, stay bit-identical. ``Adam``
and ``AdamW`` (and other optimizers without a sparse update) refuse a sparse gradient with
a ``RuntimeError`` naming the parameter, where its sparse gradient comes from, and the fix.

Gradients laid out P (summands) would make the shard update wrong for any non-linear
optimizer: such parameters are rejected with the fix (give the leaf a gradient layout).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Iterator

import torch

from ..checkpoint import StoredTensor
from ..nn._sparse_source import sparse_grad_source
from ..ops.creation import tensor as _make_tensor
from ..sbp import format_nd_sbp
from ..tensor import Tensor
from . import lr_scheduler  # noqa: F401 - sbpflow.optim.lr_scheduler

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Adagrad", "SparseAdam", "SparseAdamW",
           "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "Adafactor",
           "LBFGS", "lr_scheduler"]


class _ParamState(defaultdict):
    """torch's per-parameter optimizer state, keyed by the local tensors the optimizer
    steps (``param_groups`` hold those). An sbpflow Parameter of the optimizer is a key
    too: ``opt.state[p]`` for ``p`` in ``model.parameters()`` reads (or, as torch's
    ``defaultdict``, makes) the state of its local tensor, as ``opt.state[p]`` does in
    torch. A tensor that is not one of the optimizer's parameters is looked up as it is."""

    def __init__(self, slots: dict, items=()):
        super().__init__(dict, items)
        self._slots = slots  # id(target) -> _Slot (the optimizer's)

    def _key(self, key):
        if isinstance(key, Tensor):
            for slot in self._slots.values():
                if slot.param is key:
                    return slot.target
        return key

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __setitem__(self, key, value):
        super().__setitem__(self._key(key), value)

    def __delitem__(self, key):
        super().__delitem__(self._key(key))

    def __contains__(self, key) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)

    def __reduce__(self):  # pickles / deep-copies as torch's plain defaultdict
        return (defaultdict, (dict, dict(self)))


class _Slot:
    """One sbpflow parameter and the torch tensor the optimizer steps for it."""

    __slots__ = ("param", "target", "zero", "layout", "synced")

    def __init__(self, param: Tensor):
        if not isinstance(param, Tensor):
            raise TypeError(f"optimizer params must be sbpflow Tensors (e.g. model.parameters())"
                            f", got {type(param).__name__}")
        if not param.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor")
        self.param = param
        self.zero = False
        self.target = param._local
        self.layout = (param.placement, param.grad_sbp or param.sbp) if param.is_global \
            else None  # the layout of the target and of its optimizer state
        self.synced = None  # ZeRO: (param's local tensor, its version) the master matches
        if param.is_global:
            if any(s.is_partial() for s in param.sbp):
                raise ValueError(
                    f"cannot optimize a parameter laid out {format_nd_sbp(param.sbp)}: an "
                    f"update of partial sums is not the update of their sum; convert it "
                    f"first, e.g. p.to_global(sbp=broadcast)")
            g_sbp = param.grad_sbp or param.sbp
            if any(s.is_partial() for s in g_sbp):
                raise ValueError(f"gradient layout {format_nd_sbp(g_sbp)} is partial; set a "
                                 f"split or broadcast layout with p.set_grad_sbp(...)")
            pl = param.placement
            inside = pl.coord() is not None
            if (inside and any(pl.shard_shape(param.shape, g_sbp, r) !=
                               pl.shard_shape(param.shape, param.sbp, r)
                               for r in pl.rank_list)) or \
                    (not inside and pl.shard_shape(param.shape, g_sbp) !=
                     tuple(param._local.shape)):
                # ZeRO: step a master shard in the gradient's layout. Decided from the
                # layouts over every rank of the placement, not from this rank's shard: a
                # (1, n) parameter split [1, 0] has the same shard shape on rank 0 only,
                # and ranks that decided differently would disagree on the write-back's
                # all-gather. (A rank outside the placement keeps its own answer.)
                self.zero = True
                with torch.no_grad():
                    shard = Tensor(param._local.detach(), pl, param.sbp, param.shape)
                    shard = shard.to_global(pl, g_sbp)._local.clone()
                self.target = shard.requires_grad_(True)
                self.mark_synced()

    def mark_synced(self) -> None:
        """Note that the master shard now equals the parameter's values."""
        self.synced = (self.param._local, self.param._local._version)

    def sync(self) -> None:
        """ZeRO: take the parameter's values into the master shard if something other
        than this optimizer wrote the parameter since (``load_state_dict``, an in-place
        edit); torch's version counter tells. Without it the next step would write the
        old master back over the new values."""
        if not self.zero:
            return
        p = self.param
        if self.synced is not None and self.synced[0] is p._local and \
                self.synced[1] == p._local._version:
            return
        with torch.no_grad():
            full = Tensor(p._local.detach(), p.placement, p.sbp, p.shape)
            self.target.copy_(full.to_global(p.placement, p.grad_sbp)._local)
        self.mark_synced()

    def load_grad(self) -> None:
        if self.zero:
            g = self.param.grad
            self.target.grad = None if g is None else g._local

    def write_back(self) -> None:
        if not self.zero:
            return
        p = self.param
        with torch.no_grad():
            src = Tensor(self.target.detach(), p.placement, p.grad_sbp, p.shape)
            p._local.copy_(src.to_global(p.placement, p.sbp)._local)
        self.mark_synced()

    def state_layout(self):
        p = self.param
        return (p.grad_sbp or p.sbp) if p.is_global else None


class Optimizer:
    """Mixin turning a ``torch.optim`` optimizer into one over sbpflow parameters (see the
    module doc). Subclasses list it first: ``class AdamW(Optimizer, torch.optim.AdamW)``.
    """

    def __init__(self, params, *args, **kwargs):
        self._slots: dict[int, _Slot] = {}  # id(torch target) -> slot
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if isinstance(groups[0], dict):
            groups = [dict(g, params=self._targets(g["params"])) for g in groups]
        else:
            groups = self._targets(groups)
        super().__init__(groups, *args, **kwargs)
        self.state = _ParamState(self._slots, self.state)

    def __setstate__(self, state: dict) -> None:
        """torch's (``load_state_dict`` ends in it), keeping ``state`` a
        :class:`_ParamState`."""
        super().__setstate__(state)
        if "_slots" in self.__dict__ and not isinstance(self.state, _ParamState):
            self.state = _ParamState(self._slots, self.state)

    def _targets(self, params) -> list:
        if isinstance(params, Tensor):
            params = [params]
        out = []
        for p in params:
            named = isinstance(p, tuple)
            name, p = p if named else (None, p)
            slot = _Slot(p)
            self._slots[id(slot.target)] = slot
            out.append((name, slot.target) if named else slot.target)
        return out

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; sbpflow parameters are mapped to their shards."""
        params = _as_list(param_group["params"])
        if params and not isinstance(params[0], torch.Tensor):
            params = self._targets(params)
        super().add_param_group(dict(param_group, params=params))

    def relayout(self) -> None:
        """Take the parameters' current layouts and gradient layouts (after
        ``p.set_grad_sbp``, a change of ``p``'s SBP or placement, as ZeRO and pipeline
        stages in ``nn.Graph`` make): every parameter's slot and optimizer target are made
        again, and state the optimizer already holds (a loaded checkpoint) is boxed from
        the old layout to the new one."""
        for group in self.param_groups:
            for i, t in enumerate(group["params"]):
                old = self._slots[id(t)]
                new = _Slot(old.param)
                if new.target is t:
                    continue
                st = self.state.pop(t, None)
                if st:
                    self.state[new.target] = {k: _relaid(v, old, new) for k, v in st.items()}
                del self._slots[id(t)]
                self._slots[id(new.target)] = new
                group["params"][i] = new.target

    @property
    def sbpflow_params(self) -> list[Tensor]:
        """The sbpflow Parameters this optimizer updates, in ``param_groups`` order."""
        return [self._slots[id(t)].param for g in self.param_groups for t in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every rank's shards (every rank of the world calls it when
        ZeRO parameters are present: their shards are all-gathered after the update).

        Raises:
            RuntimeError: a sparse gradient on an optimizer without a sparse update
                (``Adam``, ``AdamW``), naming the parameter, its gradient's source and
                the fix."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.load_grads()
        self._check_sparse_grads()
        self.update_shards()
        self.write_back()
        return loss

    # The step protocol. Eager ``step()`` and ``nn.Graph``'s compiled update both run a
    # step as: load_grads(); [unscale, clip]; update_shards(); write_back(). A graph also
    # calls sync_masters() around each replay (its program writes parameters and masters).

    def write_back(self) -> None:
        """After :meth:`update_shards`: ZeRO master shards are boxed back into their
        parameters (an all-gather where the parameter is ``B`` on a data-parallel axis; a
        cast where the master is fp32 and the parameter is not)."""
        for slot in self._slots.values():
            slot.write_back()

    # The update as one op of a compiled program (nn.Graph): the op names the optimizer by
    # a key; the registry maps keys to live optimizers (weakly: a dropped optimizer's
    # programs are dropped with its graph).
    PROGRAM_OP = None  # torch.ops.sbpflow.optimizer_step.default, set below

    def program_step(self, found_inf: torch.Tensor | None = None) -> None:
        """The step protocol traced into a program: :meth:`load_grads`, then one op
        (``sbpflow::optimizer_step``) that runs :meth:`update_shards` on the program's
        gradients at every replay (skipped when the 0-d ``found_inf`` is set: float16
        loss scaling), then :meth:`write_back` (its collectives traced as any)."""
        key = self.__dict__.get("_program_key")
        if key is None:
            key = self.__dict__["_program_key"] = next(_PROGRAM_KEYS)
            _PROGRAM_STEPS[key] = self
        self.load_grads()
        params = [t for g in self.param_groups for t in g["params"] if t.grad is not None]
        grads = [t.grad for t in params]
        state = [v for t in params for v in self.state[t].values()
                 if isinstance(v, torch.Tensor)]
        torch.ops.sbpflow.optimizer_step(params, grads, state, found_inf, key)
        self.write_back()
        self._opt_called = True  # as opt.step() tells its LR scheduler (no "called before")

    def param_of(self, target: torch.Tensor) -> Tensor:
        """The sbpflow parameter that ``target`` (a tensor of ``param_groups``: a shard or
        a ZeRO master shard) stands for."""
        return self._slots[id(target)].param

    @property
    def has_masters(self) -> bool:
        """Whether any parameter is stepped through a ZeRO master shard."""
        return any(slot.zero for slot in self._slots.values())

    # Whether this optimizer steps sparse (``torch.sparse_coo_tensor``) gradients.
    _takes_sparse_grads = False

    def update_shards(self) -> None:
        """The update of this rank's shards, gradients loaded (:meth:`load_grads`):
        torch's ``step``, without the empty shards (:func:`_empty_shards_hidden`).
        Subclasses with their own arithmetic (Adafactor, sparse SGD) override it."""
        with _empty_shards_hidden(self):
            super().step()

    def _check_sparse_grads(self) -> None:
        """Refuse sparse gradients, before torch's bare "does not support sparse
        gradients", with the parameter, where its gradient comes from and the fix."""
        if self._takes_sparse_grads:
            return
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            for i, t in enumerate(group["params"]):
                if t.grad is None or not t.grad.is_sparse:
                    continue
                param = self._slots[id(t)].param
                what = f"{names[i]!r}" if names else f"#{i} of param group {gi}"
                layout = f"{format_nd_sbp(param.sbp)} on {param.placement}" \
                    if param.is_global else "local"
                src = sparse_grad_source(param)
                origin = f", made by {src[0]}" if src else ""
                dense = src[1] if src else (
                    "nn.EmbeddingBag(..., sparse=False), nn.EmbeddingBagCollection(..., "
                    "sparse=False) or nn.PartialFC(..., sparse_grad=False), whichever made it")
                name = type(self).__name__
                raise RuntimeError(
                    f"{name} cannot step a sparse gradient: parameter {what} (shape "
                    f"{tuple(param.shape)}, {layout}) has a row-sparse gradient "
                    f"(torch.sparse_coo_tensor){origin}. Either step it with an optimizer that "
                    f"takes sparse gradients (sbpflow.optim.SGD, Adagrad, SparseAdam or "
                    f"SparseAdamW; the dense parameters can keep their own {name}), or make "
                    f"its gradient dense: {dense}")

    def load_grads(self) -> None:
        """Step protocol, first: point ZeRO master shards at their gradient buffers (before
        unscale / clip / :meth:`update_shards`), after taking into them what was written to
        their parameters meanwhile. A no-op without ZeRO."""
        for slot in self._slots.values():
            slot.sync()
            slot.load_grad()

    def sync_masters(self, written: bool = False) -> None:
        """Step protocol (graphs): ZeRO master shards take in the parameters' values where
        something else wrote them (``written=False``), or note that the masters match the
        parameters now (``written=True``: a compiled program just wrote both)."""
        for slot in self._slots.values():
            if slot.zero:
                slot.mark_synced() if written else slot.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for slot in self._slots.values():
            if slot.zero or slot.param.grad is not None:
                if set_to_none:
                    slot.param.grad = None
                else:
                    g = slot.param.grad
                    g._local.zero_()

    def state_dict(self) -> dict:
        """torch's optimizer state dict, with every shard-shaped state tensor given as a
        global tensor in its parameter's gradient layout (scalars such as ``step`` stay
        as they are)."""
        sd = super().state_dict()
        order = [t for g in self.param_groups for t in g["params"]]
        state = {}
        for idx, st in sd["state"].items():
            slot = self._slots[id(order[idx])]
            state[idx] = {k: self._to_global(slot, v) for k, v in st.items()}
        sd["state"] = state
        return sd

    @staticmethod
    def _to_global(slot: _Slot, v):
        p = slot.param
        if not p.is_global or not isinstance(v, torch.Tensor) or v.shape != slot.target.shape \
                or v.ndim == 0:
            return v
        return Tensor(v, p.placement, slot.state_layout(), p.shape)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict from :meth:`state_dict` (any placement, SBP or world size:
        global state tensors are boxed to each parameter's layout here) or from a torch
        optimizer over whole tensors."""
        order = [t for g in self.param_groups for t in g["params"]]
        state = {}
        for idx, st in state_dict["state"].items():
            slot = self._slots[id(order[int(idx)])]
            state[int(idx)] = {k: self._to_local(slot, v) for k, v in st.items()}
        super().load_state_dict(dict(state_dict, state=state))

    @staticmethod
    def _to_local(slot: _Slot, v):
        p = slot.param
        if isinstance(v, StoredTensor):  # from a checkpoint: read just this shard
            if p.is_global and tuple(v.shape) == tuple(p.shape) and v.ndim > 0:
                return v.to_global(p.placement, slot.state_layout())._local
            return v.full()
        if isinstance(v, Tensor):
            if not p.is_global:
                return torch.as_tensor(v.numpy()) if v.is_global else v.to_torch()
            if v.is_global:
                if v.placement == p.placement:
                    return v.to_global(p.placement, slot.state_layout())._local
                v = Tensor(torch.as_tensor(v.numpy()))
            v = v.to_torch()
        if p.is_global and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) \
                and v.ndim > 0:
            return _make_tensor(v, placement=p.placement, sbp=slot.state_layout())._local
        return v


#: torch optimizers whose only state that is not elementwise is the ``step`` count.
_STEP_ONLY = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
              torch.optim.SparseAdam, torch.optim.Adadelta, torch.optim.Adamax,
              torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)


_PROGRAM_STEPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> optimizer
_PROGRAM_KEYS = itertools.count()
_LIB = torch.library.Library("sbpflow", "FRAGMENT")  # noqa: TID251 - the program's update op
_LIB.define("optimizer_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state, "
            "Tensor? found_inf, int optimizer) -> ()")


def _program_step(params, grads, state, found_inf, key: int) -> None:
    opt = _PROGRAM_STEPS[key]
    if found_inf is not None and found_inf.item():
        return  # float16 loss scaling: a step with inf/nan gradients is skipped (GradScaler)
    saved = [p.grad for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    try:
        opt.update_shards()  # torch's step, as eager Optimizer.step runs it
    finally:
        for p, g in zip(params, saved):
            p.grad = g


_LIB.impl("optimizer_step", _program_step, "CompositeExplicitAutograd")
Optimizer.PROGRAM_OP = torch.ops.sbpflow.optimizer_step.default

@contextlib.contextmanager
def _empty_shards_hidden(opt) -> Iterator[None]:
    """Hide from torch's ``step`` the parameters whose shard on this rank is empty (a
    rank outside the placement: another pipeline stage's parameters), once their state
    exists, and count their ``step`` as torch would. Their update has no element to
    change; torch's per-parameter loop still costs tens of microseconds each (a pipeline
    stage's rank holds about as many empty shards as real ones). Only for optimizers
    whose other state is elementwise (:data:`_STEP_ONLY`) and without a GradScaler's
    fused ``found_inf`` (which may take a step back)."""
    hidden = []
    if isinstance(opt, _STEP_ONLY) and getattr(opt, "found_inf", None) is None and \
            getattr(opt, "grad_scale", None) is None:
        hidden = [(p, p.grad) for group in opt.param_groups for p in group["params"]
                  if p.grad is not None and p.numel() == 0 and opt.state.get(p)]
    for p, _ in hidden:
        p.grad = None
    try:
        yield
        for p, _ in hidden:
            state = opt.state[p]
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.add_(1)
            elif step is not None:
                state["step"] = step + 1
    finally:
        for p, g in hidden:
            p.grad = g


def _relaid(v, old: _Slot, new: _Slot):
    """Optimizer state ``v`` laid out as ``old``'s target, boxed to ``new``'s layout."""
    if old.layout is None or new.layout is None or not isinstance(v, torch.Tensor) or \
            v.ndim == 0 or v.shape != old.target.shape:
        return v
    p = new.param
    with torch.no_grad():
        full = Tensor(v, old.layout[0], old.layout[1], p.shape)
        return full.to_global(*new.layout)._local.clone()


def _as_list(params) -> list:
    return [params] if isinstance(params, (Tensor, torch.Tensor)) else list(params)


class SGD(Optimizer, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight_decay, maximize,
    foreach) over sbpflow parameters; see :mod:`sbpflow.optim`.

    Dense gradients: exactly torch's update (its kernels, state and ``state_dict``).

    Sparse gradients (a ``torch.sparse_coo_tensor`` of row-sparse gradients, as
    ``nn.EmbeddingBag(sparse=True)`` and ``nn.PartialFC`` with sampling make): with
    ``momentum = 0`` and ``weight_decay = 0`` torch's sparse update (``p -= lr * g`` on the
    touched rows). Otherwise **lazy momentum**, the update of the original Partial FC (An
    et al. 2021, arXiv 2010.05222; InsightFace ``arcface_torch/partial_fc.py``, which copies
    the sampled rows of the weight and of its momentum into a sub-parameter, steps it with
    ``torch.optim.SGD`` and writes both back). For each row ``r`` of the coalesced gradient
    (duplicates summed), in torch's order of operations::

        g_r = -g_r if maximize else g_r
        g_r = g_r + weight_decay * p_r
        buf_r = g_r                 if buf_r is all zero (never touched: torch's first step)
              = momentum * buf_r + (1 - dampening) * g_r     otherwise
        p_r = p_r - lr * (g_r + momentum * buf_r  if nesterov else  buf_r)

    Rows the gradient does not touch, and their momentum, stay bit-identical: no decay of
    the buffer, no weight decay. ``state["momentum_buffer"]`` is dense and shard-shaped as
    for dense gradients, so ``state_dict`` / ``load_state_dict`` and checkpoints (global
    state tensors, any world size) work unchanged, and a parameter may get dense gradients
    in some steps and sparse ones in others. With ``dampening = 0`` (the default) the
    first-touch rule equals the general one (``momentum * 0 + g_r``); with ``dampening > 0``
    a row whose buffer is exactly zero (touched only by exactly-zero gradients so far)
    also starts at ``g_r``.

    torch 2.13's own ``torch.optim.SGD`` with a sparse gradient: with ``weight_decay > 0``
    it raises ``RuntimeError: add(sparse, dense) is not supported``; with ``momentum > 0``
    it keeps a *sparse* momentum buffer that grows to every row ever touched, and each of
    those rows keeps decaying and moving at every later step (dense-momentum semantics
    over the rows seen so far, not lazy momentum). sbpflow's ``SGD`` does neither.

    Raises:
        NotImplementedError: a sparse gradient with more than one sparse dimension, or
            lazy momentum under a ``GradScaler`` with ``fused=True``."""

    _takes_sparse_grads = True

    def update_shards(self) -> None:
        """Lazy momentum for the sparse gradients that need it, torch's step for the
        rest (their gradients hidden from it meanwhile)."""
        lazy = [(p, group) for group in self.param_groups
                if group["momentum"] or group["weight_decay"]
                for p in group["params"] if p.grad is not None and p.grad.is_sparse]
        if lazy and (getattr(self, "grad_scale", None) is not None or
                     getattr(self, "found_inf", None) is not None):
            raise NotImplementedError("SGD: lazy momentum for sparse gradients does not take "
                                      "a GradScaler's fused scale; use fused=False")
        for p, group in lazy:
            _lazy_sgd(p, p.grad, self.state[p], group)
        hidden = [(p, p.grad) for p, _ in lazy]
        for p, _ in hidden:
            p.grad = None
        try:
            super().update_shards()
        finally:
            for p, g in hidden:
                p.grad = g


def _lazy_sgd(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """:class:`SGD`'s lazy momentum update of ``p`` (a shard) on the rows of the sparse
    ``grad``; ``state["momentum_buffer"]`` is made dense (zeros) on first use."""
    if grad.sparse_dim() != 1:
        raise NotImplementedError(f"SGD: a sparse gradient with {grad.sparse_dim()} sparse "
                                  f"dimensions; lazy momentum takes row-sparse gradients "
                                  f"(sparse_dim 1, as embedding lookups make)")
    g = grad.coalesce()
    rows, vals = g.indices()[0], g.values()
    if group["maximize"]:
        vals = -vals
    lr, wd = group["lr"], group["weight_decay"]
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    p_rows = p.index_select(0, rows)
    if wd:
        vals = vals.add(p_rows, alpha=wd)
    momentum = group["momentum"]
    if momentum:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(p)
        elif buf.is_sparse:  # torch's own sparse buffer (a state from torch's SGD)
            buf = state["momentum_buffer"] = buf.to_dense()
        b = buf.index_select(0, rows)
        # (no reshape(n, -1): a shard that no id reached has n = 0 rows)
        fresh = (b == 0).reshape(b.shape[0], math.prod(b.shape[1:])).all(1)
        fresh = fresh.view(-1, *[1] * (b.ndim - 1))
        b = torch.where(fresh, vals, b.mul(momentum).add_(vals, alpha=1 - group["dampening"]))
        buf.index_copy_(0, rows, b)
        vals = vals.add(b, alpha=momentum) if group["nesterov"] else b
    p.index_copy_(0, rows, p_rows.add_(vals, alpha=-lr))


class Adam(Optimizer, torch.optim.Adam):
    """``torch.optim.Adam`` (betas, eps, weight_decay, amsgrad, foreach...) over sbpflow
    parameters; see :mod:`sbpflow.optim`."""


class AdamW(Optimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2) over sbpflow
    parameters; see :mod:`sbpflow.optim`."""


class Adadelta(Optimizer, torch.optim.Adadelta):
    """``torch.optim.Adadelta`` (rho, eps, weight_decay; state ``square_avg`` and
    ``acc_delta``, elementwise) over sbpflow parameters; see :mod:`sbpflow.optim`."""


class Adamax(Optimizer, torch.optim.Adamax):
    """``torch.optim.Adamax`` (Adam with the infinity norm; state ``exp_avg`` and
    ``exp_inf``, elementwise) over sbpflow parameters; see :mod:`sbpflow.optim`."""


class ASGD(Optimizer, torch.optim.ASGD):
    """``torch.optim.ASGD``, averaged SGD (state ``ax``, elementwise, and the 0-d ``eta``
    and ``mu``, equal on every rank) over sbpflow parameters; see :mod:`sbpflow.optim`."""


class NAdam(Optimizer, torch.optim.NAdam):
    """``torch.optim.NAdam`` (Nesterov Adam, momentum_decay, decoupled_weight_decay; state
    ``exp_avg``, ``exp_avg_sq`` and the 0-d ``mu_product``) over sbpflow parameters; see
    :mod:`sbpflow.optim`."""


class RAdam(Optimizer, torch.optim.RAdam):
    """``torch.optim.RAdam`` (rectified Adam, decoupled_weight_decay; the rectification
    depends on the step count only) over sbpflow parameters; see :mod:`sbpflow.optim`."""


class RMSprop(Optimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` (alpha, momentum, centered; state ``square_avg``,
    ``momentum_buffer``, ``grad_avg``, elementwise) over sbpflow parameters; see
    :mod:`sbpflow.optim`."""


class Rprop(Optimizer, torch.optim.Rprop):
    """``torch.optim.Rprop`` (etas, step_sizes; state ``prev`` and ``step_size``,
    elementwise: each element's step follows the sign of its own gradient) over sbpflow
    parameters; see :mod:`sbpflow.optim`."""


class Adagrad(Optimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` (lr_decay, weight_decay, initial_accumulator_value, eps)
    over sbpflow parameters; with sparse gradients (sharded embedding tables) torch's
    sparse update changes only the touched rows and their ``sum`` state (weight_decay
    must then be 0, as in torch). See :mod:`sbpflow.optim`."""

    _takes_sparse_grads = True


class SparseAdam(Optimizer, torch.optim.SparseAdam):
    """``torch.optim.SparseAdam``: "lazy" Adam for sparse gradients (every parameter's
    gradient must be sparse: give the dense parameters their own ``Adam``).

    Semantics (torch's): for the rows a step's gradient touches, ``m`` and ``v`` are
    updated as Adam's (``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``) and the row
    moves by ``lr * m_hat / (sqrt(v_hat) + eps)``; rows not touched keep their values and
    moments exactly (their moments do not decay). The bias correction uses the
    parameter's step count (one per ``step()``, the same for every row), not a per-row
    count. On sharded tables each rank steps its shard. See :mod:`sbpflow.optim`."""

    _takes_sparse_grads = True


class SparseAdamW(SparseAdam):
    """Lazy AdamW: :class:`SparseAdam` with decoupled weight decay (Loshchilov & Hutter,
    "Decoupled Weight Decay Regularization", 2019, as ``torch.optim.AdamW``) applied to
    the **touched rows only**: each row in this step's sparse gradient is first scaled by
    ``1 - lr * weight_decay``, then takes the lazy Adam step; untouched rows neither decay
    nor move (a dense AdamW would shrink every row every step, which is what sparse
    updates avoid). ``weight_decay`` defaults to 1e-2 as AdamW's.

    Raises:
        ValueError: ``weight_decay`` < 0; (torch's) a dense gradient."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, maximize: bool = False):
        if weight_decay < 0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._weight_decay = weight_decay  # read by add_param_group during __init__
        super().__init__(params, lr=lr, betas=betas, eps=eps, maximize=maximize)
        self.defaults["weight_decay"] = weight_decay

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.param_groups[-1].setdefault("weight_decay", self._weight_decay)

    def update_shards(self) -> None:
        """Decay the touched rows, then torch's lazy Adam step."""
        for group in self.param_groups:
            wd, lr = group.get("weight_decay", 0.0), group["lr"]
            if not wd:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise RuntimeError("SparseAdamW does not support dense gradients, please "
                                       "consider AdamW instead")
                rows = p.grad.coalesce().indices()[0]
                p[rows] *= 1 - lr * wd
        super().update_shards()


def _global_view(slot: _Slot, t: torch.Tensor) -> Tensor:
    """``t`` (the slot's target, its gradient or a state tensor shaped like them) as the
    sbpflow tensor it is a shard of: global in the target's layout, or local."""
    p = slot.param
    if not p.is_global:
        return Tensor(t)
    return Tensor(t, slot.layout[0], slot.layout[1], p.shape)


def _reduced_layout(slot: _Slot, dim: int):
    """(placement, nd-SBP, global shape) of a state tensor that is the target reduced over
    ``dim`` (kept as size 1): the target's layout with a split of ``dim`` made broadcast."""
    from ..sbp import broadcast

    p = slot.param
    shape = list(p.shape)
    shape[dim] = 1
    sbp = tuple(broadcast if s.is_split() and s.dim == dim else s for s in slot.layout[1])
    return slot.layout[0], sbp, tuple(shape)


class Adafactor(Optimizer, torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with
    Sublinear Memory Cost", ICML 2018, in torch 2.13's variant: ``beta2_decay``, ``eps =
    (eps1, eps2)``, ``d``, decoupled ``weight_decay``, ``maximize``) over sbpflow
    parameters, local or global.

    Unlike the elementwise optimizers, Adafactor's update is not the same update applied
    to each shard: it reads the parameter's RMS, the row and column means of the squared
    gradient (its factored second moment) and the update's RMS, all of the *whole*
    parameter. sbpflow runs torch's algorithm, operation by operation in torch's order, on
    the global parameter: each of those reductions is a global op (a split dimension's
    mean is summed across its ranks), so a data-parallel, tensor-parallel or ZeRO run
    follows one process. State (torch's names and shapes): ``step`` (0-d float32),
    ``row_var`` (the gradient shape with the last dim 1) and ``col_var`` (with dim -2 of
    size 1) for parameters of 2 or more dims, ``variance`` (elementwise) for vectors.
    ``row_var`` and ``col_var`` are laid out as the gradient, with a split of their size-1
    dim made broadcast; ``state_dict`` gives them as global tensors in that layout.

    Every rank of the placement calls :meth:`step` (it runs collectives: ``.item()`` of
    global norms). ``foreach`` is accepted and ignored (one path).

    Raises:
        RuntimeError: a sparse or complex gradient (torch's refusal)."""

    def update_shards(self) -> None:
        for group in self.param_groups:
            for t in group["params"]:
                if t.grad is None:
                    continue
                if t.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                if torch.is_complex(t):
                    raise RuntimeError("Adafactor does not support complex parameters")
                self._step_one(self._slots[id(t)], t, group)

    def _state_views(self, slot: _Slot, t: torch.Tensor) -> tuple:
        """(step, row_var, col_var, variance) of ``t``, made on first use as torch's
        ``_init_group`` makes them; the factored moments as global views."""
        state = self.state[t]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if slot.param.ndim > 1:
                for key, dim in (("row_var", -1), ("col_var", -2)):
                    state[key] = self._new_factor(slot, t, dim)
            else:
                state["variance"] = torch.zeros_like(t.grad,
                                                     memory_format=torch.preserve_format)
        views = [state["step"]]
        for key, dim in (("row_var", -1), ("col_var", -2)):
            v = state.get(key)
            if v is not None and slot.param.is_global:
                pl, sbp, shape = _reduced_layout(slot, slot.param.ndim + dim)
                v = Tensor(v, pl, sbp, shape)
            elif v is not None:
                v = Tensor(v)
            views.append(v)
        var = state.get("variance")
        views.append(None if var is None else _global_view(slot, var))
        return tuple(views)

    @staticmethod
    def _new_factor(slot: _Slot, t: torch.Tensor, dim: int) -> torch.Tensor:
        if not slot.param.is_global:
            shape = list(t.grad.shape)
            shape[dim] = 1
            return t.grad.new_zeros(shape)
        pl, sbp, shape = _reduced_layout(slot, slot.param.ndim + dim)
        return t.grad.new_zeros(pl.shard_shape(shape, sbp))

    def _step_one(self, slot: _Slot, t: torch.Tensor, group: dict) -> None:
        step_t, row_var, col_var, variance = self._state_views(slot, t)
        param = _global_view(slot, t)
        grad = _global_view(slot, t.grad)
        if group["maximize"]:
            grad = -grad
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(t.dtype).eps
        step_t += 1
        step = step_t.item()
        one_minus_beta2_t = step ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step ** 0.5))
        alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        if grad.ndim > 1:
            row_mean = grad.norm(dim=-1, keepdim=True).square().div(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = grad.norm(dim=-2, keepdim=True).square().div(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate = var_estimate.div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
        else:
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp(min=eps1 * eps1).rsqrt().mul(grad)
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * group["d"]))
        param.add_(update, alpha=-alpha / denom)

    def state_dict(self) -> dict:
        """:meth:`Optimizer.state_dict`, with ``row_var`` and ``col_var`` of global
        parameters as global tensors (see the class doc)."""
        sd = super().state_dict()
        order = [t for g in self.param_groups for t in g["params"]]
        for idx, st in sd["state"].items():
            slot = self._slots[id(order[idx])]
            for key, dim in (("row_var", -1), ("col_var", -2)):
                if slot.param.is_global and isinstance(st.get(key), torch.Tensor):
                    pl, sbp, shape = _reduced_layout(slot, slot.param.ndim + dim)
                    st[key] = Tensor(st[key], pl, sbp, shape)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """:meth:`Optimizer.load_state_dict`; ``row_var`` and ``col_var`` (global, local or
        whole torch tensors) are boxed or sliced to this parameter's factor layout."""
        order = [t for g in self.param_groups for t in g["params"]]
        sd = dict(state_dict, state={})
        for idx, st in state_dict["state"].items():
            slot = self._slots[id(order[int(idx)])]
            st = dict(st)
            for key, dim in (("row_var", -1), ("col_var", -2)):
                if key in st and slot.param.is_global:
                    pl, sbp, _ = _reduced_layout(slot, slot.param.ndim + dim)
                    st[key] = _factor_shard(st[key], pl, sbp)
            sd["state"][idx] = st
        super().load_state_dict(sd)


def _factor_shard(v, placement, sbp) -> torch.Tensor:
    """A saved Adafactor factor (global, local, stored or torch) as this rank's shard of
    ``sbp`` on ``placement``."""
    if isinstance(v, StoredTensor):
        v = v.full()
    if isinstance(v, Tensor):
        if v.is_global and v.placement == placement:
            return v.to_global(placement, sbp)._local
        v = torch.as_tensor(v.numpy())
    return _make_tensor(v, placement=placement, sbp=sbp)._local


class _Reducer:
    """LBFGS's reductions of flat vectors (the concatenation of this rank's shards of
    every parameter, in ``param_groups`` order) over the whole parameter vector.

    A dot product or sum counts each element of the global parameters once: a shard
    replicated along broadcast mesh axes counts on the replica at coordinate 0 of those
    axes only (``keep``), and the ranks' partial sums are all-reduced over the world.
    ``max`` (of absolute values: LBFGS's tolerances) is all-reduced as a max. Where every
    rank holds every parameter whole (local parameters, or broadcast on a placement of
    the whole world) nothing is reduced: the local value is the global one."""

    def __init__(self, slots: list):
        from ..distributed import _state

        kinds = {s.param.is_global for s in slots}
        if len(kinds) > 1:
            raise ValueError("LBFGS takes local parameters or global parameters, not both: "
                             "its search direction is one vector over all of them")
        world = _state.get_world_size() if _state.is_initialized() else 1
        self.ranks = list(range(world))
        self.distributed = kinds == {True} and world > 1 and any(
            len(s.layout[0].ranks.reshape(-1)) != world or
            not all(x.is_broadcast() for x in s.layout[1]) for s in slots)
        masks, partial = [], False
        for s in slots:
            n = s.target.numel()
            owner = True
            if s.param.is_global and n:
                coord = s.layout[0].coord()
                owner = all(coord[a] == 0 for a, x in enumerate(s.layout[1])
                            if x.is_broadcast())
            partial = partial or not owner
            masks.append(torch.full((n,), owner, dtype=torch.bool))
        self.keep = torch.cat(masks) if partial and self.distributed and masks else None

    def _all_reduce(self, v: torch.Tensor, op: str) -> torch.Tensor:
        if not self.distributed:
            return v
        from ..distributed import _comm

        return _comm.all_reduce(v.reshape(1), self.ranks, op=op).reshape(())

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(v.sum() if self.keep is None else v[self.keep].sum(), "sum")

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        local = a.dot(b) if self.keep is None else (a * b)[self.keep].sum()
        return self._all_reduce(local, "sum")

    def max(self, v: torch.Tensor) -> torch.Tensor:
        local = v.max() if v.numel() else v.new_zeros(())  # of |x|: 0 is the identity
        return self._all_reduce(local, "max")


class _FlatShards(torch.Tensor):
    """A flat vector of :class:`LBFGS`'s (this rank's shards, concatenated). torch's LBFGS
    code runs on it unchanged; its whole-vector reductions (``dot``, ``sum()``,
    ``max()``) are answered by the optimizer's :class:`_Reducer` over the global vector,
    as plain 0-d tensors; every other op is torch's, on the local elements."""

    reducer: _Reducer | None = None  # set by LBFGS.step for its duration

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        red = _FlatShards.reducer
        if red is not None and not kwargs:
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, torch.Tensor) else a
                     for a in args]
            if func in (torch.Tensor.dot, torch.dot) and len(plain) == 2:
                return red.dot(*plain)
            if func is torch.Tensor.sum and len(plain) == 1:
                return red.sum(plain[0])
            if func is torch.Tensor.max and len(plain) == 1:
                return red.max(plain[0])
        return super().__torch_function__(func, types, args, kwargs)


class LBFGS(Optimizer, torch.optim.LBFGS):
    """``torch.optim.LBFGS`` (lr, max_iter, max_eval, tolerance_grad, tolerance_change,
    history_size, ``line_search_fn="strong_wolfe"``) over sbpflow parameters, local or
    global: torch's algorithm on the flat vector of this rank's shards, with every
    whole-vector reduction global (:class:`_Reducer`: dot products and sums count each
    element of the global parameters once, all-reduced over the world; the tolerances'
    max is all-reduced). Every decision LBFGS takes (curvature test, step length, line
    search, stopping) reads only reduced values and the loss, so every rank takes the
    same ones and a data-, tensor-parallel or ZeRO run follows one process.

    ``step(closure)``: ``closure`` clears the gradients, computes the loss, calls
    ``backward`` and returns the loss, as in torch; every rank of the world calls
    :meth:`step`. ZeRO parameters (a gradient layout with a smaller shard) are written
    back from their master shard before each evaluation.

    Raises:
        ValueError: more than one parameter group (torch's), or local and global
            parameters together.
        RuntimeError: ``step()`` without a closure.
        NotImplementedError: :meth:`state_dict` of a run whose parameters are split or
            not on every rank (the history is a flat vector of this rank's shards; it
            is not yet saved as global tensors)."""

    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("LBFGS.step needs a closure that clears the gradients, "
                               "computes the loss, calls backward and returns the loss: "
                               "opt.step(closure)")
        slots = [self._slots[id(t)] for t in self._params]

        def evaluate():
            for slot in slots:
                slot.write_back()
            loss = closure()
            self.load_grads()
            self._check_sparse_grads()
            return loss

        previous = _FlatShards.reducer
        _FlatShards.reducer = _Reducer(slots)
        try:
            with torch.no_grad():
                loss = torch.optim.LBFGS.step(self, evaluate)
        finally:
            _FlatShards.reducer = previous
        for slot in slots:
            slot.write_back()
        return loss

    def _gather_flat_grad(self):
        return super()._gather_flat_grad().as_subclass(_FlatShards)

    def state_dict(self) -> dict:
        slots = [self._slots[id(t)] for t in self._params]
        if _Reducer(slots).distributed and any(self.state.values()):
            raise NotImplementedError(
                "LBFGS.state_dict with split parameters or parameters not on every rank: "
                "its history (old_dirs, old_stps, d, prev_flat_grad) is a flat vector of "
                "this rank's shards and is not saved as global tensors yet. Save the model "
                "alone; a resumed LBFGS rebuilds its history in a few steps")
        return super().state_dict()
