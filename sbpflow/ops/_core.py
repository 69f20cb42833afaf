"""The registered ops (first set: arithmetic, a few unary, matmul, sum).

Each op is a kernel over local torch tensors plus a one-axis SBP rule generated from a
spec (:mod:`sbpflow.ops._rules`). Ops with a Python scalar operand are separate entries
(``add_scalar``...) because their P rules differ: ``P * c`` is exact, ``P + c`` is not.
"""

from __future__ import annotations

import torch

from ._registry import register
from ._rules import einsum, elementwise, matmul_spec, reduction

# --------------------------------------------------------------- elementwise, tensor x tensor
register("add", elementwise("sum"))(torch.add)
register("sub", elementwise("sum"))(torch.sub)
register("mul", elementwise("one"))(torch.mul)
register("div", elementwise("first"))(torch.div)

# --------------------------------------------------------------- elementwise, tensor x scalar
register("add_scalar", elementwise())(lambda a, *, other: torch.add(a, other))
register("sub_scalar", elementwise())(lambda a, *, other: torch.sub(a, other))
register("rsub_scalar", elementwise())(lambda a, *, other: torch.sub(other, a))
register("mul_scalar", elementwise("sum"))(lambda a, *, other: torch.mul(a, other))
register("div_scalar", elementwise("sum"))(lambda a, *, other: torch.div(a, other))

# --------------------------------------------------------------- unary
register("neg", elementwise("sum"))(torch.neg)
register("exp", elementwise())(torch.exp)
register("relu", elementwise())(torch.relu)
register("tanh", elementwise())(torch.tanh)


# --------------------------------------------------------------- contraction
def _matmul_rule(metas, attrs):
    return einsum(matmul_spec(*metas))(metas, attrs)


register("matmul", _matmul_rule)(torch.matmul)


# --------------------------------------------------------------- reductions
@register("sum", reduction)
def _sum(a, *, dim=None, keepdim=False):
    return a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)
