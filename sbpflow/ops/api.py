"""Tensor methods, ``sbpflow.<fn>`` functions and torch-function routing, generated in
this one place from what the op families declare.

An op family declares each front end where it defines it:

* ``@method("clamp", "clip")``: Tensor methods ``x.clamp(...)`` and ``x.clip(...)``, and
  (unless ``function=False``) the functions ``sbpflow.clamp(x, ...)``/``sbpflow.clip``
  (torch's function forms: ``torch.exp(x)``, ``torch.sum(x, dim=1)``); ``view=True``
  marks a method that returns a view in torch (its result is marked when sbpflow had to
  copy, so writes into it raise instead of silently missing the input);
* ``@function("where")``: an ``sbpflow.where`` function whose signature differs from the
  method's (it wins over the generated one).

:func:`install` attaches the methods to :class:`sbpflow.Tensor` (called once, from
:mod:`sbpflow.ops`); :func:`functions` gives the functions ``sbpflow/__init__.py``
exports; :func:`route` and :func:`torch_function` send torch's functions and methods
called on sbpflow tensors (``torch.exp(x)``, ``torch.nn.functional.softmax(x, -1)``) to
sbpflow's front end of the same op, by identity of the torch function (no name lookups
across modules). Declaring a name twice raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..tensor import Tensor
from .dispatch import mark_view_copies

__all__ = ["Entry", "FUNCTIONS", "METHODS", "function", "functions", "install", "method",
           "route", "route_module", "torch_function"]


@dataclass(frozen=True)
class Entry:
    """One Tensor attribute: its name, the front end (a function or a property), whether
    torch returns a view, whether ``sbpflow.<name>`` is generated from it, and the module
    that declared it."""

    name: str
    fn: Callable | property
    view: bool
    function: bool
    module: str


METHODS: dict[str, Entry] = {}
FUNCTIONS: dict[str, Callable] = {}  # explicit functions (@function)


def method(*names: str, function: bool = True, view: bool = False):
    """Decorator: declare ``fn`` as the Tensor method(s) ``names`` (see the module doc).

    Raises:
        ValueError: a name is already declared."""

    def wrap(fn):
        for name in names:
            if name in METHODS:
                raise ValueError(f"Tensor.{name} is declared twice: by {METHODS[name].module} "
                                 f"and by {_module(fn)}")
            METHODS[name] = Entry(name, fn, view, function and not name.startswith("_")
                                  and not isinstance(fn, property), _module(fn))
        return fn

    return wrap


def function(*names: str):
    """Decorator: declare ``fn`` as the function(s) ``sbpflow.<name>``.

    Raises:
        ValueError: a name is already declared as a function."""

    def wrap(fn):
        for name in names:
            if name in FUNCTIONS:
                raise ValueError(f"sbpflow.{name} is declared twice")
            FUNCTIONS[name] = fn
        return fn

    return wrap


def _module(fn) -> str:
    f = fn.fget if isinstance(fn, property) else fn
    return getattr(f, "__module__", "?")


def _advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool)
               for i in items)


def _viewing(name: str, fn):
    """``fn`` with its results marked when they are copies of a global input (torch returns
    views there; see :func:`sbpflow.ops.dispatch.mark_view_copies`)."""

    def wrapped(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if name == "__getitem__" and _advanced(args[0]):
            return out  # advanced indexing copies in torch too
        return mark_view_copies(name, self, out)

    wrapped.__name__, wrapped.__doc__ = getattr(fn, "__name__", name), fn.__doc__
    return wrapped


def _as_function(name: str, fn):
    def generated(input, *args, **kwargs):  # noqa: A002 - torch's argument name
        return fn(input, *args, **kwargs)

    generated.__name__ = name
    generated.__doc__ = f"``sbpflow.{name}(x, ...)`` is ``x.{name}(...)``.\n\n{fn.__doc__ or ''}"
    return generated


def functions() -> dict[str, Callable]:
    """``sbpflow.<name>`` for every declared function, and for every public method not
    declared ``function=False`` (an explicit function wins over the generated one)."""
    out = {name: _as_function(name, e.fn) for name, e in sorted(METHODS.items()) if e.function}
    out.update(FUNCTIONS)
    return out


_ROUTES: dict = {}


def route(torch_fn, target: Callable) -> None:
    """Send ``torch_fn`` (a torch function) called with sbpflow tensors to ``target``
    (the layers above ops, e.g. ``nn.functional``, route their own functions)."""
    _ROUTES[torch_fn] = target


def install() -> None:
    """Attach every declared method to :class:`sbpflow.Tensor` and route torch's methods
    and functions of the same names to them. Called once, on import of :mod:`sbpflow.ops`."""
    for name, e in sorted(METHODS.items()):
        fn = _viewing(name, e.fn) if e.view else e.fn
        setattr(Tensor, name, fn)
        for owner in (torch.Tensor, torch._C.TensorBase):
            torch_fn = owner.__dict__.get(name)
            if torch_fn is not None:
                _ROUTES[torch_fn] = _method_call(name)
    for name, fn in functions().items():
        torch_fn = getattr(torch, name, None)
        if callable(torch_fn) and torch_fn not in _ROUTES:
            _ROUTES[torch_fn] = fn
    Tensor._torch_function = staticmethod(torch_function)


def route_module(torch_module, namespace: dict) -> None:
    """Route every public callable of ``torch_module`` (``torch``,
    ``torch.nn.functional``, ``torch.nn.init``) to the callable of the same name in
    ``namespace`` (an sbpflow module's globals), where it has one and no route exists.
    Built once at import: calls then go by the torch function's identity."""
    for name, fn in namespace.items():
        torch_fn = getattr(torch_module, name, None)
        if name.startswith("_") or not callable(fn) or not callable(torch_fn) or \
                isinstance(torch_fn, type):
            continue
        try:
            _ROUTES.setdefault(torch_fn, fn)
        except TypeError:  # unhashable
            continue


def _method_call(name: str):
    def call(self, *args, **kwargs):
        if not isinstance(self, Tensor):
            raise TypeError(f"torch.Tensor.{name} was called on a {type(self).__name__} with "
                            f"sbpflow tensors among its arguments; call it on the sbpflow "
                            f"tensor, or convert with sbpflow.from_torch")
        return getattr(self, name)(*args, **kwargs)

    return call


def _wrap(v):
    if isinstance(v, torch.Tensor):
        return Tensor(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_wrap(i) for i in v)
    return v


def torch_function(func, args, kwargs):
    """``Tensor.__torch_function__``: run sbpflow's front end routed from ``func``;
    ``torch.Tensor`` arguments (and those inside lists and tuples) become local sbpflow
    tensors first, so ``torch_tensor + x`` works for a local ``x`` and gives sbpflow's
    local/global error for a global one.

    Raises:
        TypeError: ``func`` has no sbpflow counterpart (a property of torch.Tensor, or a
            torch function sbpflow does not have); the message names the way out."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    target = _ROUTES.get(func)
    if target is None:
        if name.endswith(("__get__", "__set__")):  # properties (x.shape via torch.Tensor...)
            raise TypeError(f"torch property {name} on an sbpflow tensor; use the sbpflow "
                            f"tensor's own attribute")
        raise TypeError(f"torch's {name} was called with an sbpflow tensor, and sbpflow has "
                        f"no op of that name; use sbpflow's API, or compute on this rank's shard "
                        f"with x.to_local().to_torch() (a torch.Tensor)")
    return target(*_wrap(tuple(args)), **{k: _wrap(v) for k, v in (kwargs or {}).items()})
