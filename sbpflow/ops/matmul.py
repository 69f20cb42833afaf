"""The matmul family: ``matmul``/``@``, ``mm``, ``bmm``, ``einsum``, ``outer``,
``addmm``/``addmv``/``baddbmm``/``addbmm`` (and in place), ``cross``, ``cdist``,
``dist``, and ``nn.linear``.

SBP rules come from einsum strings (:func:`sbpflow.ops.rules.einsum`, DTensor's
``_mm_like_strategy``): a letter kept in the output may be split everywhere it appears; a
contracted letter split in every operand gives P; a contraction is linear in each operand,
so (P, B) -> P and (B, P) -> P. ``matmul``'s string comes from the operand shapes
(:func:`sbpflow.ops.rules.matmul_spec`); ``nn.linear`` is ``...i,oi->...o`` (weights
``(out, in)``: column parallel ``S(0)`` gives an output split on its last dim, row
parallel ``S(1)`` with the input split on its last dim gives P). ``addmm`` and friends are
composed of a matmul and elementwise ops. ``cross``: broadcast dims other than ``dim``
split, P in one operand. ``cdist``: batch dims split in both, or the rows of one side.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..sbp import SBP, Split, broadcast, partial_sum
from ..tensor import Tensor
from .api import function, method
from .args import check_global_pair, norm_dim, want_tensor
from .dispatch import dispatch
from .nn import _empty_safe, _optional
from .registry import Meta, register
from .rules import einsum as einsum_rule
from .rules import matmul_spec

S, B, P = Split, broadcast, partial_sum


# --------------------------------------------------------------- contraction
def _matmul_rule(metas, attrs):
    return einsum_rule(matmul_spec(*metas))(metas, attrs)


register("matmul", _matmul_rule)(torch.matmul)


def _matmul(self, other):
    """``torch.matmul`` semantics; SBP rules from its einsum string.

    Raises:
        TypeError: ``other`` is not an sbpflow Tensor."""
    want_tensor("matmul", "other", other)
    return dispatch("matmul", self, other)


def _matmul_operator(self, other):
    """``x @ other`` (NotImplemented for a non-tensor, so Python tries ``other.__rmatmul__``)."""
    if not isinstance(other, Tensor):
        return NotImplemented
    return dispatch("matmul", self, other)


def _fixed_rank(name: str, ndim: int, what: str):
    """``torch.mm`` (``ndim`` 2) or ``torch.bmm`` (3): matmul of two ``ndim``-D tensors."""

    def fn(self, other):
        want_tensor(name, "other", other)
        if self.ndim != ndim or other.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim}-D tensors, got shapes "
                             f"{tuple(self.shape)} and {tuple(other.shape)} (use matmul for "
                             f"other ranks)")
        return dispatch("matmul", self, other)

    fn.__name__ = name
    fn.__doc__ = f"``torch.{name}``: {what}; SBP as ``matmul``."
    return fn


_mm = _fixed_rank("mm", 2, "2-D x 2-D matrix product")
_bmm = _fixed_rank("bmm", 3, "3-D x 3-D batched matrix product")


def outer(input, vec2):  # noqa: A002
    """``torch.outer`` of two 1-D tensors: (n,) x (m,) -> (n, m)."""
    want_tensor("outer", "vec2", vec2)
    return input.reshape(-1, 1) * vec2.reshape(1, -1)


def _einsum_kernel(*ts, spec):
    return torch.einsum(spec, *ts)


def _einsum_rules(metas, attrs):
    return einsum_rule(attrs["spec"])(metas, attrs)


register("einsum", _einsum_rules)(_einsum_kernel)


def einsum(spec: str, *operands) -> Tensor:
    """``torch.einsum`` with explicit subscripts (``"bij,bjk->bik"``; ``...`` is expanded
    from the operand ranks). SBP rules come from the string: a kept letter may be split
    everywhere it appears; a contracted letter split in every operand gives P.

    Raises:
        ValueError: no ``->``.
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    spec = spec.replace(" ", "")
    if "->" not in spec:
        raise ValueError(f"einsum: give the output subscripts explicitly, e.g. 'ij,jk->ik'; "
                         f"got {spec!r}")
    if "..." in spec:
        ins, out = spec.split("->")
        parts = ins.split(",")
        used = set(spec) - set(".,->")
        free = [c for c in string.ascii_letters if c not in used]
        n = max(op.ndim - (len(p) - 3) for op, p in zip(operands, parts) if "..." in p)
        fill = "".join(free[:n])
        parts = [p.replace("...", fill[n - (op.ndim - (len(p) - 3)):]) for op, p in
                 zip(operands, parts)]
        spec = ",".join(parts) + "->" + out.replace("...", fill)
    return dispatch("einsum", *operands, spec=spec)


