"""The plain-PyTorch twin of a model file, for the PyTorch side of ``sbpflow bench`` and for
tests: the *same source* executed once more with sbpflow's tensor-library imports resolved to
torch's, so that every class in it subclasses ``torch.nn.Module`` and calls torch:

=================================  =======================
in the model file                  in the twin
=================================  =======================
``import sbpflow``                 ``torch``
``import sbpflow.nn as nn``        ``torch.nn``
``import sbpflow.nn.functional``   ``torch.nn.functional``
``from sbpflow.models.spec ..``    ``ModelSpec``, and a ``register`` that registers nothing
``from sbpflow.models.M import ..`` the twin of model file ``M`` (its classes run on torch)
=================================  =======================

Every other import (``sbpflow.nn.parallel`` for the plans, the standard library) is the real
one. A model file therefore uses only names that sbpflow and torch share (``sbpflow.cat``,
``nn.Linear``, ``F.scaled_dot_product_attention``, ...). Built with the same seed
(``torch.manual_seed(s)`` / ``sbpflow.manual_seed(s)``), the twin and the sbpflow model hold
the same parameters, since sbpflow's layers and ``nn.init`` draw as torch's do.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import sys
import types

__all__ = ["torch_twin", "twin_builder"]

_LIBS = {"sbpflow": "torch", "sbpflow.nn": "torch.nn",
         "sbpflow.nn.functional": "torch.nn.functional"}


def _registry_stub() -> types.ModuleType:
    from .spec import ModelSpec

    stub = types.ModuleType("sbpflow.models.spec (torch twin)")
    stub.ModelSpec = ModelSpec
    stub.register = lambda spec: spec  # the twin's specs are not registered
    stub.twin_builder = twin_builder
    return stub


def _import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
    if level == 0 and name in _LIBS:
        # ``import sbpflow.nn as nn`` asks for the top package and then reads ``.nn``.
        return importlib.import_module(_LIBS[name] if fromlist else "torch")
    if level == 0 and name == "sbpflow.models.spec" and fromlist:
        return _registry_stub()
    if level == 0 and fromlist and name.startswith("sbpflow.models.") and \
            not name.startswith("sbpflow.models._"):  # another model file: its twin
        importlib.import_module(name)
        return torch_twin(name)
    return builtins.__import__(name, globals, locals, fromlist, level)


def torch_twin(module_name: str) -> types.ModuleType:
    """The plain-PyTorch twin of the model module ``module_name`` (e.g.
    ``"sbpflow.models.gpt"``), built once and cached in ``sys.modules`` under
    ``module_name + ".torch_twin"``.

    Raises:
        ValueError: ``module_name`` is not an imported module with a source file.
    """
    key = module_name + ".torch_twin"
    if key in sys.modules:
        return sys.modules[key]
    mod = sys.modules.get(module_name)
    path = getattr(mod, "__file__", None)
    if path is None:
        raise ValueError(f"torch_twin: {module_name!r} is not an imported module with a "
                         f"source file; import it first")
    with open(path, encoding="utf-8") as f:
        src = f.read()
    twin = types.ModuleType(key, f"{module_name} under plain PyTorch (see sbpflow.models._twin)")
    twin.__file__ = path
    twin.__builtins__ = {**builtins.__dict__, "__import__": _import}
    sys.modules[key] = twin  # dataclasses look their module up while the file runs
    try:
        exec(compile(src, path, "exec"), twin.__dict__)
    except BaseException:
        del sys.modules[key]
        raise
    return twin


def _build_twin(module_name: str, attr: str, config):
    return getattr(torch_twin(module_name), attr)(config)


def twin_builder(module_name: str, attr: str):
    """A ``ModelSpec.torch_builder``: ``config -> torch.nn.Module``, building ``attr`` (a
    class or function of the model file ``module_name``) from the file's torch twin (loaded
    on first use). Picklable (a ``functools.partial`` of a module-level function)."""
    return functools.partial(_build_twin, module_name, attr)
