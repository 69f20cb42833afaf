"""sbpflow.Tensor: one local torch.Tensor, plus placement and nd-SBP when global.

A *local* tensor is an ordinary single-process tensor. A *global* tensor has a
placement (a device mesh), an nd-SBP (one SBP per mesh axis) and a global shape; the
wrapped torch tensor is this rank's shard (see :func:`sbpflow.placement.shard_slices`).
``Tensor`` is not a subclass of ``torch.Tensor``; autograd runs on the local tensors.

Layer (ARCHITECTURE "The layers"): this module holds the class and imports only the
layers below it (sbp, placement, distributed, boxing: ``to_global`` wraps what
:mod:`sbpflow.boxing.convert` returns). Members that belong to a higher layer are not
imported from it; **each upper layer installs what it owns into the class, once, from
``sbpflow/__init__.py``**, which is the one place to look:

* ``autograd/`` (:func:`sbpflow.autograd.install`): ``backward``, ``grad``, ``grad_sbp``,
  ``set_grad_sbp``, ``requires_grad_``, ``retain_grad``, ``retains_grad``,
  ``register_hook`` (leaf-gradient layouts and backward seeding,
  :mod:`sbpflow.autograd.leaf`);
* ``ops/`` (:func:`sbpflow.ops.api.install`, run when ``sbpflow.ops`` is imported):
  operators and the op methods (``x + y``, ``x.sum()``, ``x[i]``...) generated from the
  op families' declarations, and the class-level hook :attr:`Tensor._torch_function`
  that :meth:`Tensor.__torch_function__` calls (:func:`sbpflow.ops.api.torch_function`).

Gradients (ARCHITECTURE "Autograd: the dual rule"): the gradient of a tensor laid out
as ``sbp`` arrives laid out as ``dual(sbp)`` (S->S, B->P, P->B); see
:mod:`sbpflow.autograd.leaf`.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Sequence

import numpy as np
import torch

from .boxing import gather_whole, global_to_global, local_to_global
from .distributed._state import _state as _dstate
from .placement import placement as Placement
from .sbp import SBP, broadcast, format_nd_sbp, normalize_nd_sbp

__all__ = ["Tensor", "from_torch"]



_PKG = os.path.dirname(os.path.abspath(__file__))
# sbpflow's value-reading machinery; the first frame outside it is the reading line
_MACHINERY = tuple(os.path.join(_PKG, p) for p in ("tensor.py", "ops", "boxing", "distributed",
                                                    "autograd"))


def _caller_site() -> str:
    """``file:line`` (base name) of the code that asked for a value."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_MACHINERY):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class Tensor:
    """A local or global tensor. Build with :func:`sbpflow.tensor`, :func:`zeros`, ... or
    :meth:`to_global`.

    ``Tensor(local_torch_tensor, placement, sbp, shape)`` (positional) wraps a shard and is
    internal. The legacy constructor of ``torch.Tensor`` / ``oneflow.Tensor`` works too
    (see :func:`_legacy_init`): ``Tensor(2, 3)`` or ``Tensor(torch.Size([2, 3]))`` is an
    uninitialised float32 tensor of that shape, ``Tensor([[1, 2], [3, 4]])`` (a sequence
    or numpy array) a float32 copy of the data, ``Tensor()`` an empty ``(0,)`` one;
    keywords ``device=``, and OneFlow's ``placement=``/``sbp=`` for a global one.

    Attributes:
        shape: the *global* shape (``torch.Size``); the local shard's is ``to_local().shape``.
        dtype, device: of the local shard. placement, sbp: ``None`` for a local tensor;
        ``sbp`` is always a tuple (one SBP per mesh axis).
    """

    __slots__ = ("_local", "_placement", "_sbp", "_shape", "__weakref__")

    # ``dispatch(func, args, kwargs)`` of the layer that routes torch functions called with
    # sbpflow tensors; set by :func:`sbpflow.ops.api.install` (see the module docstring).
    _torch_function = None

    def __init__(self, local: torch.Tensor = None, placement: Placement | None = None,
                 sbp: tuple[SBP, ...] | None = None, shape: Sequence[int] | None = None,
                 /, *more, **kwargs):
        if more or kwargs or not isinstance(local, torch.Tensor):
            # torch's / OneFlow's legacy constructor: Tensor(2, 3), Tensor([1, 2]), ...
            _legacy_init(self, (local, placement, sbp, shape, *more), kwargs)
            return
        self._local = local
        self._placement = placement
        self._sbp = tuple(sbp) if sbp is not None else None
        self._shape = torch.Size(shape) if shape is not None else local.shape

    # ------------------------------------------------------------------ metadata
    @property
    def is_global(self) -> bool:
        return self._placement is not None

    @property
    def is_local(self) -> bool:
        return self._placement is None

    @property
    def placement(self) -> Placement | None:
        return self._placement

    @property
    def sbp(self) -> tuple[SBP, ...] | None:
        return self._sbp

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        """A local tensor's device. A global tensor's (OneFlow's): this rank's device in
        the placement, with its index: the CUDA device its shard lives on, or on CPU the
        rank's local index (``LOCAL_RANK``; torch treats every ``cpu:i`` as the CPU)."""
        d = self._local.device
        if self._placement is None or d.index is not None:
            return d
        return torch.device(d.type, _dstate.local_rank)

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    @property
    def is_leaf(self) -> bool:
        return self._local.is_leaf

    @property
    def grad_fn(self):
        return self._local.grad_fn


    def detach_(self) -> Tensor:
        """Detach in place (``torch.Tensor.detach_``): this tensor becomes a leaf that does
        not require grad; layout unchanged. Raises torch's RuntimeError on views."""
        self._local.detach_()
        return self

    def detach(self) -> Tensor:
        return Tensor(self._local.detach(), self._placement, self._sbp, self._shape)

    @property
    def data(self) -> Tensor:
        """``torch.Tensor.data``: this tensor's values without autograd history, sharing
        its storage and layout (placement, SBP, shape). An in-place update through it
        (the classic loop's ``p.data.add_(p.grad, alpha=-lr)``) changes this tensor and
        is not recorded by autograd; on a global tensor it runs as the op's SBP rule
        says (``p.data.mul_(2)`` on a partial-sum tensor scales each rank's summand)."""
        return Tensor(self._local.data, self._placement, self._sbp, self._shape)

    @data.setter
    def data(self, value: Tensor) -> None:
        """``p.data = t``: this tensor now holds ``t``'s values (sharing ``t``'s storage,
        any shape) and keeps its autograd identity, as in torch.

        Raises:
            TypeError: ``value`` is not an sbpflow tensor.
            ValueError: ``value`` is local where this tensor is global or the other way
                round, or has another placement or SBP (the message names both and the
                ``to_global`` that converts it).
        """
        if not isinstance(value, Tensor):
            raise TypeError(f".data = value: expected an sbpflow Tensor, got "
                            f"{type(value).__name__}; wrap a torch tensor with "
                            f"sbpflow.from_torch(t) (local) or sbpflow.tensor(t, placement=, "
                            f"sbp=) (global)")
        if self.is_global != value.is_global or (self.is_global and (
                self._placement != value._placement or self._sbp != value._sbp)):
            def where(t):
                return (f"global ({t._placement}, {format_nd_sbp(t._sbp)})" if t.is_global
                        else "local")
            fix = (f"value.to_global(placement=..., sbp={format_nd_sbp(self._sbp)})"
                   if self.is_global else "value.to_local()")
            raise ValueError(f".data = value: this tensor is {where(self)}, value is "
                             f"{where(value)}; give a value laid out as this tensor: {fix}")
        self._local.data = value._local
        self._shape = value._shape

    # ------------------------------------------------------------------ conversion
    def to_local(self) -> Tensor:
        """This rank's shard as a local tensor (no copy; differentiable: its gradient flows
        back as this rank's part of the gradient in the dual layout). A local tensor is
        returned as is; a rank outside the placement gets an empty tensor."""
        return Tensor(self._local) if self.is_global else self

    def to_torch(self) -> torch.Tensor:
        """The wrapped ``torch.Tensor`` of a local tensor (no copy).

        Raises ``ValueError`` on a global tensor (use ``to_local().to_torch()`` for the shard).
        """
        if self.is_global:
            raise ValueError("to_torch() is for local tensors; use x.to_local().to_torch() for "
                             "this rank's shard or x.numpy() for the whole value")
        return self._local

    def to_global(self, placement: Placement | None = None, sbp=None, *, grad_sbp=None,
                  check_meta: bool = True, size: Sequence[int] | None = None) -> Tensor:
        """Convert to a global tensor on ``placement`` laid out as ``sbp``.

        From a local tensor (every rank of the world calls this; ``placement`` and ``sbp``
        required):

        * ``S(d)``: the local tensors are the shards, uneven allowed; their shapes are
          exchanged and checked against :func:`sbpflow.placement.shard_shape`
          (``check_meta=False`` skips the exchange: give ``size=`` the global shape, or
          every shard must be equal);
        * ``B``: the value at mesh coordinate 0 of that axis is broadcast (the input is
          not overwritten); by default its gradient goes to that rank and the others'
          inputs get zeros;
        * ``P``: each local is a summand (its gradient is the full gradient).

        From a global tensor: boxing (``placement`` and ``sbp`` default to the current
        ones); differentiable, each step's backward is its dual transition.

        Args:
            grad_sbp: nd-SBP the gradient passes through on its way back. From a local
                tensor it sets what the local input receives (``B`` on a broadcast axis:
                every rank gets the whole gradient; ``P``: each rank its summand). From a
                global tensor it is a layout on the *source* placement that the gradient
                is boxed to before it is boxed to ``dual(source sbp)``: it changes the
                backward's collectives, not its values.
            check_meta: exchange and check local shapes (from local only; one small
                all-gather over the world). ``False`` skips it: the global shape is
                ``size`` or, without it, each rank's local shape times the mesh size on
                split axes (even shards assumed); a rank whose local is not its shard of
                that shape raises ``ValueError`` at once (no communication), and ranks
                that inferred different global shapes or dtypes raise
                ``CollectiveMismatchError`` at the first collective on the tensor (the
                default collective check; with ``SBPFLOW_CHECK=off`` nothing catches it).
            size: the global shape (from local only).

        Raises:
            ValueError: shapes that do not form the requested layout (names each rank's
                shape and the expected one), split dims out of range, wrong mesh rank.
            TypeError: placement or sbp of the wrong type.
        """
        if self.is_global:
            _dstate.activity = "to_global()"
            pl = _check_placement(self._placement if placement is None else placement)
            local, nd = global_to_global(self._local, self._shape, self._placement, self._sbp,
                                         pl, self._sbp if sbp is None else sbp, grad_sbp)
            return Tensor(local, pl, nd, self._shape)
        if placement is None or sbp is None:
            raise ValueError("to_global() on a local tensor needs both placement= and sbp=, e.g. "
                             "x.to_global(sbpflow.placement.all('cpu'), sbpflow.sbp.split(0))")
        pl = _check_placement(placement)
        _dstate.activity = "to_global()"
        local, nd, shape = local_to_global(self._local, pl, sbp, grad_sbp, check_meta, size)
        return Tensor(local, pl, nd, shape)

    def numpy(self) -> np.ndarray:
        """The whole value as a numpy array (a copy). Collective on a global tensor: every
        rank of the world calls it and gets the full value. Detaches."""
        return self._full("numpy()").numpy()

    def item(self):
        """The value of a one-element tensor as a Python number (collective if global)."""
        if self.numel() != 1:
            raise ValueError(f"item() needs a one-element tensor, got shape {tuple(self.shape)}")
        return self._full("item()").item()

    def tolist(self):
        """The whole value as nested lists (collective if global)."""
        return self._full("tolist()").tolist()

    def _full(self, what: str) -> torch.Tensor:
        if _dstate.tracer is not None and not _dstate.untraced:
            _dstate.tracer.value_read(what, _caller_site())  # raises: no values in a graph
        if not self.is_global:
            with torch.no_grad():
                return self._local.detach().cpu()
        # The reading line joins the collectives' fingerprints: ranks reading same-shaped
        # values on different lines (`if rank == 0: print(a.item())`, then `b.item()` on
        # every rank) would otherwise pair their reads silently.
        site = _caller_site()
        _dstate.activity = f"reading a value at {site} (item/numpy/tolist/bool/float)"
        _dstate.site = site
        try:
            return gather_whole(self._local, self._shape, self._placement, self._sbp)
        finally:
            _dstate.site = ""

    def __repr__(self) -> str:
        if not self.is_global:
            return repr(self._local).replace("tensor(", "sbpflow.tensor(", 1)
        return (f"sbpflow.Tensor(shape={tuple(self._shape)}, dtype={self.dtype}, "
                f"placement={self._placement!r}, sbp={format_nd_sbp(self._sbp)}, "
                f"local={self._local!r})")

    # ------------------------------------------------------------------ Python protocols
    __array_ufunc__ = None  # numpy defers to the reflected operators (no object arrays)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(x)``, ``np.array_equal(x, a)``, ``np.allclose(x, a)``: the whole
        value as numpy (a copy, as :meth:`numpy`; ``dtype`` converts). Collective on a
        global tensor: every rank of the world must reach the same numpy call. Detaches.

        Raises:
            ValueError: ``copy=False`` (numpy 2's "no copy"), which a global value or a
                detached copy cannot honour; drop it or use ``np.asarray(x)``.
        """
        if copy is False:
            raise ValueError("sbpflow.Tensor.__array__(copy=False): the value cannot be "
                             "exposed without a copy; call np.asarray(x) (copy=None)")
        arr = self._full("numpy.asarray() (__array__)").numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def _scalar(self, what: str):
        if self.numel() != 1:
            raise RuntimeError(f"{what} of a Tensor with {self.numel()} elements is ambiguous "
                               f"(shape {tuple(self.shape)}); reduce it first (.any(), .all(), "
                               f".sum()...)")
        # collective for a global tensor: every rank must reach it
        return self._full("bool() (an `if`/`while` on a tensor)" if what == "Boolean value"
                          else what).item()

    def __bool__(self) -> bool:
        return bool(self._scalar("Boolean value"))

    def __float__(self) -> float:
        return float(self._scalar("float()"))

    def __int__(self) -> int:
        return int(self._scalar("int()"))

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.dtype.is_complex:
            raise TypeError(f"only integer tensors of a single element can be converted to an "
                            f"index, got {self.dtype}")
        return int(self._scalar("index"))

    def __format__(self, spec: str) -> str:
        if spec and self.numel() == 1:
            return format(self.item(), spec)
        return repr(self) if not spec else object.__format__(self, spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function or ``torch.Tensor`` method called with an sbpflow tensor
        (``torch.exp(x)``, ``torch_tensor + x``, ``torch.nn.functional.softmax(x, -1)``)
        runs sbpflow's op of the same name; torch tensors among the arguments become local
        sbpflow tensors.

        Routed by the hook :attr:`_torch_function` (:func:`sbpflow.ops.api.torch_function`).

        Raises:
            TypeError: sbpflow has no op of that name (names it and the way out), or the
                hook is not installed.
        """
        if cls._torch_function is None:
            raise TypeError(f"torch's {getattr(func, '__name__', func)!s} was called with an "
                            f"sbpflow tensor before torch-function routing was installed "
                            f"(importing sbpflow installs it: sbpflow.ops.api.install)")
        return cls._torch_function(func, args, kwargs or {})

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]