def _scaled(x: Tensor, c):
    return x if c == 1 else x * c


def _add_product(name: str, input, product, beta, alpha):  # noqa: A002
    """``beta * input + alpha * product`` (torch: ``beta == 0`` ignores input's values)."""
    out = _scaled(product, alpha)
    if beta == 0:
        return out
    return out + _scaled(input, beta)


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """``torch.addmm``: ``beta * x + alpha * (mat1 @ mat2)`` (mat1 ``(n, m)``, mat2
    ``(m, p)``, x broadcast to ``(n, p)``). Composed: matmul's einsum rules apply (a
    split contracted dim gives ``P``, added to ``x``). ``beta == 0`` ignores x (NaN too).

    Raises:
        ValueError: mat1 or mat2 not 2-D."""
    if mat1.ndim != 2 or mat2.ndim != 2:
        raise ValueError(f"addmm: mat1 and mat2 must be 2-D, got shapes {tuple(mat1.shape)} "
                         f"and {tuple(mat2.shape)}")
    return _add_product("addmm", self, mat1 @ mat2, beta, alpha)


def _addmv(self, mat, vec, *, beta=1, alpha=1):
    """``torch.addmv``: ``beta * x + alpha * (mat @ vec)`` (mat ``(n, m)``, vec ``(m,)``).
    Composed as :meth:`addmm`."""
    if mat.ndim != 2 or vec.ndim != 1:
        raise ValueError(f"addmv: expected a 2-D mat and a 1-D vec, got shapes "
                         f"{tuple(mat.shape)} and {tuple(vec.shape)}")
    return _add_product("addmv", self, mat @ vec, beta, alpha)


def _baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """``torch.baddbmm``: ``beta * x + alpha * (batch1 @ batch2)`` per batch (``(b, n,
    m) @ (b, m, p)``). Composed as :meth:`addmm` (the batch dim may stay split)."""
    if batch1.ndim != 3 or batch2.ndim != 3:
        raise ValueError(f"baddbmm: batch1 and batch2 must be 3-D, got shapes "
                         f"{tuple(batch1.shape)} and {tuple(batch2.shape)}")
    return _add_product("baddbmm", self, batch1 @ batch2, beta, alpha)


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """``torch.addbmm``: ``beta * x + alpha * sum_b(batch1[b] @ batch2[b])``: one einsum
    ``bnm,bmp->np`` (a split batch or contracted dim gives ``P``)."""
    if batch1.ndim != 3 or batch2.ndim != 3:
        raise ValueError(f"addbmm: batch1 and batch2 must be 3-D, got shapes "
                         f"{tuple(batch1.shape)} and {tuple(batch2.shape)}")
    return _add_product("addbmm", self, einsum("bnm,bmp->np", batch1, batch2), beta, alpha)


def _inplace_product(fn, name: str):
    def method(self, *args, beta=1, alpha=1):
        out = fn(self, *args, beta=beta, alpha=alpha)
        return self.copy_(out)

    method.__name__ = name
    method.__doc__ = (f"In place ``{name[:-1]}`` (``torch.Tensor.{name}``): the out-of-place "
                      f"result copied into x (x keeps its layout; see ``copy_``).")
    return method


def _cross_rule(metas, attrs):
    a, b = metas
    dim = attrs["dim"]
    nd = max(a.ndim, b.ndim)
    sigs = [(P, B, P), (B, P, P)]
    for d in range(nd):
        if d == dim:
            continue
        da, db = d - nd + a.ndim, d - nd + b.ndim
        size = max(a.shape[da] if da >= 0 else 1, b.shape[db] if db >= 0 else 1)
        sa = S(da) if da >= 0 and a.shape[da] == size else B
        sb = S(db) if db >= 0 and b.shape[db] == size else B
        if sa != B or sb != B:
            sigs.append((sa, sb, S(d)))
    return sigs


register("cross", _cross_rule)(lambda a, b, *, dim: torch.linalg.cross(a, b, dim=dim))


