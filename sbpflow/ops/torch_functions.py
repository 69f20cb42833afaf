"""torch's functions that are not Tensor methods (issue 21): ``sbpflow.<name>`` for
``torch.<name>``, on local and global tensors.

Each is written with sbpflow's ops, so a global input's layout flows through the ops'
SBP rules (``tensordot`` is an einsum, ``meshgrid`` reshapes and expands, ``trapezoid``
sums and narrows, ``vander`` is a cumulative product), except:

* **creation** (windows, ``logspace``, ``range``, ``scalar_tensor``, ``empty_strided``,
  ``asarray``...): a local tensor, or with ``placement=``/``sbp=`` (or under
  :func:`sbpflow.default_placement`) a global one, as sbpflow's other creation functions;
* **replicated** (``block_diag``, ``cartesian_prod``, ``combinations``, ``histogramdd``,
  ``lu_unpack``, the low-rank factorizations, ``binomial``, ``poisson``, and the complex
  constructors ``complex``, ``polar``, ``view_as_real``, ``view_as_complex``): the inputs are
  boxed to B and every rank computes torch's result on the whole tensors (results B).
  The random ones stay layout invariant: every rank draws from the same generator state
  the same whole tensor, as torch does on one process.
"""

from __future__ import annotations

import torch

from ..sbp import Split, broadcast
from ..tensor import Tensor
from .api import function
from .args import norm_dim, want_tensor
from .creation import _DEFAULT_PLACEMENT, _resolve, tensor
from .dispatch import dispatch
from .registry import register

B = broadcast


def _made(whole: torch.Tensor, placement=None, sbp=None, requires_grad: bool = False):
    """``whole`` as a local tensor, or laid out ``sbp`` on ``placement`` (or the default
    placement) when either is given."""
    if placement is None and sbp is None and _DEFAULT_PLACEMENT.get() is None:
        return Tensor(whole.requires_grad_(requires_grad) if requires_grad else whole)
    pl, nd = _resolve(placement, sbp, whole.ndim)
    return tensor(whole, placement=pl, sbp=nd, requires_grad=requires_grad)


def _creator(name: str, torch_fn):
    def create(*args, placement=None, sbp=None, requires_grad: bool = False, **kwargs):
        return _made(torch_fn(*args, **kwargs), placement, sbp, requires_grad)

    create.__name__ = name
    create.__doc__ = (f"``torch.{name}``: a local tensor, or global with ``placement=``/"
                      f"``sbp=`` (each rank makes the whole value and keeps its shard).")
    return create


for _name in ("bartlett_window", "blackman_window", "hamming_window", "hann_window",
              "kaiser_window", "logspace", "scalar_tensor"):
    function(_name)(_creator(_name, getattr(torch, _name)))


