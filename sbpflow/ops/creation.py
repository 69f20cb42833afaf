"""Creation and sampling ops with ``placement=`` and ``sbp=`` (issue 3), mirroring torch:
:func:`tensor`, :func:`zeros`, :func:`ones`, :func:`full`, :func:`empty`, :func:`arange`,
:func:`linspace`, :func:`eye`, the random ones (:func:`randn`, :func:`rand`,
:func:`randint`, :func:`randperm`, :func:`normal`, :func:`bernoulli`,
:func:`multinomial`), their ``*_like`` forms, :func:`default_placement` and the seeding
functions; from other tensors and data: ``new_zeros``/``new_ones``/``new_full``/
``new_empty``, :func:`from_numpy`, :func:`as_tensor`, :func:`is_tensor`,
:func:`tril_indices`/:func:`triu_indices`. Layer: ops (above :mod:`sbpflow.tensor`, which
holds only the class).

Sizes and values are **global**: every rank of the world calls the op with the same
arguments and holds its shard of the result (ranks outside the placement: an empty
shard). Without ``placement``/``sbp`` every op is the plain torch op on a local tensor.

Deterministic creation (:func:`empty`, :func:`arange`, :func:`linspace`, :func:`eye`,
:func:`full_like`, :func:`empty_like`): each rank computes only its shard (no
communication, shard-sized memory). With ``P`` on a mesh axis the rank at coordinate 0
of that axis holds the value and the others zeros (as :func:`sbpflow.full` does).
``arange``/``linspace`` compute each element from its global index in float64
(``start + step * i``; linspace counts the upper half back from ``end`` as torch does),
so every layout gives the same bits; torch's own vectorised kernel rounds chunk by chunk
and may differ from that by one unit in the last place (integer dtypes: exact).

Randomness (see :mod:`sbpflow.random` for the full rule): after
``sbpflow.manual_seed(s)`` on every rank, a random op gives the global tensor that
``torch.manual_seed(s)`` and the same torch op give on one process, bit for bit on CPU,
whatever the placement and SBP (``B`` ranks agree, ``S`` ranks hold their slice).
Random ops never produce ``P`` (``sbp=`` with ``P`` raises ``ValueError``).

Memory cost of that rule: every rank of the world draws the **whole global tensor**
(one global-size allocation and draw per rank per op), and random ops with tensor inputs
(:func:`bernoulli`, :func:`multinomial`, :func:`normal` with tensor mean/std) first
gather those inputs whole (``B``) on every rank of the placement. For tensors too big
for that, ``with sbpflow.random.per_shard():`` draws only each rank's shard from a
generator seeded by (a draw of torch's generator, the shard's region): shard-sized,
deterministic for a seed and layout, ``B`` ranks agree, but not the one-process value;
inputs are then boxed to the output's layout instead of gathered where their shape
allows. :func:`randperm` always draws whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import operator

import numpy as np
import torch

from .. import random as _rng
from ..placement import placement as Placement
from ..random import get_rng_state, initial_seed, seed, set_rng_state
from ..sbp import broadcast, format_nd_sbp, normalize_nd_sbp, split
from ..tensor import Tensor, _check_placement
from .api import function, method

__all__ = ["tensor", "zeros", "ones", "full", "rand", "randint", "randn", "zeros_like",
           "ones_like", "randn_like", "manual_seed", "default_placement", "empty", "empty_like",
           "full_like", "rand_like", "randint_like", "arange", "linspace", "eye", "randperm",
           "normal", "bernoulli", "multinomial", "seed", "initial_seed", "get_rng_state",
           "set_rng_state"]


_DEFAULT_PLACEMENT: contextvars.ContextVar = contextvars.ContextVar("sbpflow_default_placement",
                                                                   default=None)


@contextlib.contextmanager
def default_placement(placement: Placement | None, sbp=None):
    """Inside the block, creation ops called without ``placement=``/``sbp=`` (``arange``,
    ``zeros``, ``tensor``, ``randn``...) make global tensors on ``placement``, laid out as
    ``sbp`` (default: broadcast (B) on every mesh axis), instead of local ones. This lets
    model code written for one device (``torch.arange(T, device=idx.device)`` in a forward)
    run unchanged on global tensors. ``None`` restores local creation. Scoped to the
    calling context (thread/task). ``sbp`` is checked against each created tensor's dims
    (an ``S(1)`` default cannot lay out a 1-D ``arange``: ``ValueError`` naming both).
    OneFlow's ``utils.global_view.global_mode`` is this.

    Raises:
        TypeError: ``placement`` is not an :class:`sbpflow.placement`, or ``sbp`` without
            a placement.
    """
    if placement is None:
        if sbp is not None:
            raise TypeError(f"default_placement(None, sbp={sbp!r}): an sbp needs a placement")
        token = _DEFAULT_PLACEMENT.set(None)
    else:
        pl = _check_placement(placement)
        if sbp is not None:
            normalize_nd_sbp(sbp, pl.ndim)  # type and mesh-rank check now; dims per tensor
        token = _DEFAULT_PLACEMENT.set((pl, sbp))
    try:
        yield
    finally:
        _DEFAULT_PLACEMENT.reset(token)


def current_default_placement():
    """``(placement, sbp)`` of the innermost :func:`default_placement` block (``sbp`` as
    given there, None for broadcast), or None outside any (or inside ``None``)."""
    return _DEFAULT_PLACEMENT.get()


def _resolve(placement, sbp, ndim: int):
    if placement is None:
        if sbp is not None:
            raise ValueError("sbp= given without placement=; give both for a global tensor")
        default = _DEFAULT_PLACEMENT.get()
        if default is not None:
            pl, want = default
            if want is None:
                return pl, (broadcast,) * pl.ndim
            try:
                return pl, normalize_nd_sbp(want, pl.ndim, ndim)
            except ValueError as e:
                raise ValueError(f"the default layout {want!r} (default_placement / global_mode) "
                                 f"does not fit a created {ndim}-dim tensor: {e}; pass "
                                 f"placement= and sbp= to this call") from None
        return None, None
    if sbp is None:
        raise ValueError("placement= given without sbp=; give both, e.g. "
                         "sbp=sbpflow.sbp.broadcast")
    pl = _check_placement(placement)
    return pl, normalize_nd_sbp(sbp, pl.ndim, ndim)


def tensor(data, *, dtype: torch.dtype | None = None, device=None, requires_grad: bool = False,
           placement: Placement | None = None, sbp=None) -> Tensor:
    """Create a tensor from ``data`` (nested lists, numpy array, torch.Tensor, scalar).

    With ``placement``/``sbp``, ``data`` is the *global* value: every rank of the world
    calls this with the same data, and the value at the placement's mesh coordinate
    (0, ..., 0) wins (it is broadcast, then each rank keeps its shard). With ``P`` the rank
    at coordinate 0 of that mesh axis holds the value and the others zeros.
    """
    if isinstance(data, Tensor):
        data = data.numpy() if data.is_global else data._local
    if isinstance(data, torch.Tensor):  # a copy, detached, as torch.tensor(t) makes
        t = data.detach().to(dtype=dtype or data.dtype, copy=True)
    else:
        t = torch.tensor(data, dtype=dtype)
    pl, nd = _resolve(placement, sbp, t.dim())
    if pl is None:
        if device is not None:
            t = t.to(device)
        return Tensor(t.requires_grad_(requires_grad))
    t = t.to(pl.device)
    with torch.no_grad():
        # check_meta: ranks whose data differ in length still get the first rank's value.
        b = Tensor(t).to_global(pl, (broadcast,) * pl.ndim)
        out = b.to_global(pl, nd)._local.detach()
    return _leaf(out, pl, nd, tuple(b.shape), requires_grad)


def _leaf(local, pl, nd, shape, requires_grad) -> Tensor:
    x = Tensor(local.contiguous(), pl, nd, shape)
    if requires_grad:
        x.requires_grad_(True)
    return x


def _shape_arg(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for s in size:
        try:
            n = operator.index(s)  # ints, numpy ints, 0-dim integer tensors
        except TypeError:
            n = -1
        if isinstance(s, bool) or n < 0:
            raise ValueError(f"sizes must be non-negative ints, got {size!r}")
        out.append(n)
    return tuple(out)


def full(size, fill_value, *, dtype=None, device=None, requires_grad=False, placement=None,
         sbp=None) -> Tensor:
    """A tensor of global shape ``size`` filled with ``fill_value``; each rank makes only its
    shard (no communication). ``P``: coordinate 0 of that axis holds the value, others 0."""
    shape = _shape_arg(tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,))
    pl, nd = _resolve(placement, sbp, len(shape))
    if pl is None:
        return Tensor(torch.full(shape, fill_value, dtype=dtype, device=device,
                                 requires_grad=requires_grad))
    coord = pl.coord()
    local_shape = pl.shard_shape(shape, nd)
    local = torch.full(local_shape, fill_value, dtype=dtype, device=pl.device)
    if coord is not None and any(c != 0 for c, s in zip(coord, nd) if s.is_partial()):
        local.zero_()
    return _leaf(local, pl, nd, shape, requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad=False, placement=None, sbp=None) -> Tensor:
    """Zeros of global shape ``size`` (see :func:`full`)."""
    return full(_shape_arg(size), 0.0 if dtype is None else 0, dtype=dtype or torch.float32,
                device=device, requires_grad=requires_grad, placement=placement, sbp=sbp)


def ones(*size, dtype=None, device=None, requires_grad=False, placement=None, sbp=None) -> Tensor:
    """Ones of global shape ``size`` (see :func:`full`)."""
    return full(_shape_arg(size), 1.0 if dtype is None else 1, dtype=dtype or torch.float32,
                device=device, requires_grad=requires_grad, placement=placement, sbp=sbp)


def _random(name: str, draw, shape, dtype, device, requires_grad, placement, sbp,
            generator=None) -> Tensor:
    """Random creation: ``draw(shape, dtype, device, generator)`` on torch's generator.

    Global: :func:`sbpflow.random.draw_shard` (layout invariant by default: every rank of
    the world draws the whole global tensor, so generators stay in step and every rank
    sees the one-process value, then keeps its shard; memory is one global-size tensor
    per rank; under :func:`sbpflow.random.per_shard` only the shard is drawn). ``P``
    raises: a random summand has no single-device meaning."""
    pl, nd = _resolve(placement, sbp, len(shape))
    if pl is None:
        out = draw(shape, dtype, device, generator)
        return Tensor(out.requires_grad_(requires_grad) if requires_grad else out)
    _no_partial(name, nd)
    local = _rng.draw_shard(lambda s, g: draw(s, dtype, pl.device, g), shape, pl, nd, generator)
    return _leaf(local, pl, nd, shape, requires_grad)


def randn(*size, dtype=None, device=None, requires_grad=False, generator=None, placement=None,
          sbp=None) -> Tensor:
    """Standard normal samples of global shape ``size`` (``torch.randn``).

    Layout invariant: with the same seed the global value equals ``torch.randn(size)`` on
    one process (on the placement's device type), whatever the placement and SBP.
    Raises ``ValueError`` with ``P``.
    """
    return _random("randn", lambda s, dt, dev, g: torch.randn(s, dtype=dt, device=dev,
                                                              generator=g),
                   _shape_arg(size), dtype, device, requires_grad, placement, sbp, generator)


def rand(*size, dtype=None, device=None, requires_grad=False, generator=None, placement=None,
         sbp=None) -> Tensor:
    """Uniform [0, 1) samples of global shape ``size`` (``torch.rand``); layout invariant
    as :func:`randn`. Raises ``ValueError`` with ``P``."""
    return _random("rand", lambda s, dt, dev, g: torch.rand(s, dtype=dt, device=dev,
                                                            generator=g),
                   _shape_arg(size), dtype, device, requires_grad, placement, sbp, generator)


def randint(low: int, high: int, size, *, dtype=torch.int64, device=None, generator=None,
            placement=None, sbp=None) -> Tensor:
    """Integers in [low, high) of global shape ``size`` (``torch.randint``); layout
    invariant as :func:`randn`. Raises ``ValueError`` with ``P``."""
    return _random("randint", lambda s, dt, dev, g: torch.randint(low, high, s, dtype=dt,
                                                                  device=dev, generator=g),
                   _shape_arg(tuple(size)), dtype, device, False, placement, sbp, generator)


def _like(name: str, make, x: Tensor, placement, sbp, **kw) -> Tensor:
    """``*_like``: the global shape of ``x``; its placement and SBP unless given (a P
    layout becomes B for random fills, which cannot be partial)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} takes an sbpflow.Tensor, got {type(x).__name__}")
    kw.setdefault("dtype", x.dtype)
    if x.is_local and placement is None:
        return make(*x.shape, **kw)
    pl = x.placement if placement is None else placement
    nd = sbp if sbp is not None else x.sbp if placement is None else None
    return make(*x.shape, placement=pl, sbp=nd, **kw)


