"""The rest of ``torch.Tensor``'s names (issue 21): other names of sbpflow's ops, in-place
forms, metadata queries, shape helpers written with sbpflow's view ops, the linear
algebra of the matmul family, in-place random fills, and the ops that run replicated.

What each group is on a global tensor:

* **Other names** (``absolute``, ``greater``, ``less_equal``, ``not_equal``,
  ``multiply``, ``subtract``, ``ger``, ``fliplr``, ``ravel``, ``mT`` ...): the op they
  name, with its SBP rules.
* **In-place comparisons and logicals** (``eq_`` ... ``logical_xor_``): the comparison's
  rules through :func:`sbpflow.ops.dispatch.dispatch_inplace` (the result cast to the
  tensor's dtype, as torch's).
* **New pointwise ops** (``fmax``, ``fmin``, ``gcd``, ``lcm``, ``ldexp``, ``igamma``,
  ``igammac``, bit shifts, ``signbit``, ``isposinf``, ``isneginf``, ``isreal``,
  ``angle``, ``hardshrink``, ``mvlgamma``, ``polygamma``, ``frexp``): elementwise splits
  that follow broadcasting; no P rule (none is linear).
* **Metadata** (``is_floating_point``, ``is_contiguous``, ``stride``, ``nbytes`` ...): of
  the global (logical) tensor where torch's answer depends on the values' layout in
  memory: ``nbytes`` is ``numel * itemsize`` of the global shape, ``stride()`` the
  strides a tensor of the global shape would have with the shard's dim order,
  ``is_contiguous()`` whether the shard is. ``x.to_local()`` answers for the shard.
* **Linear algebra**: ``dot``, ``vdot``, ``mv``, ``inner``, ``addr`` are matmul, einsum
  and outer (their SBP rules: a split contraction dim gives P). The factorizations and
  solvers (``det``, ``inverse``, ``qr``, ``svd``, ``cholesky`` ...) keep a split of a
  batch dim (every input split alike) and otherwise run replicated: their inputs are
  boxed to B and every rank computes the whole result (a matrix dim cannot be split:
  a factorization reads the whole matrix).
* **Replicated** (``kron``, ``cov``, ``corrcoef``, ``histogram``, ``take``, ``put`` ...):
  inputs boxed to B, torch's kernel on every rank, the result B.
* **In-place random fills** (``uniform_``, ``normal_``, ``bernoulli_``, ``cauchy_``,
  ``exponential_``, ``geometric_``, ``log_normal_``, ``random_``): layout invariant as
  :mod:`sbpflow.random` promises: every rank draws the whole global tensor with torch's
  own in-place sampler and keeps its shard, so the value equals torch's on one process
  with the same seed (a P tensor keeps the value on the rank at coordinate 0 of each P
  axis, zeros elsewhere).
"""

from __future__ import annotations

import torch

from .. import random as _rng
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .api import function, method
from .args import norm_dim, want_tensor
from .dispatch import dispatch, dispatch_inplace
from .pointwise import _binary, _inplace_binary, _inplace_unary, _unary
from .registry import Meta, register
from .rules import einsum, elementwise

S, B, P = Split, broadcast, partial_sum


# --------------------------------------------------------------- other names of ops
def _alias(target: str, name: str):
    def call(self, *args, **kwargs):
        return getattr(self, target)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"``torch.Tensor.{name}``: another name of :meth:`Tensor.{target}`."
    return call


_ALIASES = {
    "absolute": "abs", "absolute_": "abs_", "negative": "neg", "negative_": "neg_",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
    "not_equal": "ne", "multiply": "mul", "multiply_": "mul_", "divide_": "div_",
    "true_divide_": "div_", "ger": "outer", "broadcast_to": "expand",
    "split_with_sizes": "split", "unsafe_split": "split", "unsafe_split_with_sizes": "split",
    "unsafe_chunk": "chunk",
}
for _name, _target in sorted(_ALIASES.items()):
    method(_name)(_alias(_target, _name))
method("ndimension", function=False)(_alias("dim", "ndimension"))
method("nelement", function=False)(_alias("numel", "nelement"))


def _subtract(self, other, *, alpha=1):
    """``torch.subtract``: ``x - alpha * other`` (:meth:`Tensor.sub`'s other name)."""
    return self.sub(other, alpha=alpha)


def _subtract_(self, other, *, alpha=1):
    """In place :func:`_subtract`."""
    return self.sub_(other, alpha=alpha)


method("subtract")(_subtract)
method("subtract_")(_subtract_)


def _positive(self):
    """``torch.positive``: ``x`` itself (torch returns the input; bool raises)."""
    if self.dtype == torch.bool:
        raise RuntimeError("The `+` operator, on a bool tensor is not supported.")
    return self


method("positive")(_positive)


# --------------------------------------------------------------- in-place comparisons
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    method(f"{_name}_")(_inplace_binary(_name, f"{_name}_"))
for _alias_name, _name in (("greater", "gt"), ("greater_equal", "ge"), ("less", "lt"),
                           ("less_equal", "le"), ("not_equal", "ne")):
    method(f"{_alias_name}_")(_inplace_binary(_name, f"{_alias_name}_"))


def _logical_inplace(op: str):
    name = f"{op}_"

    def call(self, other):
        other = want_tensor(name, "other", other)
        return dispatch_inplace(self, name, op, (other,), {},
                                lambda s, o: getattr(s, name)(o))

    call.__name__ = name
    call.__doc__ = f"In place ``torch.Tensor.{name}`` (rules of op ``{op}``)."
    return call


for _name in ("logical_and", "logical_or", "logical_xor"):
    method(f"{_name}_")(_logical_inplace(_name))
method("bitwise_not_")(_inplace_unary("bitwise_not"))


# --------------------------------------------------------------- new pointwise ops
_BINARY_NEW = {  # name -> (torch function, takes a Python number as other)
    "fmax": (torch.fmax, False), "fmin": (torch.fmin, False), "gcd": (torch.gcd, False),
    "lcm": (torch.lcm, False), "ldexp": (torch.ldexp, False), "igamma": (torch.igamma, False),
    "igammac": (torch.igammac, False),
    "bitwise_left_shift": (torch.bitwise_left_shift, True),
    "bitwise_right_shift": (torch.bitwise_right_shift, True),
}
for _name, (_fn, _scalar) in sorted(_BINARY_NEW.items()):
    register(_name, elementwise())(_fn)
    if _scalar:
        register(f"{_name}_scalar", elementwise())(lambda a, *, other, _fn=_fn: _fn(a, other))
    method(_name)(_binary(_name, f"{_name}_scalar" if _scalar else "", _name))
    if hasattr(torch.Tensor, f"{_name}_"):
        method(f"{_name}_")(_inplace_binary(_name, f"{_name}_") if _scalar
                            else _logical_inplace(_name))  # tensor-only: a number raises

