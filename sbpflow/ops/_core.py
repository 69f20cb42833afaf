"""The registered ops (first set: arithmetic, a few unary, matmul, sum).

Each op is a kernel over local torch tensors plus a one-axis SBP rule generated from a
spec (:mod:`sbpflow.ops._rules`). Ops with a Python scalar operand are separate entries
(``add_scalar``...) because their P rules differ: ``P * c`` is exact, ``P + c`` is not.
"""

from __future__ import annotations

import torch

from ._registry import register
from ._rules import (
    concat,
    einsum,
    elementwise,
    matmul_spec,
    permutation,
    reduction,
    reshape,
    reshape_carriers,
    reshape_check,
)

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
# name -> torch function; all elementwise, none linear except neg (listed first).
register("neg", elementwise("sum"))(torch.neg)
UNARY = {
    "abs": torch.abs, "ceil": torch.ceil, "cos": torch.cos, "erf": torch.erf,
    "exp": torch.exp, "floor": torch.floor, "gelu": torch.nn.functional.gelu,
    "isinf": torch.isinf, "isnan": torch.isnan, "log": torch.log, "log1p": torch.log1p,
    "logical_not": torch.logical_not, "reciprocal": torch.reciprocal, "relu": torch.relu,
    "round": torch.round, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "sign": torch.sign,
    "silu": torch.nn.functional.silu, "sin": torch.sin, "softplus": torch.nn.functional.softplus,
    "sqrt": torch.sqrt, "square": torch.square, "tanh": torch.tanh,
}
for _name, _fn in sorted(UNARY.items()):
    register(_name, elementwise())(_fn)

# --------------------------------------------------------------- binary, no exact P rule
BINARY = {
    "eq": torch.eq, "ge": torch.ge, "gt": torch.gt, "le": torch.le, "logical_and":
    torch.logical_and, "logical_or": torch.logical_or, "lt": torch.lt, "maximum": torch.maximum,
    "minimum": torch.minimum, "ne": torch.ne, "pow": torch.pow,
}
for _name, _fn in sorted(BINARY.items()):
    register(_name, elementwise())(_fn)
    register(f"{_name}_scalar", elementwise())(lambda a, *, other, _fn=_fn: _fn(a, other))
register("where", elementwise())(torch.where)


# --------------------------------------------------------------- contraction
def _matmul_rule(metas, attrs):
    return einsum(matmul_spec(*metas))(metas, attrs)


register("matmul", _matmul_rule)(torch.matmul)


# --------------------------------------------------------------- reductions
@register("sum", reduction)
def _sum(a, *, dim=None, keepdim=False):
    return a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)


@register("mean", reduction)
def _mean(a, *, dim=None, keepdim=False, count=1):
    # ``count`` is the global number of reduced elements, so that on a split reduced dim
    # each rank's local sum / count is an exact summand (P) even for uneven shards.
    s = a.sum() if dim is None else a.sum(dim=dim, keepdim=keepdim)
    return s / count


# --------------------------------------------------------------- shape
register("permute", permutation)(lambda a, *, dims: a.permute(dims))


@register("reshape", reshape, check=reshape_check)
def _reshape(a, *, shape, in_shape):
    # A group's carrier dim takes the share of the group's elements this shard holds;
    # every other dim is whole (reshape_check made sure the shards line up).
    local = list(shape)
    for d, (e, inner_in, inner_out) in reshape_carriers(in_shape, shape).items():
        if a.shape[d] != in_shape[d]:
            local[e] = a.shape[d] * inner_in // inner_out
    return a.reshape(local)


# --------------------------------------------------------------- joining
register("cat", concat)(lambda *ts, dim: torch.cat(ts, dim=dim))
register("stack", concat)(lambda *ts, dim, new_dim: torch.stack(ts, dim=dim))
