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
import math
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
           "lr_scheduler"]


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
            if pl.shard_shape(param.shape, g_sbp) != tuple(param._local.shape):
                # ZeRO: step a master shard in the gradient's layout.
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
        self._load_grads()
        self._check_sparse_grads()
        self._torch_step()
        for slot in self._slots.values():
            slot.write_back()
        return loss

    # Whether this optimizer steps sparse (``torch.sparse_coo_tensor``) gradients.
    _takes_sparse_grads = False

    def _torch_step(self) -> None:
        """The update of the shards (gradients loaded): torch's ``step``, without the
        empty shards (:func:`_empty_shards_hidden`)."""
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

    def _load_grads(self) -> None:
        """Point ZeRO master shards at their gradient buffers (before unscale / step),
        after taking into them what was written to their parameters meanwhile."""
        for slot in self._slots.values():
            slot.sync()
            slot.load_grad()

    def _sync_masters(self, written: bool = False) -> None:
        """ZeRO master shards: take in the parameters' values where something else wrote
        them (``written=False``), or note that the masters match the parameters now
        (``written=True``: a compiled program just wrote both)."""
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
              torch.optim.SparseAdam)


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

    def _torch_step(self) -> None:
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
            super()._torch_step()
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

    def _torch_step(self) -> None:
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
        super()._torch_step()