_UNARY_NEW = {"signbit": torch.signbit, "isposinf": torch.isposinf,
              "isneginf": torch.isneginf, "isreal": torch.isreal, "angle": torch.angle}
for _name, _fn in sorted(_UNARY_NEW.items()):
    register(_name, elementwise())(_fn)
    method(_name)(_unary(_name))

register("mvlgamma", elementwise())(lambda a, *, p: torch.mvlgamma(a, p))
register("polygamma", elementwise())(lambda a, *, n: torch.polygamma(n, a))
register("frexp_mantissa", elementwise())(lambda a: torch.frexp(a)[0])
register("frexp_exponent", elementwise())(lambda a: torch.frexp(a)[1])


def _hardshrink(self, lambd: float = 0.5):
    """``torch.nn.functional.hardshrink``: ``x`` where ``|x| > lambd``, else 0. No P rule."""
    return dispatch("nn.hardshrink", self, lambd=lambd)  # sbpflow.ops.nn's activation


def _mvlgamma(self, p: int):
    """``torch.mvlgamma``: the multivariate log-gamma of dimension ``p`` (elementwise;
    torch raises for elements <= (p - 1) / 2)."""
    return dispatch("mvlgamma", self, p=p)


def _mvlgamma_(self, p: int):
    return dispatch_inplace(self, "mvlgamma_", "mvlgamma", (), {"p": p},
                            lambda s: s.mvlgamma_(p))


def _polygamma(self, n: int):
    """``x.polygamma(n)``: the ``n``-th derivative of the digamma function."""
    return dispatch("polygamma", self, n=n)


def _polygamma_(self, n: int):
    return dispatch_inplace(self, "polygamma_", "polygamma", (), {"n": n},
                            lambda s: s.polygamma_(n))


def polygamma(n: int, input):  # noqa: A002 - torch's argument order and name
    """``torch.polygamma(n, input)``."""
    return want_tensor("polygamma", "input", input).polygamma(n)


def _frexp(self):
    """``torch.frexp``: ``(mantissa, exponent)`` with ``x = mantissa * 2 ** exponent``
    (mantissa in [0.5, 1) in magnitude, exponent int32). Elementwise, two outputs."""
    return torch.return_types.frexp((dispatch("frexp_mantissa", self),
                                     dispatch("frexp_exponent", self)))


method("hardshrink", function=False)(_hardshrink)
method("mvlgamma")(_mvlgamma)
method("mvlgamma_")(_mvlgamma_)
method("polygamma", function=False)(_polygamma)
method("polygamma_")(_polygamma_)
function("polygamma")(polygamma)
method("frexp")(_frexp)


def _real(self):
    """``torch.real``: a real tensor itself (torch returns the input)."""
    if self.dtype.is_complex:
        raise NotImplementedError("real() of a complex sbpflow tensor: sbpflow's ops are "
                                  "real; use torch on x.to_local()")
    return self


def _imag(self):
    raise RuntimeError("imag is not implemented for tensors with non-complex dtypes.")


for _name in ("conj", "resolve_conj", "resolve_neg", "conj_physical"):
    method(_name)(_real)
method("conj_physical_")(_real)
method("real")(property(_real))
method("imag")(property(_imag))
function("real")(_real)
function("imag")(_imag)


# --------------------------------------------------------------- metadata
def _is_nonzero(self) -> bool:
    """``torch.is_nonzero``: the truth of a one-element tensor (collective for a global
    tensor: every rank gets it). Raises RuntimeError for another number of elements."""
    n = self.numel()
    if n == 0:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous")
    if n > 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    return bool(self.item() != 0)


def _logical_strides(self) -> tuple[int, ...]:
    """The strides of a dense tensor of the global shape whose dims are ordered in
    memory as the shard's are (contiguous when the shard is)."""
    from .random import memory_order

    order = memory_order(self._local)
    strides = [0] * self.ndim
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(int(self.shape[d]), 1)
    return tuple(strides)


def _stride(self, dim: int | None = None):
    """``torch.Tensor.stride``: a local tensor's; a global tensor's logical strides (see
    the module doc; the shard's own are ``x.to_local().stride()``)."""
    strides = self._local.stride() if self.is_local else _logical_strides(self)
    return strides if dim is None else strides[norm_dim(dim, self.ndim)]


def _dim_order(self, *, ambiguity_check=False):
    """``torch.Tensor.dim_order``: the dims from outermost to innermost in memory."""
    if self.is_local:
        return self._local.dim_order(ambiguity_check=ambiguity_check)
    strides = _logical_strides(self)
    return tuple(sorted(range(self.ndim), key=lambda d: -strides[d]))


def _get_device(self) -> int:
    """``torch.Tensor.get_device``: -1 on the CPU, else the device index (this rank's)."""
    return self._local.get_device()


def _cuda(self, device=None, non_blocking: bool = False):
    """``torch.Tensor.cuda``: a local tensor moved to a CUDA device; a global tensor on a
    CUDA placement is returned as is (move global tensors with ``to_global``)."""
    if self.is_local:
        return Tensor(self._local.cuda(device, non_blocking=non_blocking))
    if self.placement.type != "cuda":
        raise ValueError(f"cuda() of a global tensor on {self.placement!r}: move it with "
                         f"x.to_global(placement=sbpflow.placement('cuda', ranks), sbp=...)")
    return self


method("is_floating_point")(lambda self: self.dtype.is_floating_point)
method("is_complex")(lambda self: self.dtype.is_complex)
method("is_signed", function=False)(lambda self: self.dtype.is_signed)
method("is_conj")(lambda self: self._local.is_conj())
method("is_neg")(lambda self: self._local.is_neg())
method("is_nonzero")(_is_nonzero)
method("is_same_size")(lambda self, other: tuple(self.shape) == tuple(
    want_tensor("is_same_size", "other", other).shape))
method("is_distributed")(lambda self: self.is_global)
method("is_contiguous", function=False)(
    lambda self, memory_format=torch.contiguous_format:
    self._local.is_contiguous(memory_format=memory_format))
method("stride", function=False)(_stride)
method("dim_order", function=False)(_dim_order)
method("get_device")(_get_device)
method("cuda", function=False)(_cuda)
method("element_size", function=False)(lambda self: self.dtype.itemsize)
for _name, _get in (
        ("itemsize", lambda self: self.dtype.itemsize),
        ("nbytes", lambda self: self.numel() * self.dtype.itemsize),
        ("layout", lambda self: torch.strided),
        ("is_cpu", lambda self: self._local.is_cpu),
        ("is_cuda", lambda self: self._local.is_cuda),
        ("is_meta", lambda self: self._local.is_meta),
        ("name", lambda self: None),
        ("grad_dtype", lambda self: self._local.grad_dtype),
        ("mT", lambda self: _matrix_transpose(self, "mT")),
        ("mH", lambda self: _matrix_transpose(self, "mH")),
        ("H", lambda self: _hermitian(self)),
):
    method(_name)(property(_get))


