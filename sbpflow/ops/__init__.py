"""sbpflow.ops: the op registry, SBP rules, the one dispatch path, and the Tensor methods.

Where things are:

* :mod:`.registry` (what an op is: kernel, one-axis SBP rule, optional global algorithm
  and its cost), :mod:`.rules` (rule generators), :mod:`.chooser` (signature choice and
  cost), :mod:`.dispatch` (the one path every op runs through, in place too),
  :mod:`.api` (Tensor methods, ``sbpflow.<fn>`` functions and torch-function routing,
  generated from what the families declare), :mod:`.args` (argument normalisation),
  :mod:`.algorithms` (helpers shared by the global algorithms);
* the op families, one concept per file: :mod:`.pointwise`, :mod:`.cast`,
  :mod:`.reduce`, :mod:`.scan`, :mod:`.sort`, :mod:`.matmul`, :mod:`.view`,
  :mod:`.index`, :mod:`.data_dependent`, :mod:`.nn`, :mod:`.random`, :mod:`.creation`;
  :mod:`.compat` (the rest of torch's Tensor names, written with the families' ops).

Importing this package registers every op and installs the Tensor methods
(:func:`sbpflow.ops.api.install`).
"""

from . import (  # noqa: F401 - importing a family registers its ops and declares its methods
    cast,
    compat,
    creation,
    data_dependent,
    index,
    matmul,
    nn,
    pointwise,
    random,
    reduce,
    scan,
    sort,
    torch_functions,
    view,
)
from .api import functions, install
from .chooser import choose_signature
from .dispatch import dispatch, dispatch_inplace, observe
from .random import dropout
from .registry import REGISTRY, Meta, OpSpec, get_op, register, register_algorithm
from .view import cat, stack

install()

__all__ = ["REGISTRY", "Meta", "OpSpec", "cat", "choose_signature", "dispatch",
           "dispatch_inplace", "dropout", "functions", "get_op", "observe", "register",
           "register_algorithm", "stack"]