def zeros_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """Zeros with the global shape (and by default the placement and SBP) of ``x``."""
    return _like("zeros_like", zeros, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def ones_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """Ones with the global shape (and by default the placement and SBP) of ``x``."""
    return _like("ones_like", ones, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def randn_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """:func:`randn` with the global shape (and by default the placement and SBP, P read
    as B) of ``x``."""
    return _like("randn_like", randn, x, placement, _random_like_sbp(x, placement, sbp),
                 requires_grad=requires_grad, **({"dtype": dtype} if dtype else {}))


def manual_seed(seed: int):
    """Seed torch's generators on this rank (call with the same seed on every rank)."""
    return torch.manual_seed(seed)


def _no_partial(name: str, nd) -> None:
    if any(s.is_partial() for s in nd):
        raise ValueError(f"{name} with sbp {format_nd_sbp(nd)}: random ops cannot produce "
                         f"partial_sum (a random summand has no single-device meaning); "
                         f"create it B or S and box it")


def _p_as_b(nd) -> tuple:
    return tuple(broadcast if s.is_partial() else s for s in nd)


def _dtype_or_default(dtype) -> torch.dtype:
    return torch.get_default_dtype() if dtype is None else dtype


def _deterministic(name: str, shape, dtype, device, requires_grad, placement, sbp, fill):
    """Shard-only creation: ``fill(region, local_shape, device)`` makes the values of the
    global ``region`` (one slice per dim). P axes: zeros off coordinate 0."""
    pl, nd = _resolve(placement, sbp, len(shape))
    if pl is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return _leaf(fill(tuple(slice(0, s) for s in shape), shape, dev), None, None, shape,
                     requires_grad)
    coord = pl.coord()
    local_shape = pl.shard_shape(shape, nd)
    if coord is None:
        local = torch.empty(local_shape, dtype=dtype, device=pl.device)
    else:
        local = fill(pl.shard_slices(shape, nd), local_shape, pl.device)
        if any(c != 0 for c, s in zip(coord, nd) if s.is_partial()):
            local = torch.zeros_like(local)
    return _leaf(local, pl, nd, shape, requires_grad)


# ---------------------------------------------------------------------- deterministic


def empty(*size, dtype=None, device=None, requires_grad=False, placement=None,
          sbp=None) -> Tensor:
    """Uninitialised tensor of global shape ``size`` (``torch.empty``); each rank allocates
    only its shard (no communication, any SBP). dtype: default float32."""
    shape, dt = _shape_arg(size), _dtype_or_default(dtype)
    return _deterministic("empty", shape, dt, device, requires_grad, placement, sbp,
                          lambda region, local_shape, dev: torch.empty(local_shape, dtype=dt,
                                                                       device=dev))


def empty_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """:func:`empty` with the global shape (and by default the placement and SBP) of
    ``x`` (``torch.empty_like``)."""
    return _like("empty_like", empty, x, placement, sbp, requires_grad=requires_grad,
                 **({"dtype": dtype} if dtype else {}))


def full_like(x: Tensor, fill_value, *, dtype=None, requires_grad=False, placement=None,
              sbp=None):
    """``torch.full_like``: ``fill_value`` with the global shape (and by default the
    placement and SBP, P included: coordinate 0 holds the value) of ``x``; dtype that of
    ``x`` unless given. No communication."""
    return _like("full_like", lambda *s, **kw: full(s, fill_value, **kw), x, placement, sbp,
                 requires_grad=requires_grad, **({"dtype": dtype} if dtype else {}))


def _is_float_arg(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() or v.is_complex()
    return isinstance(v, numbers.Number) and not isinstance(v, numbers.Integral)


def _scalar(name: str, what: str, v):
    if isinstance(v, Tensor):
        v = v.item()
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Number):
        raise TypeError(f"{name}: {what} must be a number, got {v!r} ({type(v).__name__})")
    return v


def arange(start=0, end=None, step=1, *, dtype=None, device=None, requires_grad=False,
           placement=None, sbp=None) -> Tensor:
    """``torch.arange``: ``[start, end)`` with spacing ``step``; ``arange(n)`` is
    ``[0, n)``. 1-D of length ``ceil((end - start) / step)``.

    dtype: as torch infers it: int64 when start, end and step are all integers, else the
    default float dtype. Global: each rank computes its slice ``start + step * i`` for its
    global indices ``i`` (float64, then cast; integers exactly); no communication. ``P``:
    coordinate 0 holds the values, the others zeros.

    Raises:
        ValueError: ``step == 0``, or ``step``'s sign points away from ``end``.
        TypeError: a non-numeric bound.
    """
    if end is None:
        start, end = 0, start
    start, end, step = (_scalar("arange", w, v) for w, v in
                        (("start", start), ("end", end), ("step", step)))
    if step == 0:
        raise ValueError("arange: step must be nonzero, got 0")
    if (end - start) * step < 0:
        raise ValueError(f"arange: step {step} goes away from end: start={start}, end={end}; "
                         f"use a step of the other sign or swap start and end")
    meta = torch.arange(start, end, step, dtype=dtype, device="meta")
    dt, n = meta.dtype, meta.shape[0]
    exact_int = not (dt.is_floating_point or dt.is_complex) and all(
        isinstance(v, numbers.Integral) for v in (start, end, step))

    def fill(region, local_shape, dev):
        a, b = region[0].start, region[0].stop
        if exact_int:
            return torch.arange(start + a * step, start + b * step, step, dtype=dt,
                                device=dev)[: b - a]
        i = torch.arange(a, b, dtype=torch.float64, device=dev)
        return (start + step * i).to(dt)

    if placement is None and sbp is None and _DEFAULT_PLACEMENT.get() is None:
        out = torch.arange(start, end, step, dtype=dt, device=device)
        return _leaf(out, None, None, (n,), requires_grad)
    return _deterministic("arange", (n,), dt, device, requires_grad, placement, sbp, fill)


def linspace(start, end, steps: int, *, dtype=None, device=None, requires_grad=False,
             placement=None, sbp=None) -> Tensor:
    """``torch.linspace``: ``steps`` evenly spaced values from ``start`` to ``end``
    (both included). dtype: default float dtype unless given.

    Global: each rank computes its slice from the global indices with torch's formula
    (``start + step * i`` in the lower half, ``end - step * (steps - 1 - i)`` in the
    upper, ``step = (end - start) / (steps - 1)`` in the dtype's precision; float64 for
    integer dtypes). No communication; ``P``: coordinate 0 holds the values.

    Raises:
        ValueError: negative ``steps``. TypeError: non-integer ``steps``.
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"linspace: steps must be an int, got {steps!r}")
    if steps < 0:
        raise ValueError(f"linspace: steps must be non-negative, got {steps}")
    start, end = _scalar("linspace", "start", start), _scalar("linspace", "end", end)
    dt = _dtype_or_default(dtype)
    steps = int(steps)

    def fill(region, local_shape, dev):
        a, b = region[0].start, region[0].stop
        integral = not (dt.is_floating_point or dt.is_complex)
        step_dt = torch.float64 if integral else dt
        wide = torch.complex128 if dt.is_complex else torch.float64
        s = torch.tensor(start, device=dev).to(dt).to(step_dt)
        e = torch.tensor(end, device=dev).to(dt).to(step_dt)
        if steps == 1:
            return s.to(dt).reshape(1)[: b - a]
        step = ((e - s) / (steps - 1)).to(wide)
        s, e = s.to(wide), e.to(wide)
        i = torch.arange(a, b, dtype=torch.float64, device=dev)
        vals = torch.where(i < steps // 2, s + step * i, e - step * (steps - 1 - i))
        return vals.to(dt)

    if placement is None and sbp is None and _DEFAULT_PLACEMENT.get() is None:
        out = torch.linspace(start, end, steps, dtype=dt, device=device)
        return _leaf(out, None, None, (steps,), requires_grad)
    return _deterministic("linspace", (steps,), dt, device, requires_grad, placement, sbp,
                          fill)


def eye(n: int, m: int | None = None, *, dtype=None, device=None, requires_grad=False,
        placement=None, sbp=None) -> Tensor:
    """``torch.eye``: an ``(n, m)`` matrix (``m`` defaults to ``n``) with ones on the
    diagonal. Each rank fills only its shard's part of the diagonal (no communication);
    ``P``: coordinate 0 holds the values. dtype: default float dtype.

    Raises ValueError for negative ``n`` or ``m``.
    """
    m = n if m is None else m
    for what, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"eye: {what} must be a non-negative int, got {v!r}")
    dt = _dtype_or_default(dtype)

    def fill(region, local_shape, dev):
        (r0, r1), (c0, c1) = ((r.start, r.stop) for r in region)
        out = torch.zeros(local_shape, dtype=dt, device=dev)
        idx = torch.arange(max(r0, c0), max(min(r1, c1), max(r0, c0)), device=dev)
        out[idx - r0, idx - c0] = 1
        return out

    return _deterministic("eye", (int(n), int(m)), dt, device, requires_grad, placement, sbp,
                          fill)


# ---------------------------------------------------------------------- random creation


def _random_like_sbp(x: Tensor, placement, sbp):
    if sbp is None and placement is None and isinstance(x, Tensor) and x.is_global:
        return _p_as_b(x.sbp)
    return sbp


def rand_like(x: Tensor, *, dtype=None, requires_grad=False, placement=None, sbp=None):
    """:func:`sbpflow.rand` with the global shape (and by default the placement and SBP,
    P read as B) of ``x``; dtype that of ``x``. Layout invariant (``torch.rand_like``)."""
    return _like("rand_like", rand, x, placement, _random_like_sbp(x, placement, sbp),
                 requires_grad=requires_grad, **({"dtype": dtype} if dtype else {}))


def randint_like(x: Tensor, low: int = 0, high: int | None = None, *, dtype=None,
                 placement=None, sbp=None):
    """``torch.randint_like``: integers in ``[low, high)`` (``randint_like(x, high)`` is
    ``[0, high)``) with the global shape (and by default the placement and SBP, P read as
    B) and dtype of ``x``. Layout invariant as :func:`sbpflow.randint`."""
    if high is None:
        low, high = 0, low
    return _like("randint_like", lambda *s, **kw: randint(low, high, s, **kw), x, placement,
                 _random_like_sbp(x, placement, sbp), **({"dtype": dtype} if dtype else {}))


def randperm(n: int, *, generator=None, dtype=torch.int64, device=None, requires_grad=False,
             placement=None, sbp=None) -> Tensor:
    """``torch.randperm``: a random permutation of ``0 .. n-1``, layout invariant.

    Always drawn whole on every rank of the world (also under
    :func:`sbpflow.random.per_shard`: a permutation cannot be drawn shard by shard);
    memory: ``n`` elements per rank. Raises ``ValueError`` for a negative ``n`` or ``P``.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"randperm: n must be a non-negative int, got {n!r}")
    pl, nd = _resolve(placement, sbp, 1)
    if pl is None:
        return Tensor(torch.randperm(n, generator=generator, dtype=dtype, device=device,
                                     requires_grad=requires_grad))
    _no_partial("randperm", nd)
    whole = torch.randperm(n, generator=generator, dtype=dtype, device=pl.device)
    local = whole[pl.shard_slices((n,), nd)].clone()
    return _leaf(local, pl, nd, (int(n),), requires_grad)


# ---------------------------------------------------------------------- sampling from tensors


def _common_placement(name: str, tensors, placement) -> Placement | None:
    glob = [t for t in tensors if isinstance(t, Tensor) and t.is_global]
    loc = [t for t in tensors if isinstance(t, Tensor) and t.is_local]
    if glob and loc:
        raise TypeError(f"{name}: inputs mix local and global tensors; convert the local ones "
                        f"with x.to_global(placement, sbp) (or the global ones with .to_local())")
    if not glob:
        if placement is not None:
            raise ValueError(f"{name}: placement= applies to global inputs; convert the input "
                             f"with x.to_global(placement, sbp) instead")
        return None
    pl = glob[0].placement
    for t in glob[1:]:
        if t.placement != pl:
            raise ValueError(f"{name}: inputs live on different placements, {pl!r} and "
                             f"{t.placement!r}; move one with x.to_global(placement=...)")
    if placement is not None and placement != pl:
        raise ValueError(f"{name}: placement={placement!r} differs from the inputs' {pl!r}; "
                         f"move the inputs with x.to_global(placement=...) first")
    return pl


def _out_sbp(name: str, pl: Placement, out_shape, tensors, sbp):
    """The output layout: ``sbp`` if given (never P), else per mesh axis a split that some
    input of the output's size along that dim carries, else B."""
    if sbp is not None:
        nd = normalize_nd_sbp(sbp, pl.ndim, len(out_shape))
        _no_partial(name, nd)
        return nd
    out = []
    for a in range(pl.ndim):
        pick = broadcast
        for t in tensors:
            if not isinstance(t, Tensor):
                continue
            s = t.sbp[a]
            off = len(out_shape) - t.ndim
            if s.is_split() and t.shape[s.dim] == out_shape[s.dim + off]:
                pick = split(s.dim + off)
                break
        out.append(pick)
    return tuple(out)


def _whole(x, pl: Placement) -> torch.Tensor:
    """A global tensor made whole (B) on every rank of ``pl`` (differentiable), contiguous:
    torch's draws follow memory order (``empty_like`` keeps the input's strides)."""
    return x.to_global(pl, (broadcast,) * pl.ndim)._local.contiguous()


def _region_input(x, pl: Placement, out_shape, out_nd, region) -> torch.Tensor:
    """Per-shard mode: the values of a global input that the output's ``region`` needs,
    boxed to the output's layout when it has the output's shape, else whole, expanded and
    sliced (a view)."""
    if tuple(x.shape) == tuple(out_shape):
        return x.to_global(pl, out_nd)._local
    w = _whole(x, pl)
    if pl.coord() is None:
        return w
    return w.expand(out_shape)[region]


def _sample(name: str, draw, args, out_shape, pl, out_nd, generator, stand_in, out_dtype):
    """Shard of a random op whose inputs ``args`` are global tensors or numbers.

    ``draw(*torch_args, generator=)`` is torch's op. Layout-invariant mode: the tensor
    args are made whole and torch's draw is replayed on every rank of the world (outside
    the placement on ``stand_in(i, shape)`` tensors of the same shapes, so the generator
    advances identically). Per-shard mode: the region's inputs, a region generator."""
    coord = pl.coord()
    local_shape = pl.shard_shape(out_shape, out_nd)
    region = pl.shard_slices(out_shape, out_nd)
    if _rng._per_shard_here():
        ins = [_region_input(a, pl, out_shape, out_nd, region) if isinstance(a, Tensor) else a
               for a in args]
        g = _rng.region_generator(out_shape, region, pl.device, generator)
        if coord is None:
            return _outside(ins, local_shape, out_dtype)
        return draw(*ins, generator=g)
    ins = [_whole(a, pl) if isinstance(a, Tensor) else a for a in args]
    if coord is None:
        fake = [stand_in(i, tuple(a.shape), pl.device) if isinstance(a, Tensor) else a
                for i, a in enumerate(args)]
        # Keeps this rank's generator in step; the dtype of what it draws is the output's.
        out_dtype = draw(*fake, generator=generator).dtype
        return _outside(ins, local_shape, out_dtype)
    whole = draw(*ins, generator=generator)
    return whole[region].clone()


def replay_draw(name: str, draw, args, out_shape, pl, out_nd, generator, stand_in,
                out_dtype) -> torch.Tensor:
    """This rank's shard of a random op with tensor inputs whose draw torch makes from
    their values (``multinomial``, ``bernoulli(p_tensor)``, rrelu's slopes): the inputs
    are made whole and ``draw(*torch_args, generator=)`` replayed on every rank of the
    world, as :func:`_sample` does (see there; the layers above ``ops`` use this name)."""
    return _sample(name, draw, args, out_shape, pl, out_nd, generator, stand_in, out_dtype)


def _outside(ins, local_shape, dtype) -> torch.Tensor:
    """An empty shard, connected to the inputs' graph (so backward meets the same
    boxing steps as the placement's ranks)."""
    ref = next(a for a in ins if isinstance(a, torch.Tensor))
    out = torch.empty(local_shape, dtype=dtype, device=ref.device)
    for a in ins:
        if isinstance(a, torch.Tensor) and a.requires_grad and out.is_floating_point():
            out = out + a.reshape(-1)[:0].sum().to(out.dtype)
    return out


def normal(mean=0.0, std=1.0, size=None, *, generator=None, dtype=None, device=None,
           requires_grad=False, placement=None, sbp=None) -> Tensor:
    """``torch.normal``, every overload, layout invariant.

    * ``normal(mean: float, std: float, size)``: global shape ``size``, ``dtype``,
      ``placement``/``sbp`` as :func:`sbpflow.randn` (a leaf, ``requires_grad`` allowed).
    * ``normal(mean: Tensor, std: Tensor | float)`` / ``normal(mean: float, std: Tensor)``:
      shape = the broadcast of the tensor shapes; dtype theirs. Global tensors (one
      placement, any SBP): they are made whole (B) and torch's draw is replayed, so the
      value equals torch's on one process. Output SBP: ``sbp`` if given, else per mesh
      axis a split carried by an input of the output's size along that dim, else B. The
      gradient w.r.t. mean/std is torch's (zeros: torch does not reparameterise).

    Raises:
        ValueError: ``std < 0``, P requested, ``size`` missing for float mean and std.
        TypeError: ``size`` with tensor mean/std, local and global tensors mixed.
    """
    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if not tensors:
        if size is None:
            raise TypeError("normal(mean: float, std: float) needs size=, e.g. "
                            "sbpflow.normal(0.0, 1.0, (4, 5))")
        mean, std = _scalar("normal", "mean", mean), _scalar("normal", "std", std)
        if std < 0:
            raise ValueError(f"normal: std must be >= 0, got {std}")
        shape = _shape_arg(tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,))
        pl, nd = _resolve(placement, sbp, len(shape))
        if pl is None:
            return Tensor(torch.normal(mean, std, shape, generator=generator, dtype=dtype,
                                       device=device, requires_grad=requires_grad))
        _no_partial("normal", nd)
        local = _rng.draw_shard(
            lambda s, g: torch.normal(mean, std, s, generator=g, dtype=dtype,
                                      device=pl.device), shape, pl, nd, generator)
        return _leaf(local, pl, nd, shape, requires_grad)
    if size is not None:
        raise TypeError("normal: size= applies to float mean and std only; with a tensor mean "
                        "or std the shape is their broadcast shape")
    for what, v in (("mean", mean), ("std", std)):
        if not isinstance(v, Tensor):
            v = _scalar("normal", what, v)
            if what == "std" and v < 0:
                raise ValueError(f"normal: std must be >= 0, got {v}")
    pl = _common_placement("normal", tensors, placement)
    if pl is None:
        args = [t.to_torch() if isinstance(t, Tensor) else t for t in (mean, std)]
        return Tensor(torch.normal(*args, generator=generator))
    out_shape = tuple(torch.broadcast_shapes(*(tuple(t.shape) for t in tensors)))
    out_nd = _out_sbp("normal", pl, out_shape, tensors, sbp)

    def stand_in(i, shape, dev):
        return torch.zeros(shape, dtype=tensors[0].dtype, device=dev) if i == 0 else \
            torch.ones(shape, dtype=tensors[0].dtype, device=dev)

    local = _sample("normal", torch.normal, [mean, std], out_shape, pl, out_nd, generator,
                    stand_in, tensors[0].dtype)
    return Tensor(local, pl, out_nd, out_shape)


