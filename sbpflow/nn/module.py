"""``sbpflow.nn.Module`` and ``Parameter``: torch.nn.Module's API over sbpflow tensors.

A module's parameters and buffers are :class:`sbpflow.Tensor` s, local or global. The
registration rules, iteration order, state-dict keys, hook semantics and error messages
follow ``torch.nn.Module`` (torch/nn/modules/module.py), so code written against torch's
Module ports unchanged. Two additions:

* :meth:`Module.to_global` lays every parameter and buffer out on a placement (one SBP for
  all, or per name), the way OneFlow's ``Module.to_global`` does; every rank holds the
  whole module before the call (same seed), the value at mesh coordinate 0 wins;
* :meth:`Module.to_local` brings a global module back to whole local tensors.

Hooks return :class:`torch.utils.hooks.RemovableHandle`, as torch's do.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from ..checkpoint import StoredTensor
from ..distributed._state import _state as _dstate
from ..ops.creation import tensor as _make_tensor
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, format_nd_sbp, normalize_nd_sbp
from ..tensor import Tensor
from . import _buffer_sync

__all__ = ["Module", "Parameter", "IncompatibleKeys", "UninitializedParameter",
           "UninitializedBuffer", "is_lazy"]

_EXTRA_STATE = "_extra_state"  # the state-dict key of get_extra_state (torch's)


class Parameter(Tensor):
    """A tensor that a :class:`Module` registers as a parameter (``torch.nn.Parameter``).

    ``Parameter(data, requires_grad=True)``: ``data`` is an sbpflow tensor (local or global;
    the parameter keeps its placement, SBP and gradient layout) or a ``torch.Tensor``
    (local). The storage is shared with ``data`` (as torch does); the parameter is a new
    leaf.
    """

    __slots__ = ()

    def __init__(self, data: Tensor | torch.Tensor | None = None, requires_grad: bool = True):
        grad_sbp = None
        if data is None:
            data = torch.empty(0)
        if isinstance(data, Tensor):
            local, pl, sbp, shape = data._local.detach(), data.placement, data.sbp, data.shape
            if data.is_global and data.grad_sbp not in (None, data.sbp):
                grad_sbp = data.grad_sbp
        elif isinstance(data, torch.Tensor):
            local, pl, sbp, shape = data.detach(), None, None, None
        else:
            raise TypeError(f"Parameter data must be an sbpflow.Tensor or torch.Tensor, got "
                            f"{type(data).__name__}")
        super().__init__(local, pl, sbp, shape)
        if requires_grad:
            self.requires_grad_(True)
        if grad_sbp is not None:
            self.set_grad_sbp(grad_sbp)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        src = Tensor(self._local.detach().clone(), self.placement, self.sbp, self.shape)
        out = Parameter(src, requires_grad=self.requires_grad)
        if self.is_global and self.grad_sbp not in (None, self.sbp):
            out.set_grad_sbp(self.grad_sbp)
        memo[id(self)] = out
        return out


class UninitializedParameter(Parameter):
    """A parameter whose shape is not known yet (``torch.nn.UninitializedParameter``),
    held by the ``Lazy*`` layers until their first forward infers it.

    It is an empty local tensor of the requested dtype and device (casts such as
    ``module.double()`` apply to it) and must not be used in ops. :meth:`materialize`
    gives it its shape (uninitialised memory, filled by the layer's
    ``reset_parameters``) and turns it into a plain :class:`Parameter`, the same object.
    ``Module.to_global`` before that does not lay it out: the layer records the layout and
    applies it when it materialises (see :mod:`sbpflow.nn.modules.lazy`).
    """

    __slots__ = ()
    cls_to_become = Parameter

    def __init__(self, requires_grad: bool = True, device=None, dtype=None):
        super().__init__(torch.empty(0, device=device, dtype=dtype), requires_grad)

    def materialize(self, shape, device=None, dtype=None) -> None:
        """Give this parameter ``shape`` (``torch.nn.UninitializedParameter.materialize``):
        uninitialised values of its dtype and device (or those given); it becomes a
        :class:`Parameter`."""
        _materialize(self, shape, device, dtype)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = UninitializedParameter(self.requires_grad, self.device, self.dtype)
        return memo[id(self)]

    def __repr__(self) -> str:
        return "<UninitializedParameter>"


class UninitializedBuffer(Tensor):
    """A buffer whose shape is not known yet (``torch.nn.UninitializedBuffer``): as
    :class:`UninitializedParameter`, for the running statistics of the ``LazyBatchNorm``
    and ``LazyInstanceNorm`` layers; materialised into a plain :class:`sbpflow.Tensor`."""

    __slots__ = ()
    cls_to_become = Tensor

    def __init__(self, requires_grad: bool = False, device=None, dtype=None):
        super().__init__(torch.empty(0, device=device, dtype=dtype))
        if requires_grad:
            self.requires_grad_(True)

    def materialize(self, shape, device=None, dtype=None) -> None:
        """Give this buffer ``shape`` (uninitialised values); it becomes a plain
        :class:`sbpflow.Tensor`."""
        _materialize(self, shape, device, dtype)

    def __repr__(self) -> str:
        return "<UninitializedBuffer>"


def is_lazy(t) -> bool:
    """Whether ``t`` is an :class:`UninitializedParameter` or :class:`UninitializedBuffer`
    (``torch.nn.parameter.is_lazy``)."""
    return isinstance(t, (UninitializedParameter, UninitializedBuffer))


def _materialize(t: Tensor, shape, device, dtype) -> None:
    old = t._local
    new = torch.empty(tuple(int(n) for n in shape), device=device or old.device,
                      dtype=dtype or old.dtype)
    _replace_local(t, new)
    object.__setattr__(t, "_shape", new.shape)
    t.__class__ = type(t).cls_to_become


def _replace_local(t: Tensor, new_local: torch.Tensor) -> None:
    """Give ``t`` a new local shard (dtype or device change), keeping it a leaf with the
    same ``requires_grad`` and gradient layout. Parameter identity is preserved, so
    optimizers built before ``module.to(...)`` keep working, as in torch."""
    grad_sbp = t.grad_sbp
    flag = t.requires_grad
    object.__setattr__(t, "_local", new_local.detach())
    if flag:
        t.requires_grad_(True)
        if t.is_global and grad_sbp not in (None, t.sbp):
            t.set_grad_sbp(grad_sbp)


class IncompatibleKeys(NamedTuple):
    """What :meth:`Module.load_state_dict` returns (torch's ``_IncompatibleKeys``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of sbpflow modules; subclass it as you would ``torch.nn.Module``.

    Attributes set to a :class:`Parameter` are registered as parameters, to a
    :class:`Module` as submodules; :meth:`register_buffer` registers tensors that are
    state but not parameters (``persistent=False``: not in the state dict).
    """

    training: bool

    def __init__(self) -> None:
        s = super().__setattr__
        s("training", True)
        s("_parameters", OrderedDict())
        s("_buffers", OrderedDict())
        s("_non_persistent_buffers_set", set())
        s("_modules", OrderedDict())
        s("_forward_pre_hooks", OrderedDict())
        s("_forward_pre_hooks_with_kwargs", set())
        s("_forward_hooks", OrderedDict())
        s("_forward_hooks_with_kwargs", set())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f'Module [{type(self).__name__}] is missing the required '
                                  f'"forward" function')

    # ------------------------------------------------------------------ registration
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` (or ``None``) as parameter ``name``.

        Raises:
            AttributeError: before ``Module.__init__`` ran.
            KeyError: empty name, a name with ``.``, or one that is already an attribute.
            TypeError: ``param`` is not a Parameter or None.
        """
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        self._check_name(name, "parameter", self._parameters)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter "
                            f"'{name}' (sbpflow.nn.Parameter or None required)")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Register ``tensor`` (an sbpflow tensor or None) as buffer ``name``; a
        non-persistent buffer is left out of :meth:`state_dict`."""
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffer before Module.__init__() call")
        self._check_name(name, "buffer", self._buffers)
        if isinstance(tensor, torch.Tensor):
            tensor = Tensor(tensor)
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer "
                            f"'{name}' (sbpflow.Tensor or None required)")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Register ``module`` as submodule ``name`` (``torch.nn.Module.add_module``)."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a sbpflow.nn.Module subclass")
        self._check_name(name, "module", self._modules)
        self._modules[name] = module

    register_module = add_module

    def _check_name(self, name, kind: str, table: dict) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if name == "":
            raise KeyError(f'{kind} name can\'t be empty string ""')
        if "." in name:
            raise KeyError(f'{kind} name can\'t contain ".", got {name!r}')
        if hasattr(self, name) and name not in table:
            raise KeyError(f"attribute '{name}' already exists")

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._drop(name, keep_parameter=True)  # a re-assigned parameter keeps its place
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                f"(sbpflow.nn.Parameter or None expected)")
            params[name] = None
        elif isinstance(value, Module):
            if params is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._drop(name)
            self._modules[name] = value
        elif self.__dict__.get("_modules") is not None and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module "
                                f"'{name}' (sbpflow.nn.Module or None expected)")
            self._modules[name] = None
        elif self.__dict__.get("_buffers") is not None and name in self._buffers:
            if value is not None and not isinstance(value, (Tensor, torch.Tensor)):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                                f"(sbpflow.Tensor or None expected)")
            self._buffers[name] = Tensor(value) if isinstance(value, torch.Tensor) else value
        else:
            super().__setattr__(name, value)

    def _drop(self, name: str, keep_parameter: bool = False) -> None:
        self.__dict__.pop(name, None)
        tables = (self._buffers, self._modules) if keep_parameter else (
            self._parameters, self._buffers, self._modules)
        for table in tables:
            table.pop(name, None)
        self._non_persistent_buffers_set.discard(name)

    def __getattr__(self, name: str):
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                self._non_persistent_buffers_set.discard(name)
                return
        super().__delattr__(name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers)
                      | set(self._modules))

    def get_submodule(self, target: str) -> Module:
        """The submodule at dotted path ``target`` ("" is this module)."""
        mod = self
        for item in target.split(".") if target else []:
            if not isinstance(mod, Module) or item not in mod._modules:
                raise AttributeError(f"{type(mod).__name__} has no submodule `{item}` "
                                     f"(looking up {target!r})")
            mod = mod._modules[item]
        return mod

    def get_parameter(self, target: str) -> Parameter:
        """The parameter at dotted path ``target``."""
        mod_path, _, name = target.rpartition(".")
        mod = self.get_submodule(mod_path)
        if name not in mod._parameters:
            raise AttributeError(f"{type(mod).__name__} has no parameter `{name}`")
        return mod._parameters[name]

    def get_buffer(self, target: str) -> Tensor:
        """The buffer at dotted path ``target``."""
        mod_path, _, name = target.rpartition(".")
        mod = self.get_submodule(mod_path)
        if name not in mod._buffers:
            raise AttributeError(f"{type(mod).__name__} has no buffer `{name}`")
        return mod._buffers[name]

    # ------------------------------------------------------------------ iteration
    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Module]]:
        """This module and all below it, depth first, each once (by identity)."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            yield from module.named_modules(memo, prefix + ("." if prefix else "") + name,
                                            remove_duplicate)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen = set()
        for name, module in self._modules.items():
            if module is not None and module not in seen:
                seen.add(module)
                yield name, module

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, get, prefix: str, recurse: bool, remove_duplicate: bool = True):
        seen = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else [(prefix, self)]
        for mod_prefix, mod in modules:
            for k, v in get(mod):
                if v is None or (remove_duplicate and id(v) in seen):
                    continue
                if remove_duplicate:
                    seen.add(id(v))
                yield mod_prefix + ("." if mod_prefix else "") + k, v

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(name, parameter) pairs; a parameter shared by two modules appears once."""
        return self._named_members(lambda m: m._parameters.items(), prefix, recurse,
                                   remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        return self._named_members(lambda m: m._buffers.items(), prefix, recurse,
                                   remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # ------------------------------------------------------------------ state dict
    def state_dict(self, *, destination=None, prefix: str = "",
                   keep_vars: bool = False) -> OrderedDict:
        """Parameters and persistent buffers by dotted name, detached unless ``keep_vars``.

        Global tensors stay global (each rank holds its shards); ``sbpflow.save`` writes
        them shard by shard."""
        if destination is None:
            destination = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else p.detach()
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = b if keep_vars else b.detach()
        if type(self).get_extra_state is not Module.get_extra_state:
            destination[prefix + _EXTRA_STATE] = self.get_extra_state()
        for name, m in self._modules.items():
            if m is not None:
                m.state_dict(destination=destination, prefix=prefix + name + ".",
                             keep_vars=keep_vars)
        return destination

    def get_extra_state(self):
        """State that is neither a parameter nor a buffer (torch's protocol): a module
        that overrides this and :meth:`set_extra_state` gets ``prefix + "_extra_state"``
        in :meth:`state_dict` with this value, and :meth:`load_state_dict` hands that
        entry to :meth:`set_extra_state` (a missing one is a missing key)."""
        raise RuntimeError("Reached a code path in Module.get_extra_state() that should "
                           "never be called: override get_extra_state and set_extra_state "
                           "together")

    def set_extra_state(self, state) -> None:
        """Take back what :meth:`get_extra_state` returned (see there)."""
        raise RuntimeError("Reached a code path in Module.set_extra_state() that should "
                           "never be called: override get_extra_state and set_extra_state "
                           "together")

    def load_state_dict(self, state_dict, strict: bool = True,
                        assign: bool = False) -> IncompatibleKeys:
        """Copy values from ``state_dict`` into this module's parameters and buffers (and
        hand ``_extra_state`` entries to :meth:`set_extra_state`).

        Values may be sbpflow tensors (local or global, any placement and SBP: they are
        boxed, or sliced, to each parameter's own layout), ``torch.Tensor`` s or numpy
        arrays (the whole value; every rank passes the same one). ``assign=True`` makes the
        module take the given tensors instead of copying (global ones must already have the
        parameter's placement and SBP).

        Returns:
            ``IncompatibleKeys(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: ``strict`` and keys missing or unexpected, or a shape mismatch
                (always), listing every problem as torch does.
        """
        if not hasattr(state_dict, "items"):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        missing, errors = [], []
        expected = set()
        for mod_prefix, mod in self.named_modules(remove_duplicate=False):
            pre = mod_prefix + ("." if mod_prefix else "")
            local_state = [(n, p, True) for n, p in mod._parameters.items() if p is not None]
            local_state += [(n, b, False) for n, b in mod._buffers.items()
                            if b is not None and n not in mod._non_persistent_buffers_set]
            for name, target, is_param in local_state:
                key = pre + name
                expected.add(key)
                if key not in state_dict:
                    missing.append(key)
                    continue
                try:
                    _load_into(mod, name, target, state_dict[key], is_param, assign)
                except ValueError as e:
                    errors.append(f"size mismatch for {key}: {e}")
            if type(mod).set_extra_state is not Module.set_extra_state:
                key = pre + _EXTRA_STATE
                expected.add(key)
                if key in state_dict:
                    mod.set_extra_state(state_dict[key])
                else:
                    missing.append(key)
        unexpected = [k for k in state_dict if k not in expected]
        if strict:
            if unexpected:
                errors.insert(0, "Unexpected key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                errors.insert(0, "Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing) + ". ")
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                               + "\n\t".join(errors))
        return IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------ modes and casts
    def train(self, mode: bool = True) -> Module:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset parameter gradients (to None by default, as torch >= 2.0 does)."""
        for p in self.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                g = p.grad
                with torch.no_grad():
                    g._local.zero_()
                p.grad = g

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Call ``fn`` on every submodule (children first) and on this module."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def _apply_to_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Module:
        for m in self.modules():
            for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                if t is not None:
                    new = fn(t._local)
                    if new is not t._local:
                        _replace_local(t, new)
                        if t.grad is not None and t._local.grad is not None:
                            t._local.grad = fn(t._local.grad)
        return self

    def to(self, *args, **kwargs) -> Module:
        """``to(dtype)``, ``to(device)``, ``to(device, dtype)``: floating parameters and
        buffers take ``dtype``; all move to ``device``. Global tensors keep their
        placement's device unless moved with ``to_global``.

        ``module.to(sbpflow.nn.graph.GraphModule)`` (OneFlow's API) returns the module's
        graph settings instead (activation checkpointing, pipeline stage), created once
        per module; they act when the module runs inside an ``nn.Graph``.

        Raises:
            TypeError: a non-floating ``dtype`` (as torch does).
        """
        if args and isinstance(args[0], type) and getattr(args[0], "_sbpflow_graph_module",
                                                          False):
            return args[0].of(self)
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, but "
                            f"got desired dtype={dtype}")

        def cast(t: torch.Tensor) -> torch.Tensor:
            dt = dtype if dtype is not None and t.is_floating_point() else None
            return t.to(device=device, dtype=dt)

        return self._apply_to_tensors(cast)

    def float(self) -> Module:
        return self.to(torch.float32)

    def double(self) -> Module:
        return self.to(torch.float64)

    def half(self) -> Module:
        return self.to(torch.float16)

    def bfloat16(self) -> Module:
        return self.to(torch.bfloat16)

    def cpu(self) -> Module:
        return self.to("cpu")

    def cuda(self, device=None) -> Module:
        return self.to(torch.device("cuda", device) if isinstance(device, int)
                       else device or "cuda")

    # ------------------------------------------------------------------ global / local
    def to_global(self, placement: Placement, sbp=broadcast) -> Module:
        """Lay every parameter and buffer out on ``placement`` (in place; returns self).

        ``sbp``: one SBP or nd-SBP for every tensor, or a callable
        ``sbp(name, tensor) -> SBP | nd-SBP | None`` (``name`` dotted; None keeps
        broadcast), or a dict ``{name: SBP}`` (missing names: broadcast). A local tensor
        left by :meth:`to_local` on this placement is taken back as the shard it was;
        another local tensor is taken as the whole value (every rank holds the whole
        module, as after seeding the same init): the value at mesh coordinate 0 is
        broadcast and each rank keeps its
        shard. A global tensor is boxed. Parameters stay the same objects (optimizers built
        before keep working) and stay leaves.

        Raises:
            ValueError: an SBP that does not fit a tensor (e.g. a split dim out of range),
                naming the tensor.
        """
        if isinstance(sbp, dict):
            table = sbp
            sbp = lambda name, t: table.get(name)  # noqa: E731
        was = self.__dict__.pop("_sbpflow_local_layouts", {})
        for name, t in itertools.chain(self.named_parameters(), self.named_buffers()):
            if is_lazy(t):  # laid out by its lazy layer when it materialises
                owner = name.rpartition(".")[0]
                self.get_submodule(owner).__dict__["_lazy_layout"] = (
                    placement, sbp, owner + "." if owner else "")
                continue
            want = sbp(name, t) if callable(sbp) and not isinstance(sbp, SBP) else sbp
            if want is None or want is broadcast:
                want = (broadcast,) * placement.ndim  # one B means B on every mesh axis
            try:
                nd = normalize_nd_sbp(want, placement.ndim, t.ndim)
            except (ValueError, TypeError) as e:
                raise ValueError(f"to_global: SBP {want!r} does not fit {name} of shape "
                                 f"{tuple(t.shape)}: {e}") from None
            with torch.no_grad():
                if t.is_global:
                    g = t.detach().to_global(placement, nd)
                elif _is_shard_of(t, was.get(name), placement):
                    old_pl, old_sbp, old_shape = was[name]  # to_local's shard, taken back
                    g = Tensor(t._local.detach(), old_pl, old_sbp, old_shape)
                    g = g.to_global(placement, nd)
                else:
                    g = t.detach().to_global(placement, (broadcast,) * placement.ndim)
                    g = g.to_global(placement, nd)
            _rebind(t, g)
        return self

    def to_local(self) -> Module:
        """Make every global parameter and buffer this rank's shard, as
        :meth:`sbpflow.Tensor.to_local` gives it (OneFlow's ``Module.to_local``: in place,
        returns self, no communication; a parameter split ``S(0)`` over 2 ranks of shape
        ``(6, 4)`` becomes a local ``(3, 4)``; a ``B`` one the whole value; a ``P`` one this
        rank's summand; a rank outside the placement gets empty tensors). Parameters stay
        the same objects and leaves. A module that was never global is unchanged.

        For the whole values on every rank, lay the module out broadcast first:
        ``m.to_global(pl, sbpflow.sbp.broadcast).to_local()`` (one all-gather per split
        tensor), or read them with ``state_dict()`` values' ``numpy()``.

        Round trip (OneFlow's): the layouts are remembered, so a later
        ``m.to_global(placement, sbp)`` on the same placement takes each untouched
        shard back as the shard it was (no communication when ``sbp`` is the layout it
        had), instead of reading the local tensors as whole values.
        """
        layouts = {}
        for name, t in itertools.chain(self.named_parameters(), self.named_buffers()):
            if t.is_global:
                layouts[name] = (t.placement, t.sbp, tuple(t.shape))
                _rebind(t, Tensor(t._local.detach()))
        if layouts:
            self.__dict__["_sbpflow_local_layouts"] = layouts
        return self

    # ------------------------------------------------------------------ hooks and call
    def register_forward_pre_hook(self, hook, *, prepend: bool = False,
                                  with_kwargs: bool = False) -> RemovableHandle:
        """``hook(module, args)`` (or ``hook(module, args, kwargs)`` with ``with_kwargs``)
        runs before forward; a non-None return replaces the arguments."""
        handle = RemovableHandle(self._forward_pre_hooks,
                                 extra_dict=self._forward_pre_hooks_with_kwargs)
        self._forward_pre_hooks[handle.id] = hook
        if with_kwargs:
            self._forward_pre_hooks_with_kwargs.add(handle.id)
        if prepend:
            self._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle

    def register_forward_hook(self, hook, *, prepend: bool = False,
                              with_kwargs: bool = False) -> RemovableHandle:
        """``hook(module, args, output)`` (or ``(module, args, kwargs, output)``) runs after
        forward; a non-None return replaces the output."""
        handle = RemovableHandle(self._forward_hooks, extra_dict=self._forward_hooks_with_kwargs)
        self._forward_hooks[handle.id] = hook
        if with_kwargs:
            self._forward_hooks_with_kwargs.add(handle.id)
        if prepend:
            self._forward_hooks.move_to_end(handle.id, last=False)
        return handle

    def __call__(self, *args, **kwargs):
        # Buffers deferred inside (BatchNorm(sync_stats=False)'s running statistics) are
        # broadcast, coalesced, when the outermost call returns (nn/_buffer_sync.py).
        state = _buffer_sync.STATE
        state.depth += 1
        try:
            if self._forward_pre_hooks:
                args, kwargs = self._pre_hooks(args, kwargs)
            ctx = getattr(_dstate.tracer, "context", None)  # a graph's step being traced
            wrap = ctx.forward_wrappers.get(id(self)) if ctx is not None else None
            out = self.forward(*args, **kwargs) if wrap is None else \
                wrap(self.forward, args, kwargs)  # (sbpflow.graph.compiler: checkpointing)
        finally:
            state.depth -= 1
        if state.depth == 0 and state.ids:
            _buffer_sync.flush()
        for hid, hook in list(self._forward_hooks.items()):
            if hid in self._forward_hooks_with_kwargs:
                res = hook(self, args, kwargs, out)
            else:
                res = hook(self, args, out)
            if res is not None:
                out = res
        return out

    def _pre_hooks(self, args, kwargs):
        for hid, hook in list(self._forward_pre_hooks.items()):
            if hid in self._forward_pre_hooks_with_kwargs:
                res = hook(self, args, kwargs)
                if res is not None:
                    if not (isinstance(res, tuple) and len(res) == 2):
                        raise RuntimeError(f"forward pre-hook must return None or a tuple of "
                                           f"(new_args, new_kwargs), but got {res!r}.")
                    args, kwargs = res
            else:
                res = hook(self, args)
                if res is not None:
                    args = res if isinstance(res, tuple) else (res,)
        return args, kwargs

    # ------------------------------------------------------------------ repr
    def extra_repr(self) -> str:
        """Extra text inside this module's repr (override, as in torch)."""
        return ""

    def _get_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        lines = []
        extra = self.extra_repr()
        if extra:
            lines = extra.split("\n")
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {sub}")
        if not lines:
            return f"{self._get_name()}()"
        if len(lines) == 1 and not self._modules:
            return f"{self._get_name()}({lines[0]})"
        return f"{self._get_name()}(\n  " + "\n  ".join(lines) + "\n)"


def _is_shard_of(t: Tensor, layout, placement) -> bool:
    """Whether local ``t`` is still the shard :meth:`Module.to_local` left of a tensor
    laid out ``layout`` = (placement, sbp, shape) on ``placement``."""
    if layout is None or layout[0] != placement:
        return False
    return tuple(t.shape) == tuple(placement.shard_shape(layout[2], layout[1]))


def _rebind(t: Tensor, g: Tensor) -> None:
    """Make tensor object ``t`` hold ``g``'s shard and layout (identity kept). A gradient
    layout set with ``set_grad_sbp`` (one other than ``t``'s own) is kept; the default
    one, ``t``'s own layout, follows the new layout (else a parameter laid out again,
    as automatic parallelism does, would box every gradient back to its old layout)."""
    grad_sbp = t.grad_sbp if t.is_global else None
    if grad_sbp is not None and grad_sbp == t.sbp:
        grad_sbp = None
    flag = t.requires_grad
    object.__setattr__(t, "_local", g._local.detach())
    object.__setattr__(t, "_placement", g.placement)
    object.__setattr__(t, "_sbp", g.sbp)
    object.__setattr__(t, "_shape", g.shape)
    if flag:
        t.requires_grad_(True)
        if grad_sbp is not None and g.is_global and grad_sbp != g.sbp and \
                t.placement.ndim == len(grad_sbp):
            t.set_grad_sbp(grad_sbp)


def _whole_value(value):
    if isinstance(value, (Tensor, StoredTensor)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.as_tensor(value)


def _load_into(mod: Module, name: str, target: Tensor, value, is_param: bool,
               assign: bool) -> None:
    value = _whole_value(value)
    if is_lazy(target):  # torch's lazy load hook: take the checkpoint's shape
        target.materialize(tuple(value.shape))
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"copying a param with shape {tuple(value.shape)} from checkpoint, "
                         f"the shape in current model is {tuple(target.shape)}.")
    with torch.no_grad():
        if isinstance(value, StoredTensor):  # a checkpoint: read just this rank's shard
            src = value.to_global(target.placement, target.sbp) if target.is_global \
                else Tensor(value.full())
        elif target.is_global:
            if isinstance(value, Tensor) and value.is_global:
                src = value.detach().to_global(target.placement, target.sbp)
            else:
                whole = value.to_torch() if isinstance(value, Tensor) else value
                src = _make_tensor(whole.to(target.dtype), placement=target.placement,
                                   sbp=target.sbp)
        else:
            if isinstance(value, Tensor) and value.is_global:
                src = Tensor(torch.as_tensor(value.numpy()))
            else:
                src = value if isinstance(value, Tensor) else Tensor(value)
        if assign:
            if target.is_global and (src.placement != target.placement or src.sbp != target.sbp):
                raise ValueError(f"assign=True needs the placement and SBP of the parameter "
                                 f"({format_nd_sbp(target.sbp)})")
            new = Parameter(src, requires_grad=target.requires_grad) if is_param else src
            if is_param:
                mod._parameters[name] = new
            else:
                mod._buffers[name] = new
            return
        target._local.copy_(src._local.to(target.dtype))