def _range(start, end=None, step=1, *, dtype=None, device=None, requires_grad=False,
           placement=None, sbp=None):
    """``torch.range`` (deprecated in torch): ``[start, end]`` with ``end`` included, the
    default float dtype. Prefer :func:`sbpflow.arange`."""
    if end is None:
        start, end = 0, start
    n = int((end - start) // step) + 1
    from .creation import arange

    dtype = dtype or torch.get_default_dtype()
    return arange(0, n, dtype=torch.float64, device=device, placement=placement,
                  sbp=sbp).mul(step).add(start).to(dtype).requires_grad_(requires_grad)


def _empty_strided(size, stride, *, dtype=None, device=None, requires_grad=False,
                   placement=None, sbp=None, **kw):
    """``torch.empty_strided``: local: torch's; global: an empty tensor of ``size`` (a
    global tensor's memory is its shards')."""
    from .creation import empty

    if placement is None and sbp is None and _DEFAULT_PLACEMENT.get() is None:
        return Tensor(torch.empty_strided(size, stride, dtype=dtype, device=device,
                                          requires_grad=requires_grad, **kw))
    return empty(*size, dtype=dtype, requires_grad=requires_grad, placement=placement,
                 sbp=sbp)


def _empty_permuted(size, physical_layout, *, dtype=None, device=None,
                    requires_grad=False, placement=None, sbp=None, **kw):
    """``torch.empty_permuted``: local: torch's; global: an empty tensor of ``size``."""
    from .creation import empty

    if placement is None and sbp is None and _DEFAULT_PLACEMENT.get() is None:
        return Tensor(torch.empty_permuted(size, physical_layout, dtype=dtype, device=device,
                                           requires_grad=requires_grad, **kw))
    return empty(*size, dtype=dtype, requires_grad=requires_grad, placement=placement,
                 sbp=sbp)


def _asarray(obj, *, dtype=None, device=None, copy=None, requires_grad=False,
             placement=None, sbp=None):
    """``torch.asarray``: an sbpflow tensor as it is (cast with ``dtype``, copied with
    ``copy=True``); other data as :func:`sbpflow.tensor` makes it."""
    if isinstance(obj, Tensor):
        out = obj.to(dtype) if dtype is not None else obj
        return out.clone() if copy and out is obj else out
    whole = torch.asarray(obj, dtype=dtype, device=device, copy=copy)
    return _made(whole, placement, sbp, requires_grad)


function("range")(_range)
function("empty_strided")(_empty_strided)
function("empty_permuted")(_empty_permuted)
function("asarray")(_asarray)


# --------------------------------------------------------------- shapes
def _at_least(n: int):
    def call(*tensors):
        if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
            tensors = tuple(tensors[0])
        out = []
        for t in tensors:
            t = want_tensor(f"atleast_{n}d", "tensor", t)
            if t.ndim == 0:
                t = t.reshape((1,) * n)
            elif t.ndim == 1 and n >= 2:
                t = t.unsqueeze(0)
                if n == 3:
                    t = t.unsqueeze(-1)
            elif t.ndim == 2 and n == 3:
                t = t.unsqueeze(-1)
            out.append(t)
        return out[0] if len(out) == 1 else tuple(out)

    call.__name__ = f"atleast_{n}d"
    call.__doc__ = (f"``torch.atleast_{n}d``: views with at least {n} dims (torch's "
                    f"placement of the new dims).")
    return call


for _n in (1, 2, 3):
    function(f"atleast_{_n}d")(_at_least(_n))


def _broadcast_tensors(*tensors):
    """``torch.broadcast_tensors``: every tensor expanded to the broadcast shape."""
    shape = torch.broadcast_shapes(*(tuple(t.shape) for t in tensors))
    return tuple(t.expand(*shape) for t in tensors)


def _column_stack(tensors):
    """``torch.column_stack``: 0-D and 1-D tensors become columns, then ``hstack``."""
    from .view import cat

    cols = [t.reshape(-1, 1) if t.ndim <= 1 else t for t in tensors]
    return cat(cols, 1)


def _dstack(tensors):
    """``torch.dstack``: ``atleast_3d`` then concatenation along dim 2."""
    from .view import cat

    return cat([_at_least(3)(t) for t in tensors], 2)


def _row_stack(tensors):
    """``torch.row_stack`` (``vstack``): ``atleast_2d`` then concatenation along dim 0."""
    from .view import cat

    return cat([_at_least(2)(t) for t in tensors], 0)


def _meshgrid(*tensors, indexing: str = "ij"):
    """``torch.meshgrid``: 1-D (or 0-D) inputs expanded to the grid (views); ``indexing``
    ``'ij'`` (matrix) or ``'xy'`` (Cartesian: the first two dims swapped)."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ValueError(f"torch.meshgrid: indexing must be one of \"xy\" or \"ij\", but "
                         f"received: {indexing}")
    ts = [t.reshape(-1) for t in tensors]
    swap = indexing == "xy" and len(ts) >= 2
    if swap:
        ts[0], ts[1] = ts[1], ts[0]
    shape = tuple(int(t.shape[0]) for t in ts)
    out = []
    for i, t in enumerate(ts):
        view = [1] * len(ts)
        view[i] = -1
        out.append(t.reshape(*view).expand(*shape))
    if swap:
        out[0], out[1] = out[1], out[0]
    return tuple(out)


function("broadcast_tensors")(_broadcast_tensors)
function("column_stack")(_column_stack)
function("dstack")(_dstack)
function("row_stack")(_row_stack)
function("meshgrid")(_meshgrid)


# --------------------------------------------------------------- linear algebra
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _tensordot(a, b, dims=2, out=None):
    """``torch.tensordot``: contraction over ``dims`` (an int: the last ``dims`` of ``a``
    with the first of ``b``; or two lists) as one einsum (its SBP rules: a contracted
    dim split on both gives P)."""
    from . import matmul as _mm

    if isinstance(dims, int):
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    elif isinstance(dims, torch.Tensor) or isinstance(dims, Tensor):
        dims = dims.tolist()
        da, db = ([dims[0]], [dims[1]]) if isinstance(dims[0], int) else dims
    else:
        da, db = dims
        da = [da] if isinstance(da, int) else list(da)
        db = [db] if isinstance(db, int) else list(db)
    da = [norm_dim(d, a.ndim) for d in da]
    db = [norm_dim(d, b.ndim) for d in db]
    if len(da) != len(db):
        raise RuntimeError("both dimension lists should have same length")
    la = list(_LETTERS[:a.ndim])
    lb = list(_LETTERS[a.ndim:a.ndim + b.ndim])
    for i, j in zip(da, db):
        lb[j] = la[i]
    out_l = [c for i, c in enumerate(la) if i not in da] + \
        [c for j, c in enumerate(lb) if j not in db]
    return _mm.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out_l)}", a, b)


def _chain_matmul(*matrices, out=None):
    """``torch.chain_matmul`` (deprecated in torch): the product, left to right."""
    if len(matrices) == 1 and isinstance(matrices[0], (list, tuple)):
        matrices = tuple(matrices[0])
    acc = matrices[0]
    for m in matrices[1:]:
        acc = acc.matmul(m)
    return acc


def _frobenius_norm(input, dim, keepdim: bool = False):  # noqa: A002
    """``torch.frobenius_norm``: the 2-norm over the dims ``dim``."""
    return input.norm(2, dim=dim, keepdim=keepdim)


def _nuclear_norm(input, dim=None, keepdim: bool = False):  # noqa: A002
    """``torch.nuclear_norm``: the sum of the singular values of the matrices in ``dim``
    (the last two by default); factorization replicated (see :mod:`sbpflow.ops.compat`)."""
    x = input
    if dim is not None:
        d0, d1 = (norm_dim(d, x.ndim) for d in dim)
        rest = [d for d in range(x.ndim) if d not in (d0, d1)]
        x = x.permute(*rest, d0, d1)
    out = x.svd(compute_uv=False)[1].sum(-1)
    if keepdim:
        out = out.reshape(*out.shape, 1, 1)
    return out


def _norm_except_dim(v, pow: float = 2, dim: int = 0):  # noqa: A002
    """``torch.norm_except_dim`` (weight norm's): the ``pow``-norm of every slice of
    ``dim``, shaped ``(1, .., size, .., 1)``; ``dim=-1``: the norm of the whole tensor."""
    if dim == -1:
        return v.norm(pow)
    dim = norm_dim(dim, v.ndim)
    others = tuple(d for d in range(v.ndim) if d != dim)
    return v.norm(pow, dim=others, keepdim=True) if others else v.abs()


function("tensordot")(_tensordot)
function("chain_matmul")(_chain_matmul)
function("frobenius_norm")(_frobenius_norm)
function("nuclear_norm")(_nuclear_norm)
function("norm_except_dim")(_norm_except_dim)


# --------------------------------------------------------------- numerical calculus
def _pairs(y, dim: int):
    n = int(y.shape[dim])
    return y.narrow(dim, 1, n - 1), y.narrow(dim, 0, n - 1)


def _trapezoid(y, x=None, *, dx=None, dim: int = -1):
    """``torch.trapezoid``: the trapezoidal rule along ``dim`` with spacing ``dx`` (default
    1) or sample points ``x`` (torch's formulas: ``(sum(y) - (y_0 + y_n) / 2) * dx``, or
    ``sum((x_{i+1} - x_i) * (y_{i+1} + y_i)) / 2``)."""
    dim = norm_dim(dim, y.ndim)
    if int(y.shape[dim]) == 0:
        return y.sum(dim)
    if x is None or not isinstance(x, Tensor):
        spacing = 1.0 if dx is None and x is None else (x if x is not None else dx)
        ends = y.select(dim, 0) + y.select(dim, -1)
        return (y.sum(dim) - ends * 0.5) * spacing
    right, left = _pairs(y, dim)
    xd = dim if x.ndim == y.ndim else 0
    xr, xl = _pairs(x, xd)
    if x.ndim == 1 and y.ndim > 1:
        view = [1] * y.ndim
        view[dim] = -1
        xr, xl = xr.reshape(*view), xl.reshape(*view)
    return ((xr - xl) * (left + right)).sum(dim) / 2


def _cumulative_trapezoid(y, x=None, *, dx=None, dim: int = -1):
    """``torch.cumulative_trapezoid``: the running trapezoidal rule along ``dim``."""
    dim = norm_dim(dim, y.ndim)
    right, left = _pairs(y, dim)
    if x is None or not isinstance(x, Tensor):
        spacing = 1.0 if dx is None and x is None else (x if x is not None else dx)
        return ((left + right) * (spacing / 2.0)).cumsum(dim)
    xd = dim if x.ndim == y.ndim else 0
    xr, xl = _pairs(x, xd)
    if x.ndim == 1 and y.ndim > 1:
        view = [1] * y.ndim
        view[dim] = -1
        xr, xl = xr.reshape(*view), xl.reshape(*view)
    return ((xr - xl) * (left + right) / 2.0).cumsum(dim)


def _gradient(input, *, spacing=1, dim=None, edge_order: int = 1):  # noqa: A002
    """``torch.gradient``: second-order central differences inside, first-order
    (``edge_order=1``) one-sided ones at the edges, along each of ``dim`` (all dims by
    default), with uniform ``spacing`` (a number, or one per dim). Coordinate tensors
    as ``spacing``: local tensors only (torch's)."""
    if input.is_local:
        sp = spacing
        if isinstance(sp, (list, tuple)):
            sp = [s._local if isinstance(s, Tensor) else s for s in sp]
        out = torch.gradient(input._local, spacing=sp, dim=dim, edge_order=edge_order)
        return tuple(Tensor(o) for o in out)
    from .view import cat

    dims = list(range(input.ndim)) if dim is None else \
        [norm_dim(d, input.ndim) for d in ([dim] if isinstance(dim, int) else dim)]
    hs = list(spacing) if isinstance(spacing, (list, tuple)) else [spacing] * len(dims)
    if any(isinstance(h, Tensor) for h in hs) or edge_order != 1:
        raise NotImplementedError("gradient of a global tensor takes number spacings and "
                                  "edge_order=1; use torch.gradient on x.to_local() of a B "
                                  "tensor for coordinates or edge_order=2")
    out = []
    for d, h in zip(dims, hs):
        n = int(input.shape[d])
        if n < 2:
            raise RuntimeError("torch.gradient expected each dimension size to be at least "
                               "edge_order+1")
        first = (input.narrow(d, 1, 1) - input.narrow(d, 0, 1)) / h
        last = (input.narrow(d, n - 1, 1) - input.narrow(d, n - 2, 1)) / h
        parts = [first]
        if n > 2:
            parts.append((input.narrow(d, 2, n - 2) - input.narrow(d, 0, n - 2)) / (2 * h))
        parts.append(last)
        out.append(cat(parts, d))
    return tuple(out)


function("trapezoid")(_trapezoid)
function("trapz")(lambda y, x=None, *, dx=None, dim=-1: _trapezoid(y, x, dx=dx, dim=dim))
function("cumulative_trapezoid")(_cumulative_trapezoid)
function("gradient")(_gradient)


def _vander(x, N=None, increasing: bool = False):
    """``torch.vander``: columns ``x ** 0 .. x ** (N - 1)`` (decreasing by default), as
    torch computes them (a cumulative product). SBP: a split of ``x`` splits the rows."""
    from .creation import ones_like
    from .view import cat

    n = int(x.shape[0]) if N is None else int(N)
    if x.ndim != 1:
        raise RuntimeError("x must be a one-dimensional tensor.")
    if n < 0:
        raise RuntimeError("N must be non-negative.")
    col = ones_like(x).unsqueeze(1)
    if n == 0:
        return col.narrow(1, 0, 0)
    out = col
    if n > 1:
        powers = x.unsqueeze(1).expand(int(x.shape[0]), n - 1).cumprod(1)
        out = cat([col.to(powers.dtype), powers], 1)
    return out if increasing else out.flip(1)


def _unravel_index(indices, shape):
    """``torch.unravel_index``: the coordinates of flat ``indices`` in ``shape`` (a tuple
    of int64 tensors, elementwise: layouts pass)."""
    if isinstance(shape, int):
        shape = (shape,)
    out, rest = [], indices
    for size in reversed(tuple(shape)):
        out.append(rest.remainder(size))
        rest = rest.floor_divide(size)
    return tuple(reversed(out))


function("vander")(_vander)
function("unravel_index")(_unravel_index)


# --------------------------------------------------------------- small things
def _rsub(input, other, *, alpha=1):  # noqa: A002
    """``torch.rsub``: ``other - alpha * input``."""
    scaled = input if alpha == 1 else input * alpha
    return scaled.neg() + other if not isinstance(other, Tensor) else other - scaled


def _fill(input, value):  # noqa: A002
    """``torch.fill``: a new tensor of ``input``'s shape, dtype and layout holding
    ``value`` (a number or a 0-d tensor)."""
    out = input.detach().clone()
    return out.fill_(value)


def _detach_(input):  # noqa: A002
    """``torch.detach_``: cut ``input`` from the autograd graph, in place."""
    input._local.detach_()
    return input


function("rsub")(_rsub)
function("fill")(_fill)
function("detach")(lambda input: input.detach())  # noqa: A006
function("detach_")(_detach_)
function("numel")(lambda input: input.numel())  # noqa: A006
function("is_signed")(lambda input: input.dtype.is_signed)  # noqa: A006


# --------------------------------------------------------------- replicated functions
def _replicated(name: str, torch_fn, tuple_out=None):
    """``torch_fn`` of the whole tensors: boxed to B, computed on every rank."""

    def call(*args, **kwargs):
        from .algorithms import all_b, b_result

        tensors = [a for a in args if isinstance(a, Tensor)]
        if not tensors or all(t.is_local for t in tensors):
            out = torch_fn(*(a._local if isinstance(a, Tensor) else a for a in args),
                           **kwargs)
            wrap = Tensor
        else:
            pl = next(t.placement for t in tensors if t.is_global)
            out = torch_fn(*(all_b(a)._local if isinstance(a, Tensor) else a for a in args),
                           **kwargs)

            def wrap(t):
                return b_result(t, pl)
        if isinstance(out, (tuple, list)):
            res = tuple(wrap(o) if isinstance(o, torch.Tensor) else o for o in out)
            return tuple_out(res) if tuple_out is not None else res
        return wrap(out)

    call.__name__ = name
    call.__doc__ = (f"``torch.{name}`` of the whole tensors (global inputs are boxed to B "
                    f"and every rank computes it; the results are B).")
    return call


for _name in ("block_diag", "cartesian_prod", "combinations", "histogramdd", "lu_unpack",
              "lobpcg", "pca_lowrank", "svd_lowrank", "binomial", "poisson",
              "complex", "polar", "view_as_real", "view_as_complex"):
    function(_name)(_replicated(_name, getattr(torch, _name)))


def _isin_rule(metas, attrs):
    """``isin(elements, test_elements)``: elementwise in ``elements`` (its splits pass)
    with ``test_elements`` whole (B)."""
    return [(Split(d), B, Split(d)) for d in range(metas[0].ndim)]


register("isin", _isin_rule)(lambda a, t, *, assume_unique, invert: torch.isin(
    a, t, assume_unique=assume_unique, invert=invert))


def _isin(elements, test_elements, *, assume_unique: bool = False, invert: bool = False):
    """``torch.isin``: whether each element of ``elements`` is in ``test_elements`` (a
    tensor or a number). SBP: ``elements``' splits pass; ``test_elements`` B."""
    if not isinstance(test_elements, Tensor):
        return elements.ne(test_elements) if invert else elements.eq(test_elements)
    if not isinstance(elements, Tensor):
        elements = test_elements.new_tensor(elements)
    return dispatch("isin", elements, test_elements, assume_unique=assume_unique,
                    invert=invert)


function("isin")(_isin)