def bernoulli(input: Tensor, p=None, *, generator=None, sbp=None) -> Tensor:  # noqa: A002
    """``torch.bernoulli``: 0/1 samples; ``p=None``: ``input`` holds the probabilities
    (``torch.bernoulli(input)``), else each element is 1 with probability ``p`` and
    ``input`` gives only the shape and dtype (``torch.bernoulli(input, p)``). Also
    the method ``x.bernoulli(p=None)``.

    Shape and dtype of ``input``. Global input (any layout, P included): the output is
    laid out as ``input`` with P read as B, or ``sbp`` if given; the probabilities are made
    whole (B) and torch's draw replayed, so the value equals torch's on one process.

    Raises:
        ValueError: ``p`` outside [0, 1], P requested. TypeError: a non-Tensor input.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"bernoulli takes an sbpflow.Tensor, got {type(input).__name__}")
    if p is not None:
        p = _scalar("bernoulli", "p", p)
        if not 0 <= p <= 1:
            raise ValueError(f"bernoulli: p must be in [0, 1], got {p}")
    if input.is_local:
        if sbp is not None:
            raise ValueError("bernoulli: sbp= applies to global inputs")
        t = input.to_torch()
        return Tensor(torch.bernoulli(t, generator=generator) if p is None else
                      torch.bernoulli(t, p, generator=generator))
    pl, shape = input.placement, tuple(input.shape)
    out_nd = normalize_nd_sbp(sbp, pl.ndim, len(shape)) if sbp is not None else _p_as_b(input.sbp)
    _no_partial("bernoulli", out_nd)
    if p is not None:  # only the shape matters: torch draws empty_like(input).bernoulli_(p)
        local = _rng.draw_shard(
            lambda s, g: torch.empty(s, dtype=input.dtype, device=pl.device).bernoulli_(
                p, generator=g), shape, pl, out_nd, generator)
        return Tensor(local, pl, out_nd, shape)
    local = _sample("bernoulli", torch.bernoulli, [input], shape, pl, out_nd, generator,
                    lambda i, s, dev: torch.zeros(s, dtype=input.dtype, device=dev), input.dtype)
    return Tensor(local, pl, out_nd, shape)


def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *,  # noqa: A002
                generator=None, sbp=None) -> Tensor:
    """``torch.multinomial``: ``num_samples`` category indices (int64) per row of the
    (unnormalised, non-negative) probabilities ``input`` of shape ``(k,)`` or ``(n, k)``;
    output ``(num_samples,)`` or ``(n, num_samples)``. Also the method
    ``x.multinomial(num_samples, replacement=False)``.

    Global input (any layout): output SBP ``sbp`` if given, else S(0) on mesh axes that
    split the rows, B elsewhere. The probabilities are made whole (B) and torch's draw
    replayed: the value equals torch's on one process. Per-shard mode: each rank draws
    the rows it holds (all samples), keyed by its row range.

    Raises:
        ValueError: input not 1-D or 2-D, ``num_samples < 1``, ``num_samples`` greater
            than the number of categories without replacement, P requested.
        TypeError: non-int ``num_samples``.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"multinomial takes an sbpflow.Tensor, got {type(input).__name__}")
    if input.ndim not in (1, 2):
        raise ValueError(f"multinomial: probabilities must be 1-D (k,) or 2-D (n, k), got "
                         f"shape {tuple(input.shape)}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral):
        raise TypeError(f"multinomial: num_samples must be an int, got {num_samples!r}")
    if num_samples < 1:
        raise ValueError(f"multinomial: num_samples must be positive, got {num_samples}")
    k = input.shape[-1]
    if not replacement and num_samples > k:
        raise ValueError(f"multinomial: cannot draw {num_samples} samples without replacement "
                         f"from {k} categories; pass replacement=True or at most {k} samples")
    if input.is_local:
        if sbp is not None:
            raise ValueError("multinomial: sbp= applies to global inputs")
        return Tensor(torch.multinomial(input.to_torch(), num_samples, replacement,
                                        generator=generator))
    pl = input.placement
    out_shape = (*input.shape[:-1], int(num_samples))
    if sbp is not None:
        out_nd = normalize_nd_sbp(sbp, pl.ndim, len(out_shape))
        _no_partial("multinomial", out_nd)
    else:
        out_nd = tuple(split(0) if input.ndim == 2 and s.is_split() and s.dim == 0 else broadcast
                       for s in input.sbp)

    def draw(probs, generator):
        return torch.multinomial(probs, num_samples, replacement, generator=generator)

    if not _rng._per_shard_here():
        return Tensor(_sample("multinomial", draw, [input], out_shape, pl, out_nd, generator,
                              lambda i, s, dev: torch.ones(s, dtype=input.dtype, device=dev),
                              torch.int64),
                      pl, out_nd, out_shape)
    # Per-shard: draw the rows this rank holds (all samples), then keep its columns.
    row_nd = tuple(s if s.is_split() and s.dim == 0 and input.ndim == 2 else broadcast
                   for s in out_nd)
    rows = pl.shard_slices(out_shape, row_nd)
    probs = input.to_global(pl, row_nd if input.ndim == 2 else (broadcast,) * pl.ndim)._local
    g = _rng.region_generator(out_shape, rows, pl.device, generator)
    if pl.coord() is None:
        return Tensor(torch.empty(pl.shard_shape(out_shape, out_nd), dtype=torch.int64,
                                  device=pl.device), pl, out_nd, out_shape)
    drawn = draw(probs, g)
    rel = tuple(slice(r.start - d.start, r.stop - d.start)
                for r, d in zip(pl.shard_slices(out_shape, out_nd), rows))
    return Tensor(drawn[rel].contiguous(), pl, out_nd, out_shape)


def _bernoulli_method(self: Tensor, p=None, *, generator=None) -> Tensor:
    """``x.bernoulli(p=None)``: see :func:`bernoulli`."""
    return bernoulli(self, p, generator=generator)


def _multinomial_method(self: Tensor, num_samples: int, replacement: bool = False, *,
                        generator=None) -> Tensor:
    """``x.multinomial(num_samples, replacement=False)``: see :func:`multinomial`."""
    return multinomial(self, num_samples, replacement, generator=generator)


# ---------------------------------------------------------------- from other tensors and data

def _new(kind: str):
    def method(self, *args, dtype=None, device=None, requires_grad=False, **kw):
        dtype = dtype or self.dtype
        if self.is_local:
            fn = getattr(self._local, kind)
            out = fn(*args, dtype=dtype, device=device or self._local.device, **kw)
            return Tensor(out.requires_grad_(requires_grad))
        # Global: the same placement, replicated (torch: same dtype and device).
        whole = getattr(torch.empty(0, dtype=dtype), kind)(*args, dtype=dtype, **kw)
        return tensor(whole, placement=self.placement,
                      sbp=(broadcast,) * self.placement.ndim, requires_grad=requires_grad)

    method.__name__ = kind
    method.__doc__ = (f"``torch.Tensor.{kind}``: same dtype (and for a global tensor, the same "
                      f"placement, laid out B).")
    return method


def from_numpy(a: np.ndarray) -> Tensor:
    """``torch.from_numpy``: a local tensor sharing the array's memory."""
    return Tensor(torch.from_numpy(a))


def as_tensor(data, dtype=None, device=None) -> Tensor:
    """``torch.as_tensor``: an sbpflow tensor is returned as is (cast if ``dtype``)."""
    if isinstance(data, Tensor):
        return data if dtype is None or dtype == data.dtype else data.to(dtype)
    return Tensor(torch.as_tensor(data, dtype=dtype, device=device))


def is_tensor(obj) -> bool:
    """True for sbpflow tensors (local or global)."""
    return isinstance(obj, Tensor)


def _tri_indices(name: str):
    fn = getattr(torch, name)

    def creator(row: int, col: int, offset: int = 0, *, dtype=torch.int64, device=None,
                layout=torch.strided, placement=None, sbp=None) -> Tensor:
        whole = fn(row, col, offset, dtype=dtype)
        return _deterministic(name, tuple(whole.shape), dtype, device, False, placement, sbp,
                              lambda region, local_shape, dev: whole[region].to(dev))

    creator.__name__ = name
    creator.__doc__ = (f"``torch.{name}(row, col, offset)``: the ``(2, N)`` int64 coordinates "
                       f"of the {'lower' if name.startswith('tril') else 'upper'} triangle of "
                       f"a ``row x col`` matrix. With ``placement``/``sbp`` each rank keeps its "
                       f"shard (computed locally, no communication; ``P``: coordinate 0 holds "
                       f"the values).")
    return creator


tril_indices = _tri_indices("tril_indices")


triu_indices = _tri_indices("triu_indices")


# ---------------------------------------------------------------- Tensor methods and functions
for _name in ("new_zeros", "new_ones", "new_full", "new_empty"):
    method(_name)(_new(_name))
function("from_numpy")(from_numpy)
function("as_tensor")(as_tensor)
function("is_tensor")(is_tensor)
function("tril_indices")(tril_indices)
function("triu_indices")(triu_indices)

method("bernoulli")(_bernoulli_method)
method("multinomial")(_multinomial_method)