# --------------------------------------------------------------- shape helpers
def _matrix_transpose(self, what: str):
    if self.ndim < 2:
        raise RuntimeError(f"tensor.{what} is only supported on matrices or batches of "
                           f"matrices. Got {self.ndim}-D tensor.")
    return self.transpose(-2, -1)


def _hermitian(self):
    if self.ndim not in (0, 2):
        raise RuntimeError(f"tensor.H is only supported on matrices (2-D tensors). Got "
                           f"{self.ndim}-D tensor.")
    return self if self.ndim == 0 else self.transpose(0, 1)


def _adjoint(self):
    """``torch.adjoint``: the last two dims transposed (a view in torch; real dtypes)."""
    return _matrix_transpose(self, "adjoint()")


def _ravel(self):
    """``torch.ravel``: the flattened tensor (``reshape(-1)``)."""
    return self.reshape(-1)


def _fliplr(self):
    """``torch.fliplr``: reverse dim 1 (2 or more dims)."""
    if self.ndim < 2:
        raise RuntimeError("Input must be >= 2-d.")
    return self.flip(1)


def _flipud(self):
    """``torch.flipud``: reverse dim 0 (1 or more dims)."""
    if self.ndim < 1:
        raise RuntimeError("Input must be >= 1-d.")
    return self.flip(0)


def _rot90(self, k: int = 1, dims=(0, 1)):
    """``torch.rot90``: rotate by 90 degrees ``k`` times in the plane ``dims``, from the
    first towards the second (torch's composition of flip and transpose)."""
    dims = list(dims)
    if len(dims) != 2:
        raise RuntimeError(f"expected total rotation dims == 2, but got dims = {len(dims)}")
    if self.ndim < 2:
        raise RuntimeError(f"expected total dims >= 2, but got total dims = {self.ndim}")
    d0, d1 = norm_dim(dims[0], self.ndim), norm_dim(dims[1], self.ndim)
    if d0 == d1:
        raise RuntimeError(f"expected rotation dims to be different, but got dim0 = {d0} and "
                           f"dim1 = {d1}")
    k %= 4
    if k == 1:
        return self.flip(d1).transpose(d0, d1)
    if k == 2:
        return self.flip(d0, d1)
    if k == 3:
        return self.flip(d0).transpose(d0, d1)
    return self.clone()


def _tensor_split(self, indices_or_sections, dim: int = 0):
    """``torch.tensor_split``: views along ``dim`` (``narrow``): ``n`` sections (the first
    ``size % n`` one element longer) or the pieces between the given indices."""
    dim = norm_dim(dim, self.ndim)
    size = int(self.shape[dim])
    if isinstance(indices_or_sections, Tensor):
        indices_or_sections = indices_or_sections.tolist()
    if isinstance(indices_or_sections, torch.Tensor):
        indices_or_sections = indices_or_sections.tolist()
    if isinstance(indices_or_sections, int):
        n = indices_or_sections
        if n <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {n}")
        base, extra = divmod(size, n)
        bounds, at = [], 0
        for i in range(n):
            at += base + (1 if i < extra else 0)
            bounds.append(at)
        bounds = bounds[:-1]
    else:
        bounds = [int(i) for i in indices_or_sections]
    out, start = [], 0
    for end in [*bounds, size]:
        s = min(max(start if start >= 0 else start + size, 0), size)
        e = min(max(end if end >= 0 else end + size, 0), size)
        out.append(self.narrow(dim, s, max(e - s, 0)))
        start = end
    return tuple(out)


def _split_dim(name: str, dim_of):
    def call(self, indices_or_sections):
        dim = dim_of(self)
        if isinstance(indices_or_sections, int):
            size = int(self.shape[dim])
            if indices_or_sections == 0 or size % indices_or_sections:
                raise RuntimeError(
                    f"torch.{name} attempted to split along dimension {dim}, but the size of "
                    f"the dimension {size} is not divisible by the split_size "
                    f"{indices_or_sections}!")
        return _tensor_split(self, indices_or_sections, dim)

    call.__name__ = name
    call.__doc__ = f"``torch.{name}``: :meth:`tensor_split` along its dim (views)."
    return call


def _dims_at_least(name: str, n: int, dim: int):
    def dim_of(self):
        if self.ndim < n:
            raise RuntimeError(f"torch.{name} requires a tensor with at least {n} dimension, "
                               f"but got a tensor with {self.ndim} dimensions!")
        return dim if self.ndim > 1 or name != "hsplit" else 0
    return dim_of