# ---------------------------------------------------------------------- helpers

_LEGACY_KWARGS = ("device", "placement", "sbp")


def _legacy_init(self: Tensor, args: tuple, kwargs: dict) -> None:
    """``Tensor(*sizes)``, ``Tensor(size: torch.Size)``, ``Tensor(data)``, ``Tensor()``,
    ``Tensor(tensor)``: torch's legacy constructor (dtype float32; sizes make an
    uninitialised tensor, data is copied, a torch/sbpflow tensor is aliased), with
    ``device=`` and OneFlow's ``placement=``/``sbp=``. With ``placement``/``sbp``, sizes are
    the global shape (each rank allocates only its shard) and data is the global value
    (the value at mesh coordinate 0 wins, as :func:`sbpflow.tensor`).

    Differences: torch rejects ``placement``/``sbp`` (OneFlow-only keywords); OneFlow's
    ``Tensor(*sizes)`` fills nothing either.

    Raises:
        TypeError: an unknown keyword, mixed sizes and data, a scalar (``Tensor(2.5)``: use
            ``sbpflow.tensor(2.5)``), or ``placement`` without ``sbp`` (or the reverse).
    """
    while args and args[-1] is None:
        args = args[:-1]
    bad = sorted(set(kwargs) - set(_LEGACY_KWARGS))
    if bad:
        raise TypeError(f"Tensor(): unexpected keyword(s) {bad}; the legacy constructor takes "
                        f"sizes or data plus {list(_LEGACY_KWARGS)} (for dtype= or "
                        f"requires_grad= use sbpflow.tensor(data, ...) or sbpflow.empty(...))")
    device, pl, nd = kwargs.get("device"), kwargs.get("placement"), kwargs.get("sbp")
    if (pl is None) != (nd is None):
        raise TypeError(f"Tensor(): give both placement= and sbp= for a global tensor (got "
                        f"placement={pl!r}, sbp={nd!r})")
    if pl is not None:
        pl = _check_placement(pl)
    sizes = None
    if not args:
        sizes = (0,)
    elif len(args) == 1 and isinstance(args[0], torch.Size):
        sizes = tuple(args[0])
    elif all(isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))
             for a in args):
        sizes = tuple(int(a) for a in args)
    elif len(args) == 1 and isinstance(args[0], Tensor) and pl is None:
        src = args[0]
        self._local, self._placement, self._sbp, self._shape = (
            src._local, src._placement, src._sbp, src._shape)
        return
    elif len(args) > 1:
        raise TypeError(f"Tensor(): sizes must all be ints, got {args!r}; data goes in as one "
                        f"sequence: Tensor([[1, 2], [3, 4]])")
    if sizes is not None:
        if any(n < 0 for n in sizes):
            raise ValueError(f"Tensor(): sizes must be non-negative, got {sizes}")
        if pl is None:
            self._local, self._placement, self._sbp = torch.empty(sizes, device=device), None, None
            self._shape = self._local.shape
            return
        nd = normalize_nd_sbp(nd, pl.ndim, len(sizes))
        self._local = torch.empty(pl.shard_shape(sizes, nd), device=pl.device)
        self._placement, self._sbp, self._shape = pl, nd, torch.Size(sizes)
        return
    data = args[0]
    if isinstance(data, Tensor):
        data = data._full("Tensor(tensor)")
    if isinstance(data, (numbers.Number, np.number)) or (
            isinstance(data, (np.ndarray, torch.Tensor)) and data.ndim == 0):
        raise TypeError(f"Tensor(): data must be a sequence, got the scalar {data!r}; use "
                        f"sbpflow.tensor({data!r}) for a 0-dim tensor (sizes are ints: "
                        f"Tensor(2, 3))")
    t = torch.as_tensor(data, dtype=torch.float32).clone()
    if pl is None:
        self._local, self._placement, self._sbp = t.to(device) if device else t, None, None
        self._shape = self._local.shape
        return
    with torch.no_grad():
        b = Tensor(t.to(pl.device)).to_global(pl, (broadcast,) * pl.ndim)
        g = b.to_global(pl, normalize_nd_sbp(nd, pl.ndim, t.ndim))
    self._local, self._placement, self._sbp, self._shape = (
        g._local.detach().contiguous(), g._placement, g._sbp, g._shape)



def _as_local_torch(x) -> torch.Tensor:
    if isinstance(x, Tensor):
        return x._local
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"expected an sbpflow.Tensor or torch.Tensor, got {type(x).__name__}")


def _check_placement(pl) -> Placement:
    if not isinstance(pl, Placement):
        raise TypeError(f"placement must be an sbpflow.placement, got {pl!r}; e.g. "
                        f"sbpflow.placement('cpu', [0, 1])")
    return pl


def from_torch(t: torch.Tensor) -> Tensor:
    """Wrap a ``torch.Tensor`` as a local sbpflow tensor (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch takes a torch.Tensor, got {type(t).__name__}")
    return Tensor(t)