def _cross(self, other, dim=None):
    """``torch.cross`` (``torch.linalg.cross``): the 3-vector cross product along ``dim``
    (None: the first dim of size 3, as torch.cross), broadcasting. SBP: other dims split,
    ``P`` in one operand (linear in each).

    Raises:
        ValueError: no dim of size 3 / ``dim`` not of size 3."""
    check_global_pair("cross", self, other)
    nd = max(self.ndim, other.ndim)
    if dim is None:
        shape = torch.broadcast_shapes(tuple(self.shape), tuple(other.shape))
        dim = next((d for d, s in enumerate(shape) if s == 3), None)
        if dim is None:
            raise ValueError(f"cross: no dim of size 3 in shapes {tuple(self.shape)} and "
                             f"{tuple(other.shape)}; pass dim=")
    dim = norm_dim(dim, nd)
    for t in (self, other):
        if t.shape[dim - nd + t.ndim] != 3:
            raise ValueError(f"cross: dim {dim} must have size 3, got shapes "
                             f"{tuple(self.shape)} and {tuple(other.shape)}")
    return dispatch("cross", self, other, dim=dim)


def _cdist_rule(metas, attrs):
    a, b = metas
    nb = a.ndim - 2
    sigs = [(S(d), S(d), S(d)) for d in range(nb)
            if b.ndim == a.ndim and a.shape[d] == b.shape[d]]
    return sigs + [(S(a.ndim - 2), B, S(a.ndim - 2)), (B, S(b.ndim - 2), S(a.ndim - 1))]


register("cdist", _cdist_rule)(
    lambda a, b, *, p, compute_mode: torch.cdist(a, b, p, compute_mode))


def cdist(x1: Tensor, x2: Tensor, p: float = 2.0,
          compute_mode: str = "use_mm_for_euclid_dist_if_necessary") -> Tensor:
    """``torch.cdist``: the ``p``-norm distances between the rows of x1 ``(*, P, M)`` and
    x2 ``(*, R, M)``: ``(*, P, R)``. SBP: batch dims split in both; the rows of x1 (output
    dim -2) or of x2 (output dim -1) split; a split ``M`` is gathered.

    Raises:
        ValueError: fewer than 2 dims or different ``M``."""
    check_global_pair("cdist", x1, x2)
    if x1.ndim < 2 or x2.ndim < 2 or x1.shape[-1] != x2.shape[-1]:
        raise ValueError(f"cdist: expected x1 (*, P, M) and x2 (*, R, M), got shapes "
                         f"{tuple(x1.shape)} and {tuple(x2.shape)}")
    return dispatch("cdist", x1, x2, p=float(p), compute_mode=compute_mode)


def _dist(self, other, p=2):
    """``torch.dist``: ``(x - other).norm(p)`` (0-dim), broadcasting; as :meth:`norm`."""
    return (self - other).norm(p)


# ------------------------------------------------------------------ linear, conv
def _linear_rule(metas: Sequence[Meta], attrs) -> list[tuple[SBP, ...]]:
    x = metas[0]
    batch = string.ascii_lowercase[: x.ndim - 1]
    sigs = einsum_rule(f"{batch}y,zy->{batch}z")(metas[:2], attrs)
    if len(metas) == 2:
        return sigs
    last = Split(x.ndim - 1)

    def bias(out: SBP) -> SBP:  # y = x @ w.T + b: b follows the output's last dim
        return Split(0) if out == last else P if out.is_partial() else B

    return [(*s[:2], bias(s[-1]), s[-1]) for s in sigs]


def _linear_dims(i, d, shapes):
    if i == 0:
        return d if d < len(shapes[0]) - 1 else None
    return -1 if d == 0 else None  # weight rows and bias: output features


register("nn.linear", _linear_rule)(_empty_safe(_optional(F.linear), _linear_dims))


# ---------------------------------------------------------------- Tensor methods and functions
method("matmul")(_matmul)
method("__matmul__")(_matmul_operator)
method("mm")(_mm)
method("bmm")(_bmm)
method("outer")(outer)
function("outer")(outer)
function("einsum")(einsum)
for _name, _fn in (("addmm", _addmm), ("addmv", _addmv), ("baddbmm", _baddbmm),
                   ("addbmm", _addbmm)):
    method(_name)(_fn)
    method(f"{_name}_")(_inplace_product(_fn, f"{_name}_"))
method("cross")(_cross)
function("cdist")(cdist)
method("dist")(_dist)