def _sum_to_size(self, *size):
    """``torch.Tensor.sum_to_size``: sum to ``size``, which ``x`` must expand from
    (reduced dims: the leading ones and those of size 1 in ``size``)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    size = tuple(int(s) for s in size)
    lead = self.ndim - len(size)
    if lead < 0 or any(s != 1 and s != int(self.shape[lead + i]) for i, s in enumerate(size)):
        raise RuntimeError(f"size {{{', '.join(map(str, size))}}} is not expandable to size "
                           f"{{{', '.join(str(int(s)) for s in self.shape)}}}.")
    out = self
    if lead:
        out = out.sum(dim=tuple(range(lead)))
    keep = tuple(i for i, s in enumerate(size) if s == 1 and int(out.shape[i]) != 1)
    if keep:
        out = out.sum(dim=keep, keepdim=True)
    return out


def _msort(self):
    """``torch.msort``: sorted along dim 0 (``sort(dim=0).values``)."""
    return self.sort(dim=0)[0]


def _diagflat(self, offset: int = 0):
    """``torch.diagflat``: a 2-D tensor with the flattened input on diagonal ``offset``."""
    return self.reshape(-1).diag(offset)


def _take(self, index):
    """``torch.take``: the elements at ``index`` of the flattened tensor (shape of
    ``index``; negative indices count from the end)."""
    index = want_tensor("take", "index", index)
    n = self.numel()
    flat = index.reshape(-1)
    flat = flat + (flat < 0).long() * n
    return self.reshape(-1).index_select(0, flat).reshape(tuple(index.shape))


def _inplace_view(name: str, make):
    """``x.<name>(...)``: torch's in-place view op. A local tensor: torch's, on the
    wrapped tensor. A global one: takes the metadata (and shard, a view of its own) of
    the out-of-place result; a leaf that requires grad raises as in torch."""

    def call(self, *args, **kwargs):
        if self.is_local:
            getattr(self._local, name)(*args, **kwargs)
            self._shape = self._local.shape
            return self
        if self.requires_grad and self.is_leaf and torch.is_grad_enabled():
            raise RuntimeError("a leaf Variable that requires grad is being used in an "
                               "in-place operation.")
        out = make(self, *args, **kwargs)
        self._local, self._sbp, self._shape = out._local, out._sbp, out._shape
        return self

    call.__name__ = name
    call.__doc__ = f"In place ``torch.Tensor.{name}`` (see :func:`_inplace_view`)."
    return call


method("adjoint")(_adjoint)
method("ravel")(_ravel)
method("fliplr")(_fliplr)
method("flipud")(_flipud)
method("rot90")(_rot90)
method("tensor_split")(_tensor_split)
method("hsplit")(_split_dim("hsplit", _dims_at_least("hsplit", 1, 1)))
method("vsplit")(_split_dim("vsplit", _dims_at_least("vsplit", 2, 0)))
method("dsplit")(_split_dim("dsplit", _dims_at_least("dsplit", 3, 2)))
method("sum_to_size", function=False)(_sum_to_size)
method("msort")(_msort)
method("diagflat")(_diagflat)
method("take")(_take)
method("t_")(_inplace_view("t_", lambda x: x.t()))
method("transpose_")(_inplace_view("transpose_", lambda x, a, b: x.transpose(a, b)))
method("swapaxes_")(_inplace_view("swapaxes_", lambda x, a, b: x.transpose(a, b)))
method("swapdims_")(_inplace_view("swapdims_", lambda x, a, b: x.transpose(a, b)))
method("squeeze_")(_inplace_view("squeeze_", lambda x, *d: x.squeeze(*d)))
method("unsqueeze_")(_inplace_view("unsqueeze_", lambda x, d: x.unsqueeze(d)))


# --------------------------------------------------------------- linear algebra
def _vector(name: str, what: str, t) -> Tensor:
    t = want_tensor(name, what, t)
    if t.ndim != 1:
        raise RuntimeError(f"{name}: Expected 1-D argument {what}, but got {t.ndim}-D")
    return t


register("dot", einsum("i,i->"))(torch.dot)  # torch's kernels (BLAS dot and gemv)
register("mv", einsum("ij,j->i"))(torch.mv)


def _dot(self, other):
    """``torch.dot``: the inner product of two 1-D tensors of one dtype. SBP: both split
    alike give the P partial sums (all-reduced where a B result is needed); one P, the
    other B gives P."""
    other = want_tensor("dot", "tensor", other)
    if self.ndim != 1 or other.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {self.ndim}D and {other.ndim}D "
                           f"tensors")
    if self.shape[0] != other.shape[0]:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{self.shape[0]}] and "
                           f"src [{other.shape[0]}] to have the same number of elements, but "
                           f"got {self.shape[0]} and {other.shape[0]} elements respectively")
    if self.dtype != other.dtype:
        raise RuntimeError(f"dot : expected both vectors to have same dtype, but found "
                           f"{self.dtype} and {other.dtype}")
    return dispatch("dot", self, other)


def _mv(self, vec):
    """``torch.mv``: (n, m) x (m,) -> (n,). SBP: rows split -> split; the contraction
    dim split on both -> P."""
    vec = want_tensor("mv", "vec", vec)
    if self.ndim != 2 or vec.ndim != 1:
        raise RuntimeError(f"vector + matrix @ vector expected, got {self.ndim}, "
                           f"{vec.ndim}")
    return dispatch("mv", self, vec)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _inner(self, other):
    """``torch.inner``: contraction of the last dims (a scalar operand multiplies)."""
    other = want_tensor("inner", "other", other)
    if self.ndim == 0 or other.ndim == 0:
        return self * other
    if self.shape[-1] != other.shape[-1]:
        raise RuntimeError(f"inner() the last dimension must match on both input tensors "
                           f"but got shapes {list(self.shape)} and {list(other.shape)}")
    a = _LETTERS[:self.ndim - 1]
    b = _LETTERS[self.ndim - 1:self.ndim + other.ndim - 2]
    from . import matmul as _mm

    return _mm.einsum(f"{a}z,{b}z->{a}{b}", self, other)


def _addr(self, vec1, vec2, *, beta=1, alpha=1):
    """``torch.addr``: ``beta * x + alpha * outer(vec1, vec2)`` (``x`` ignored when
    ``beta == 0``, as torch: its NaN and inf do not propagate)."""
    outer = _vector("addr", "vec1", vec1).outer(_vector("addr", "vec2", vec2))
    if alpha != 1:
        outer = outer * alpha
    if beta == 0:
        return outer
    return (self * beta if beta != 1 else self) + outer


def _addr_(self, vec1, vec2, *, beta=1, alpha=1):
    """In place :func:`_addr`."""
    return self.copy_(_addr(self, vec1, vec2, beta=beta, alpha=alpha))


method("dot")(_dot)
method("vdot")(_dot)
method("mv")(_mv)
method("inner")(_inner)
method("addr")(_addr)
method("addr_")(_addr_)



# --------------------------------------------------------------- factorizations, solvers
def _batched(metas, attrs) -> list:
    """Batched linear algebra: every input split alike on a batch dim (all but the last
    two; inputs of one rank) -> the outputs split there."""
    nds = {m.ndim for m in metas}
    if len(nds) != 1:
        return []
    nd = nds.pop()
    return [(S(d),) * (len(metas) + 1) for d in range(nd - 2)]


_LINALG = {  # name -> (kernel, tensor inputs after x, returns a tuple)
    "det": (torch.det, 0), "logdet": (torch.logdet, 0), "inverse": (torch.inverse, 0),
    "matrix_exp": (torch.matrix_exp, 0),
    "slogdet": (lambda a: tuple(torch.slogdet(a)), 0),
    "cholesky": (lambda a, *, upper: torch.cholesky(a, upper), 0),
    "cholesky_inverse": (lambda a, *, upper: torch.cholesky_inverse(a, upper), 0),
    "cholesky_solve": (lambda a, b, *, upper: torch.cholesky_solve(a, b, upper), 1),
    "pinverse": (lambda a, *, rcond: torch.pinverse(a, rcond), 0),
    "matrix_power": (lambda a, *, n: torch.matrix_power(a, n), 0),
    "qr": (lambda a, *, some: tuple(torch.qr(a, some)), 0),
    "svd": (lambda a, *, some, compute_uv: tuple(torch.svd(a, some, compute_uv)), 0),
    "lu": (lambda a, *, pivot, get_infos: tuple(torch.linalg.lu_factor_ex(a, pivot=pivot))
           [:3 if get_infos else 2], 0),
    "lu_solve": (lambda a, lu, piv: torch.lu_solve(a, lu, piv), 2),
    "triangular_solve": (lambda a, m, *, upper, transpose, unitriangular:
                         tuple(torch.triangular_solve(a, m, upper, transpose, unitriangular)),
                         1),
    "geqrf": (lambda a: tuple(torch.geqrf(a)), 0),
    "orgqr": (lambda a, tau: torch.linalg.householder_product(a, tau), 1),
    "ormqr": (lambda a, tau, other, *, left, transpose: torch.ormqr(a, tau, other, left,
                                                                   transpose), 2),
}
_TUPLES = ("slogdet", "qr", "svd", "triangular_solve", "geqrf")  # torch's named tuples


def _tuple_type(name: str):
    """torch's named tuple of ``name`` (``torch.return_types.qr``...), looked up when used:
    a later torch that drops a deprecated function drops its type too (torch 2.14 has no
    ``return_types.qr``; ``linalg_qr`` has the same fields). None: a plain tuple."""
    rt = torch.return_types
    return getattr(rt, name, None) or getattr(rt, "linalg_" + name, None)
def _geqrf_meta(metas, attrs):
    """torch has no meta kernel for geqrf: ``(a, tau)``, ``a`` of the input's shape and
    ``tau`` of ``(*batch, min(m, n))``."""
    m = metas[0]
    return Meta(m.shape, m.dtype), Meta((*m.shape[:-2], min(m.shape[-2:])), m.dtype)


for _name, (_fn, _) in sorted(_LINALG.items()):
    register(_name, _batched, meta=_geqrf_meta if _name == "geqrf" else None)(_fn)


def _linalg(name: str, *tensor_args, **attrs):
    out = dispatch(name, *tensor_args, **attrs)
    kind = _tuple_type(name) if name in _TUPLES else None
    return kind(out) if kind is not None else out


def _linalg_method(name: str, params: str, doc: str, defaults: dict | None = None):
    """``x.<name>(<tensor args>, **attrs)``; positional tensors first, then attrs in
    ``params`` order (torch's signature)."""
    n_tensors = _LINALG[name][1]
    names = params.split() if params else []
    defaults = defaults or {}

    def call(self, *args, **kwargs):
        tensors = [want_tensor(name, f"argument {i + 1}", a) for i, a in
                   enumerate(args[:n_tensors])]
        rest = dict(zip(names, args[n_tensors:]))
        rest.update(kwargs)
        attrs = {k: rest.get(k, defaults.get(k)) for k in names}
        missing = [k for k in names if attrs[k] is None and k not in defaults]
        if len(tensors) < n_tensors or missing:
            raise TypeError(f"{name}() missing required arguments")
        return _linalg(name, self, *tensors, **attrs)

    call.__name__ = name
    call.__doc__ = (f"``torch.{name}``: {doc} SBP: a batch dim split on every input stays "
                    f"split; otherwise the inputs are boxed to B and every rank computes it.")
    return call


for _name, _params, _doc, _defaults in (
        ("det", "", "the determinant.", None),
        ("logdet", "", "the log-determinant.", None),
        ("slogdet", "", "(sign, log|det|).", None),
        ("inverse", "", "the matrix inverse.", None),
        ("matrix_exp", "", "the matrix exponential.", None),
        ("matrix_power", "n", "the integer matrix power.", None),
        ("pinverse", "rcond", "the pseudo-inverse.", {"rcond": 1e-15}),
        ("cholesky", "upper", "the Cholesky factor.", {"upper": False}),
        ("cholesky_inverse", "upper", "the inverse from a Cholesky factor.",
         {"upper": False}),
        ("cholesky_solve", "upper", "solves with a Cholesky factor.", {"upper": False}),
        ("qr", "some", "(Q, R).", {"some": True}),
        ("svd", "some compute_uv", "(U, S, V).", {"some": True, "compute_uv": True}),
        ("lu", "pivot get_infos", "(LU, pivots[, infos]).",
         {"pivot": True, "get_infos": False}),
        ("lu_solve", "", "solves with an LU factorization.", None),
        ("triangular_solve", "upper transpose unitriangular",
         "(solution, cloned_coefficient).",
         {"upper": True, "transpose": False, "unitriangular": False}),
        ("geqrf", "", "(a, tau) of LAPACK's geqrf.", None),
        ("orgqr", "", "Q from geqrf's Householder reflectors.", None),
        ("ormqr", "left transpose", "multiplies by Q from geqrf.",
         {"left": True, "transpose": False}),
):
    method(_name)(_linalg_method(_name, _params, _doc, _defaults))


# --------------------------------------------------------------- replicated ops
def _kron(a, b):
    return torch.kron(a.contiguous(), b.contiguous())  # torch's kron views its input


def _cov_meta(metas, attrs) -> Meta:
    """cov/corrcoef have no meta kernel: (V, N) -> (V, V), (N,) -> ()."""
    m = metas[0]
    dtype = m.dtype if m.dtype.is_floating_point or m.dtype.is_complex else \
        torch.get_default_dtype()
    return Meta(() if m.ndim < 2 else (m.shape[0], m.shape[0]), dtype)


register("kron")(_kron)
register("cov", meta=_cov_meta)(lambda a, *, correction: torch.cov(a, correction=correction))
register("cov_weighted", meta=_cov_meta)(lambda a, fw, aw, *, correction: torch.cov(
    a, correction=correction, fweights=fw, aweights=aw))
register("corrcoef", meta=_cov_meta)(torch.corrcoef)
register("renorm")(lambda a, *, p, dim, maxnorm: torch.renorm(a, p, dim, maxnorm))
register("put")(lambda a, i, v, *, accumulate: a.put(i, v, accumulate))


def _cov(self, *, correction: int = 1, fweights=None, aweights=None):
    """``torch.cov`` of the rows (variables) over the columns (observations)."""
    if fweights is None and aweights is None:
        return dispatch("cov", self, correction=correction)
    if fweights is None or aweights is None:
        n = self.shape[-1] if self.ndim else 1
        ones = self.new_ones(n) if fweights is None else None
        fweights = fweights if fweights is not None else ones.long()
        aweights = aweights if aweights is not None else self.new_ones(n)
    return dispatch("cov_weighted", self, fweights, aweights, correction=correction)


def _replicated_call(self, fn, *others):
    """``fn(x, *others)`` of the whole tensors (boxed to B; sizes that depend on the
    values, or no meta kernel in torch): every result B, not differentiable."""
    from .algorithms import all_b, b_result

    xs = [all_b(t) for t in (self, *others)]
    out = fn(*(t._local.detach() for t in xs))
    wrap = Tensor if self.is_local else (lambda t: b_result(t, xs[0].placement))
    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _histogram(self, bins=100, *, range=None, weight=None, density=False):  # noqa: A002
    """``torch.histogram``: ``(hist, bin_edges)`` of the whole tensor (B results)."""
    others = [t for t in (bins, weight) if isinstance(t, Tensor)]

    def run(x, *ts):
        it = iter(ts)
        b = next(it) if isinstance(bins, Tensor) else bins
        w = next(it) if isinstance(weight, Tensor) else weight
        kw = {"weight": w, "density": density}
        return tuple(torch.histogram(x, b, **kw) if isinstance(b, torch.Tensor) else
                     torch.histogram(x, b, range=range, **kw))

    return torch.return_types.histogram(_replicated_call(self, run, *others))


def _renorm(self, p, dim: int, maxnorm):
    """``torch.renorm``: each sub-tensor along ``dim`` rescaled to norm at most
    ``maxnorm``."""
    return dispatch("renorm", self, p=p, dim=dim, maxnorm=maxnorm)


def _renorm_(self, p, dim: int, maxnorm):
    return self.copy_(_renorm(self, p, dim, maxnorm))


def _put(self, index, source, accumulate: bool = False):
    """``torch.Tensor.put``: ``source`` written (or added) at the flat ``index``es."""
    return dispatch("put", self, want_tensor("put", "index", index),
                    want_tensor("put", "source", source), accumulate=accumulate)


def _put_(self, index, source, accumulate: bool = False):
    return self.copy_(_put(self, index, source, accumulate))


def _unique_consecutive(self, return_inverse: bool = False, return_counts: bool = False,
                        dim=None):
    """``torch.unique_consecutive`` (sizes depend on the values: B results, computed on
    the whole tensor)."""
    return _replicated_call(self, lambda x: torch.unique_consecutive(
        x, return_inverse=return_inverse, return_counts=return_counts, dim=dim))


method("kron")(lambda self, other: dispatch("kron", self, want_tensor("kron", "other", other)))
method("cov")(_cov)
method("corrcoef")(lambda self: dispatch("corrcoef", self))
method("histogram")(_histogram)
method("renorm")(_renorm)
method("renorm_")(_renorm_)
method("put", function=False)(_put)
method("put_")(_put_)
method("unique_consecutive")(_unique_consecutive)
function("put")(lambda input, index, source, accumulate=False:  # noqa: A006
                _put(input, index, source, accumulate))


# --------------------------------------------------------------- in-place random fills
def _fill_random(name: str, sample):
    """``x.<name>(...)``: ``sample(t, *args, generator=g, **kwargs)`` is torch's in-place
    sampler on a torch tensor ``t``."""

    def call(self, *args, generator=None, **kwargs):
        if self.is_local:
            sample(self._local, *args, generator=generator, **kwargs)
            return self
        pl, nd = self.placement, self.sbp
        local = self._local

        def draw(size, g):
            t = torch.empty(size, dtype=local.dtype, device=local.device)
            return sample(t, *args, generator=g, **kwargs)

        shard = _rng.draw_shard(draw, tuple(self.shape), pl, nd, generator)
        coord = pl.coord()
        if coord is not None and any(s.is_partial() and c != 0 for s, c in zip(nd, coord)):
            shard = torch.zeros_like(shard)
        # written as an in-place copy in x's own layout (no communication; torch's refusal
        # for a leaf that requires grad)
        return self.copy_(Tensor(shard, pl, nd, self.shape))

    call.__name__ = name
    call.__doc__ = (f"``torch.Tensor.{name}`` (layout invariant: the global value equals "
                    f"torch's on one process with the same seed; see the module doc).")
    return call


def _bernoulli_(t, p=0.5, *, generator=None):
    if isinstance(p, Tensor):
        p = p.to_global(sbp=(B,) * p.placement.ndim)._local if p.is_global else p._local
    return t.bernoulli_(p, generator=generator)


for _name, _sample in (
        ("uniform_", lambda t, *a, generator=None, **k: t.uniform_(*a, generator=generator,
                                                                   **k)),
        ("normal_", lambda t, *a, generator=None, **k: t.normal_(*a, generator=generator,
                                                                 **k)),
        ("cauchy_", lambda t, *a, generator=None, **k: t.cauchy_(*a, generator=generator,
                                                                 **k)),
        ("exponential_", lambda t, *a, generator=None, **k: t.exponential_(
            *a, generator=generator, **k)),
        ("geometric_", lambda t, *a, generator=None, **k: t.geometric_(
            *a, generator=generator, **k)),
        ("log_normal_", lambda t, *a, generator=None, **k: t.log_normal_(
            *a, generator=generator, **k)),
        ("random_", lambda t, *a, generator=None, **k: t.random_(*a, generator=generator,
                                                                 **k)),
        ("bernoulli_", _bernoulli_),
):
    method(_name)(_fill_random(_name, _sample))


# --------------------------------------------------------------- new tensors like x
def _new_tensor(self, data, dtype=None, device=None, requires_grad: bool = False):
    """``torch.Tensor.new_tensor``: a copy of ``data`` with ``x``'s dtype (unless
    ``dtype``); for a global ``x`` on its placement, laid out B."""
    from .creation import tensor

    dtype = dtype or self.dtype
    if isinstance(data, Tensor):
        data = data.numpy()
    if self.is_local:
        return Tensor(self._local.new_tensor(data, dtype=dtype, device=device,
                                             requires_grad=requires_grad))
    return tensor(torch.as_tensor(data, dtype=dtype), placement=self.placement,
                  sbp=(B,) * self.placement.ndim, requires_grad=requires_grad)


def _new(self, *args, **kwargs):
    """``torch.Tensor.new`` (legacy): an uninitialized tensor of ``x``'s dtype and the
    given size, or a copy of a sequence; for a global ``x`` on its placement, B."""
    if args and not isinstance(args[0], int) and not isinstance(args[0], torch.Size):
        return _new_tensor(self, args[0])
    size = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args
    return self.new_empty(tuple(size), **kwargs)


def _new_empty_strided(self, size, stride, *, dtype=None, device=None,
                       requires_grad: bool = False):
    """``torch.Tensor.new_empty_strided``: local: torch's; global: ``new_empty(size)``
    (a global tensor's memory is its shards')."""
    if self.is_local:
        return Tensor(self._local.new_empty_strided(size, stride, dtype=dtype or self.dtype,
                                                    device=device,
                                                    requires_grad=requires_grad))
    return self.new_empty(tuple(size), dtype=dtype, requires_grad=requires_grad)


method("new_tensor")(_new_tensor)
method("new", function=False)(_new)
method("new_empty_strided")(_new_empty_strided)


# --------------------------------------------------------------- scatter-like ops
def _split_others_rule(n_like: int):
    """(x, index, src...) reduced into along ``attrs["dim"]``: another dim may be split in
    the first ``n_like`` inputs and the output where they share its size (indices B
    otherwise); no P rule (the reductions are not linear)."""

    def rule(metas, attrs):
        dim = attrs["dim"]
        x = metas[0]
        sigs = []
        for d in range(x.ndim):
            if d != dim and all(m.ndim == x.ndim and m.shape[d] == x.shape[d]
                                for m in metas[:n_like]):
                sigs.append(tuple(S(d) if i < n_like else B for i in range(len(metas)))
                            + (S(d),))
        return sigs

    return rule


register("scatter_reduce", _split_others_rule(3))(
    lambda a, i, s, *, dim, reduce, include_self: torch.scatter_reduce(
        a, dim, i, s, reduce, include_self=include_self))
register("index_reduce", lambda metas, attrs: [
    (S(d), B, S(d), S(d)) for d in range(metas[0].ndim)
    if d != attrs["dim"] and metas[2].ndim == metas[0].ndim
    and metas[2].shape[d] == metas[0].shape[d]])(
    lambda a, i, s, *, dim, reduce, include_self: torch.index_reduce(
        a, dim, i, s, reduce, include_self=include_self))
register("masked_scatter")(lambda a, m, s: a.masked_scatter(m, s))
register("unfold", lambda metas, attrs: [
    (S(d), S(d)) for d in range(metas[0].ndim) if d != attrs["dimension"]] + [(P, P)])(
    lambda a, *, dimension, size, step: a.unfold(dimension, size, step))


def _index(self, what: str, index):
    from .index import _index_arg

    return _index_arg(self, index, what)


def _scatter_reduce(self, dim: int, index, src, reduce: str, *, include_self: bool = True):
    """``torch.scatter_reduce``: ``src`` reduced into ``x`` at ``index`` along ``dim``
    with ``reduce`` (``sum``, ``prod``, ``mean``, ``amax``, ``amin``). SBP: another dim
    split in x, index and src alike stays split; otherwise B."""
    dim = norm_dim(dim, self.ndim)
    return dispatch("scatter_reduce", self, _index(self, "scatter_reduce", index),
                    _index(self, "scatter_reduce", src), dim=dim, reduce=reduce,
                    include_self=include_self)


def _index_reduce(self, dim: int, index, source, reduce: str, *, include_self: bool = True):
    """``torch.index_reduce``: slices of ``source`` reduced into slices ``index`` of
    ``dim`` (``prod``, ``mean``, ``amax``, ``amin``). SBP: another dim split in x and
    source stays split (index B)."""
    dim = norm_dim(dim, self.ndim)
    return dispatch("index_reduce", self, _index(self, "index_reduce", index),
                    _index(self, "index_reduce", source), dim=dim, reduce=reduce,
                    include_self=include_self)


def _masked_scatter(self, mask, source):
    """``torch.masked_scatter``: ``source``'s elements, in order, where ``mask`` is True
    (the positions depend on the values: computed replicated, B)."""
    return dispatch("masked_scatter", self, want_tensor("masked_scatter", "mask", mask),
                    want_tensor("masked_scatter", "source", source))


def _unfold(self, dimension: int, size: int, step: int):
    """``torch.Tensor.unfold``: windows of ``size`` every ``step`` along ``dimension``
    (a new last dim). SBP: another dim's split and P pass through; ``dimension`` whole."""
    return dispatch("unfold", self, dimension=norm_dim(dimension, self.ndim), size=size,
                    step=step)


def _slice_scatter(self, src, dim: int = 0, start=None, end=None, step: int = 1):
    """``torch.slice_scatter``: ``x`` with ``x[start:end:step]`` along ``dim`` replaced by
    ``src`` (``cat`` of the kept parts and ``src``, for step 1; a mask otherwise)."""
    from .view import cat

    src = want_tensor("slice_scatter", "src", src)
    dim = norm_dim(dim, self.ndim)
    n = int(self.shape[dim])
    lo, hi, stride = slice(start, end, step).indices(n)
    if stride == 1:
        hi = max(hi, lo)
        parts = [self.narrow(dim, 0, lo), src.to(self.dtype), self.narrow(dim, hi, n - hi)]
        return cat([p for p in parts if p.shape[dim]], dim)
    picked = list(range(lo, hi, stride))
    pos = torch.full((n,), -1, dtype=torch.long)
    pos[picked] = torch.arange(len(picked))
    return _select_positions(self, src, dim, pos)


def _select_positions(x, src, dim: int, pos: torch.Tensor):
    """``x`` with slice ``i`` of ``dim`` replaced by ``src``'s slice ``pos[i]`` where
    ``pos[i] >= 0``."""
    from .creation import tensor as make

    shape = [1] * x.ndim
    shape[dim] = -1
    keep = pos < 0
    take = pos.clamp(min=0)
    if x.is_global:
        b = (B,) * x.placement.ndim
        keep_t = make(keep.reshape(shape), placement=x.placement, sbp=b)
        take_t = make(take, placement=x.placement, sbp=b)
    else:
        keep_t, take_t = Tensor(keep.reshape(shape)), Tensor(take)
    spread = src.to(x.dtype).index_select(dim, take_t)
    from .pointwise import where

    return where(keep_t, x, spread)


def _select_scatter(self, src, dim: int, index: int):
    """``torch.select_scatter``: ``x`` with ``x.select(dim, index)`` replaced by ``src``."""
    dim = norm_dim(dim, self.ndim)
    n = int(self.shape[dim])
    index = index + n if index < 0 else index
    if not 0 <= index < n:
        raise IndexError(f"select_scatter(): index {index} out of range for tensor of size "
                         f"{list(self.shape)} at dimension {dim}")
    src = want_tensor("select_scatter", "src", src)
    return _slice_scatter(self, src.unsqueeze(dim), dim, index, index + 1)


def _diagonal_scatter(self, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """``torch.diagonal_scatter``: ``x`` with its diagonal (``offset``, ``dim1``,
    ``dim2``) replaced by ``src`` (``diag_embed`` of ``src`` and a mask of the
    diagonal)."""
    src = want_tensor("diagonal_scatter", "src", src)
    d1, d2 = norm_dim(dim1, self.ndim), norm_dim(dim2, self.ndim)
    want = tuple(self.diagonal(offset, d1, d2).shape)
    if tuple(src.shape) != want:
        raise RuntimeError(f"diagonal_scatter: src must have shape {list(want)} (the "
                           f"diagonal's), got {list(src.shape)}")
    mask = torch.zeros(int(self.shape[d1]), int(self.shape[d2]), dtype=torch.bool)
    mask.diagonal(offset).fill_(True)
    shape = [1] * self.ndim
    shape[d1], shape[d2] = mask.shape
    from .creation import tensor as make

    mask_t = make(mask.reshape(shape), placement=self.placement,
                  sbp=(B,) * self.placement.ndim) if self.is_global else \
        Tensor(mask.reshape(shape))
    # the diagonal's values at their places: diag_embed puts the last dim of src on the
    # diagonal of two new trailing dims; move them to (d1, d2)
    full = src.to(self.dtype).diag_embed(offset, -2, -1)
    rest = [d for d in range(self.ndim) if d not in (d1, d2)]
    order = [0] * self.ndim
    for i, d in enumerate(rest):
        order[d] = i
    order[d1], order[d2] = self.ndim - 2, self.ndim - 1
    full = full.permute(*order)
    full = _fit_to(full, self.shape)
    from .pointwise import where

    return where(mask_t, full, self)


def _fit_to(t, shape):
    """``t`` cut or padded with zeros at the end of each dim to ``shape``."""
    from .view import cat

    for d, n in enumerate(shape):
        have = int(t.shape[d])
        if have > n:
            t = t.narrow(d, 0, n)
        elif have < n:
            extra = list(t.shape)
            extra[d] = n - have
            t = cat([t, t.new_zeros(tuple(extra))], d)
    return t


def _fill_diagonal_(self, fill_value, wrap: bool = False):
    """``torch.Tensor.fill_diagonal_``: the main diagonal (all dims equal beyond 2-D;
    ``wrap`` continues below N rows of a tall matrix) set to ``fill_value``, in place."""
    mask = torch.zeros(tuple(int(s) for s in self.shape), dtype=torch.bool)
    mask.fill_diagonal_(True, wrap=wrap)
    from .creation import tensor as make

    mask_t = make(mask, placement=self.placement, sbp=(B,) * self.placement.ndim) \
        if self.is_global else Tensor(mask)
    return self.masked_fill_(mask_t, fill_value)


def _index_put(self, indices, values, accumulate: bool = False):
    """``torch.index_put``: ``x`` with ``values`` written (or added, ``accumulate``) at the
    positions the index tensors give (out of place)."""
    out = self.clone()
    return _index_put_(out, indices, values, accumulate)


def _index_put_(self, indices, values, accumulate: bool = False):
    """``torch.Tensor.index_put_``: ``x[indices] = values`` (``accumulate``: ``+=``, with
    repeated indices summed, as torch's). Global: ``x[indices] = values`` where every
    dim indexed by a tensor is whole on each rank; otherwise (and for ``accumulate``) on
    the whole tensor, boxed to B, written back into ``x``'s layout."""
    indices = tuple(indices)
    if self.is_local:
        idx = tuple(i._local if isinstance(i, Tensor) else i for i in indices)
        v = values._local if isinstance(values, Tensor) else torch.as_tensor(values)
        self._local.index_put_(idx, v.to(self.dtype), accumulate=accumulate)
        return self
    split_dims = {s.dim for s in self.sbp if s.is_split()}
    indexed = {d for d, i in enumerate(indices) if i is not None}
    if not accumulate and not (split_dims & indexed) and \
            not any(s.is_partial() for s in self.sbp):
        self[indices] = values
        return self
    from .algorithms import all_b
    from .creation import tensor as make

    whole = all_b(self)
    idx = tuple(all_b(i)._local if isinstance(i, Tensor) else i for i in indices)
    v = all_b(values)._local if isinstance(values, Tensor) else torch.as_tensor(values)
    result = whole._local.detach().clone().index_put_(idx, v.to(self.dtype),
                                                      accumulate=accumulate)
    return self.copy_(make(result, placement=self.placement,
                           sbp=(B,) * self.placement.ndim))


def _nonzero_static(self, *, size: int, fill_value: int = -1):
    """``torch.nonzero_static``: ``nonzero`` padded (with ``fill_value``) or cut to
    ``size`` rows (B, computed on the whole tensor)."""
    return _replicated_call(self, lambda x: torch.nonzero_static(x, size=size,
                                                                 fill_value=fill_value))


def _prelu(self, weight):
    """``torch.prelu`` (see :func:`sbpflow.ops.nn.prelu`)."""
    from .nn import prelu

    return prelu(self, want_tensor("prelu", "weight", weight))


def _as_strided(self, size, stride, storage_offset=None):
    """``torch.as_strided`` of a local tensor; a global tensor raises (strides address one
    process's memory; a global tensor's memory is its shards')."""
    if self.is_global:
        raise NotImplementedError(
            "as_strided of a global tensor: strides address one process's memory, and a "
            "global tensor's values live in shards on several; use view ops (reshape, "
            "narrow, unfold, expand) or x.to_local().as_strided(...) on a shard")
    return Tensor(self._local.as_strided(size, stride, storage_offset))


def _as_strided_(self, size, stride, storage_offset=None):
    if self.is_global:
        _as_strided(self, size, stride, storage_offset)
    self._local.as_strided_(size, stride, storage_offset)
    self._shape = self._local.shape
    return self


def _as_strided_scatter(self, src, size, stride, storage_offset=None):
    if self.is_global:
        _as_strided(self, size, stride, storage_offset)
    return Tensor(self._local.as_strided_scatter(src._local, size, stride, storage_offset))


def _as_subclass(self, cls):
    """``torch.Tensor.as_subclass`` of a local tensor: its torch tensor as ``cls``; a
    global tensor raises (``cls`` would see one shard as the whole tensor)."""
    if self.is_global:
        raise NotImplementedError(
            "as_subclass of a global tensor: the subclass would see this rank's shard as "
            "the whole tensor; use x.to_local().as_subclass(cls) on purpose")
    return self._local.as_subclass(cls)


def _stft(self, n_fft: int, hop_length=None, win_length=None, window=None,
          center: bool = True, pad_mode: str = "reflect", normalized: bool = False,
          onesided=None, return_complex=None):
    """``torch.stft`` of the whole signal (B, computed on the whole tensor)."""
    others = [window] if isinstance(window, Tensor) else []
    return _replicated_call(self, lambda x, *w: torch.stft(
        x, n_fft, hop_length, win_length, w[0] if w else None, center, pad_mode,
        normalized, onesided, return_complex), *others)


def _istft(self, n_fft: int, hop_length=None, win_length=None, window=None,
           center: bool = True, normalized: bool = False, onesided=None, length=None,
           return_complex: bool = False):
    """``torch.istft`` (B, computed on the whole tensor)."""
    others = [window] if isinstance(window, Tensor) else []
    return _replicated_call(self, lambda x, *w: torch.istft(
        x, n_fft, hop_length, win_length, w[0] if w else None, center, normalized,
        onesided, length, return_complex), *others)


method("scatter_reduce")(_scatter_reduce)
method("scatter_reduce_")(lambda self, dim, index, src, reduce, *, include_self=True:
                          self.copy_(_scatter_reduce(self, dim, index, src, reduce,
                                                     include_self=include_self)))
method("index_reduce")(_index_reduce)
method("index_reduce_")(lambda self, dim, index, source, reduce, *, include_self=True:
                        self.copy_(_index_reduce(self, dim, index, source, reduce,
                                                 include_self=include_self)))
method("masked_scatter")(_masked_scatter)
method("masked_scatter_")(lambda self, mask, source:
                          self.copy_(_masked_scatter(self, mask, source)))
method("unfold", function=False)(_unfold)
method("slice_scatter")(_slice_scatter)
method("select_scatter")(_select_scatter)
method("diagonal_scatter")(_diagonal_scatter)
method("fill_diagonal_", function=False)(_fill_diagonal_)
method("index_put")(_index_put)
method("index_put_")(_index_put_)
method("nonzero_static")(_nonzero_static)
method("prelu")(_prelu)
method("as_strided")(_as_strided)
method("as_strided_")(_as_strided_)
method("as_strided_scatter")(_as_strided_scatter)
method("as_subclass", function=False)(_as_subclass)
method("stft")(_stft)
method("istft")(_istft)
