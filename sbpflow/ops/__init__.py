"""sbpflow.ops: the op registry, SBP rules, eager dispatch, and the Tensor methods.

``apply(name, *tensors, **attrs)`` runs a registered op; :mod:`._methods` installs the
Tensor operators and methods from one table.
"""

from . import _core  # noqa: F401 - registers the ops
from ._dispatch import apply
from ._methods import cat, stack, torch_functions
from ._methods import install as _install
from ._random import dropout
from ._registry import REGISTRY, Meta, OpSpec, choose_signature, get_op, register

_install()

__all__ = ["REGISTRY", "Meta", "OpSpec", "apply", "cat", "choose_signature", "dropout",
           "get_op", "register", "stack", "torch_functions"]
