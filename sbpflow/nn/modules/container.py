"""Sequential, ModuleList, ModuleDict, ParameterList, ParameterDict (torch.nn's behaviour:
indexing, slicing, append, extend, insert, iteration, len, keys/items/values) and the
deprecated Container."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import torch

from ...tensor import Tensor
from ..module import Module, Parameter

__all__ = ["Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList",
           "ParameterDict"]


def _index(idx: int, n: int, kind: str) -> int:
    if not -n <= idx < n:
        raise IndexError(f"index {idx} is out of range for a {kind} of length {n}")
    return idx % n


class Container(Module):
    """torch's deprecated ``nn.Container(**modules)``: a Module holding the keyword
    arguments as submodules (``Container(a=Linear(2, 3))`` has ``.a``, no forward of its
    own). Kept for old code, as torch keeps it; subclass :class:`Module` instead."""

    def __init__(self, **kwargs):
        super().__init__()
        for key, value in kwargs.items():
            self.add_module(key, value)


class Sequential(Module):
    """Modules called in order; ``Sequential(m1, m2)`` or ``Sequential(OrderedDict(...))``."""

    def __init__(self, *args):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for i, module in enumerate(args):
                self.add_module(str(i), module)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        return list(self._modules.values())[_index(idx, len(self), "Sequential")]

    def __setitem__(self, idx: int, module: Module) -> None:
        key = list(self._modules)[_index(idx, len(self), "Sequential")]
        setattr(self, key, module)

    def __delitem__(self, idx) -> None:
        keys = list(self._modules)
        for key in (keys[idx] if isinstance(idx, slice) else [keys[_index(idx, len(self),
                                                                           "Sequential")]]):
            del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self)), module)
        return self

    def forward(self, input):  # noqa: A002
        for module in self._modules.values():
            input = module(input)
        return input


class ModuleList(Module):
    """A list of submodules, registered (names ``"0"``, ``"1"``...); no forward."""

    def __init__(self, modules: Iterable[Module] | None = None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[str(_index(idx, len(self), "ModuleList"))]

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, str(_index(idx, len(self), "ModuleList")), module)

    def __delitem__(self, idx) -> None:
        mods = list(self._modules.values())
        del mods[idx]
        self._modules.clear()
        for i, m in enumerate(mods):
            self.add_module(str(i), m)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __iadd__(self, modules) -> ModuleList:
        return self.extend(modules)

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        mods = list(self._modules.values())
        mods.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(mods):
            self.add_module(str(i), m)


class ModuleDict(Module):
    """A dict of submodules, registered under their keys, in insertion order."""

    def __init__(self, modules: Mapping[str, Module] | Iterable | None = None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key) -> bool:
        return key in self._modules

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()

    def pop(self, key: str) -> Module:
        return self._modules.pop(key)

    def clear(self) -> None:
        self._modules.clear()

    def update(self, modules) -> None:
        items = modules.items() if isinstance(modules, Mapping) else modules
        for key, module in items:
            self[key] = module


def _as_param(value):
    """torch's rule: a plain tensor put into a ParameterList/Dict becomes a Parameter
    (sharing its storage, keeping its placement and SBP); other values are kept as is."""
    if isinstance(value, Parameter) or value is None:
        return value
    if isinstance(value, (Tensor, torch.Tensor)):
        return Parameter(value)
    return value


class ParameterList(Module):
    """A list of parameters, registered under ``"0"``, ``"1"``... (``torch.nn.
    ParameterList``): they appear in ``parameters()``, ``state_dict()`` (keys
    ``"<name>.0"``...), ``to_global``/``parallelize_module`` and ``sbpflow.save``/``load``
    like any parameter. Tensors put in (sbpflow or torch) become Parameters; other values
    are stored as plain attributes, as torch does. No forward.
    """

    def __init__(self, values=None):
        super().__init__()
        object.__setattr__(self, "_size", 0)
        if values is not None:
            self += values

    def _key(self, idx: int) -> str:
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise TypeError(f"ParameterList indices must be integers or slices, not "
                            f"{type(idx).__name__}")
        return str(_index(idx, len(self), "ParameterList"))

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ParameterList([self[i] for i in range(len(self))[idx]])
        return getattr(self, self._key(idx))

    def __setitem__(self, idx: int, param) -> None:
        self._set(self._key(idx), param)

    def _set(self, key: str, param) -> None:
        param = _as_param(param)
        self.__dict__.pop(key, None)
        if isinstance(param, Parameter):
            setattr(self, key, param)
        elif param is None:
            self.register_parameter(key, None)
        else:  # not a tensor: a plain attribute, as in torch
            self._parameters.pop(key, None)
            object.__setattr__(self, key, param)

    def __len__(self) -> int:
        return self._size

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __iadd__(self, parameters) -> ParameterList:
        return self.extend(parameters)

    def __dir__(self):
        return [k for k in super().__dir__() if not k.isdigit()]

    def append(self, value) -> ParameterList:
        """Add ``value`` at the end (a tensor becomes a Parameter)."""
        idx = len(self)
        object.__setattr__(self, "_size", idx + 1)
        self._set(str(idx), value)
        return self

    def extend(self, values) -> ParameterList:
        """Append every value of an iterable (not a single tensor)."""
        if isinstance(values, (Tensor, torch.Tensor)) or not isinstance(values, Iterable):
            raise TypeError(f"ParameterList.extend should be called with an iterable, but got "
                            f"{type(values).__name__}")
        for v in values:
            self.append(v)
        return self

    def extra_repr(self) -> str:
        lines = []
        for i, p in enumerate(self):
            if isinstance(p, Tensor):
                where = "" if p.is_local else f" on {p.placement!r} {p.sbp}"
                lines.append(f"({i}): Parameter containing: [{p.dtype} of size "
                             f"{'x'.join(map(str, p.shape))}{where}]")
            else:
                lines.append(f"({i}): Object of type: {type(p).__name__}")
        return "\n".join(lines)


class ParameterDict(Module):
    """A dict of parameters, registered under their (string) keys in insertion order
    (``torch.nn.ParameterDict``): ``state_dict`` keys ``"<name>.<key>"``. Tensors put in
    become Parameters; other values are stored as plain attributes. Keys must be
    non-empty strings without ``"."`` (KeyError otherwise, as torch's).
    """

    def __init__(self, parameters=None):
        super().__init__()
        object.__setattr__(self, "_keys", {})
        if parameters is not None:
            self.update(parameters)

    def _key(self, key) -> str:
        if not isinstance(key, str):
            raise TypeError(f"ParameterDict keys must be strings, got {type(key).__name__} "
                            f"({key!r})")
        return key

    def __getitem__(self, key: str):
        if key not in self._keys:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value) -> None:
        key = self._key(key)
        value = _as_param(value)
        if isinstance(value, Parameter):
            self.__dict__.pop(key, None)
            setattr(self, key, value)
        else:
            if key in self._parameters:
                del self._parameters[key]
            if hasattr(type(self), key):
                raise KeyError(f"attribute '{key}' already exists")
            object.__setattr__(self, key, value)
        self._keys[key] = None

    def __delitem__(self, key: str) -> None:
        del self._keys[key]
        if key in self._parameters:
            del self._parameters[key]
        else:
            object.__delattr__(self, key)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def __reversed__(self):
        return reversed(list(self._keys))

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __or__(self, other) -> ParameterDict:
        out = self.copy()
        out.update(other)
        return out

    def __ior__(self, other) -> ParameterDict:
        self.update(other)
        return self

    def copy(self) -> ParameterDict:
        """A new ParameterDict holding the same Parameter objects."""
        return ParameterDict(OrderedDict((k, self[k]) for k in self._keys))

    def keys(self):
        return self._keys.keys()

    def items(self):
        return ((k, self[k]) for k in self._keys)

    def values(self):
        return (self[k] for k in self._keys)

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def setdefault(self, key: str, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: str):
        value = self[key]
        del self[key]
        return value

    def popitem(self):
        if not self._keys:
            raise KeyError("popitem(): ParameterDict is empty")
        key = next(reversed(self._keys))
        return key, self.pop(key)

    def clear(self) -> None:
        for k in list(self._keys):
            del self[k]

    def fromkeys(self, keys, default=None) -> ParameterDict:
        return ParameterDict((k, default) for k in keys)

    def update(self, parameters) -> None:
        """Add or replace entries from a mapping or an iterable of (key, value) pairs."""
        if isinstance(parameters, (Mapping, ParameterDict)):
            items = parameters.items()
        elif isinstance(parameters, Iterable):
            items = []
            for j, pair in enumerate(parameters):
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise ValueError(f"ParameterDict update sequence element #{j} should be a "
                                     f"(key, value) pair, got {pair!r}")
                items.append(tuple(pair))
        else:
            raise TypeError(f"ParameterDict.update should be called with a mapping or an "
                            f"iterable of (key, value) pairs, got {type(parameters).__name__}")
        for k, v in items:
            self[k] = v

    def extra_repr(self) -> str:
        lines = []
        for k, p in self.items():
            if isinstance(p, Tensor):
                lines.append(f"({k}): Parameter containing: [{p.dtype} of size "
                             f"{'x'.join(map(str, p.shape))}]")
            else:
                lines.append(f"({k}): Object of type: {type(p).__name__}")
        return "\n".join(lines)
