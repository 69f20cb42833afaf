"""Casts: ``to``, ``float``, ``int``, ``type``, ``type_as``, ``cpu`` ... and the ``dtype=``
argument of reductions (:func:`cast`). One registered op, ``cast``.

Casts keep the layout. A P tensor cast to a floating or complex dtype stays P (each
summand is rounded to the target dtype, so the value is within that dtype's rounding of
the one-process cast); an integer cast to another integer dtype stays P (wrap-around
commutes with the sum). A cast of a P tensor from a floating dtype to an integer dtype,
or to bool, would truncate each summand and give wrong numbers: those P mesh axes are
boxed to B first (an all-reduce), so the result is B there. The device of a global
tensor comes from its placement.
"""

from __future__ import annotations

import torch

from ..boxing.steps import HALF
from ..sbp import Split, broadcast, partial_sum
from ..tensor import Tensor
from .algorithms import unpartial
from .api import method
from .args import want_tensor
from .dispatch import dispatch
from .registry import register
from .rules import elementwise

S, B, P = Split, broadcast, partial_sum


def keeps_partial(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast ``src -> dst`` of every summand gives the summands of the cast sum."""
    if dst.is_floating_point or dst.is_complex:
        return True
    if dst == torch.bool:
        return False
    return not (src.is_floating_point or src.is_complex)


def _cast_rule(metas, attrs):
    sigs = elementwise()(metas, attrs)
    if keeps_partial(metas[0].dtype, attrs["dtype"]):
        sigs.append((P, P))
    return sigs


register("cast", _cast_rule)(lambda a, *, dtype: a.to(dtype, copy=True))


# --------------------------------------------------------------- casts
def cast(x: Tensor, dtype: torch.dtype | None, copy: bool = False) -> Tensor:
    """``x`` converted to ``dtype``: ``x`` itself when ``dtype`` is None or already its dtype
    (unless ``copy``); what ``to(dtype)`` and the ``dtype=`` argument of reductions do.
    Keeps every split and B; keeps P between floating dtypes and between integer dtypes
    (see the module doc), boxes P to B before a cast that would truncate summands.

    Raises:
        TypeError: ``dtype`` is not a torch.dtype."""
    if dtype is None:
        return x
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {dtype!r}")
    if dtype == x.dtype and not copy:
        return x
    if x.is_local:
        return Tensor(x._local.to(dtype, copy=copy))
    if not keeps_partial(x.dtype, dtype):
        x = unpartial(x)  # truncating each summand is not truncating the sum
    return dispatch("cast", x, dtype=dtype)


def in_float32(x: Tensor, compute) -> Tensor:
    """``compute(x)`` with torch's accumulation for half types: a global fp16/bf16 ``x``
    is cast to float32, ``compute`` runs on it (its sums across ranks in float32), the
    mesh axes where the result is P are all-reduced in float32, and the result is cast
    back to ``x``'s dtype once (torch's CPU and CUDA kernels of ``vector_norm``, ``var``,
    ``std`` and ``batch_norm`` accumulate half inputs in float and round the result once;
    in fp16 the squares of |x| > 256 overflow, and a two-pass variance with the mean
    rounded to fp16 is off by up to a rounding of the mean squared). Other dtypes and local
    tensors: ``compute(x)``. Layout: ``compute``'s, with its P axes made B for half
    inputs (a P result cast to a half dtype would round, or overflow, each summand)."""
    if x.is_local or x.dtype not in HALF:
        return compute(x)
    return cast(unpartial(compute(cast(x, torch.float32))), x.dtype)


def _to(self, *args, dtype=None, device=None, copy: bool = False, non_blocking: bool = False,
        memory_format=None):
    """``torch.Tensor.to``: ``to(dtype)``, ``to(device)``, ``to(device, dtype)``,
    ``to(other)`` (its dtype and device), keywords ``dtype=``, ``device=``, ``copy=``.
    Returns ``self`` when nothing changes (unless ``copy=True``), as torch does.

    Global tensors keep their layout (see the module doc for P and integer dtypes); their
    device is their placement's, so a device of another type raises ValueError naming the
    fix (``x.to_global(placement=sbpflow.placement('cuda', ranks), ...)``).

    OneFlow's ``x.to(sbpflow.Tensor)``: ``x`` as a plain tensor (a Parameter's values,
    same storage, layout and autograd identity); ``x`` itself when it is one.
    """
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], Tensor):
        if type(self) is args[0]:
            return self
        return Tensor(self._local, self._placement, self._sbp, self._shape)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (Tensor, torch.Tensor)):
            dtype, device = a.dtype, a.device
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            device = a
        else:
            raise TypeError(f"to(): unexpected argument {a!r}; pass a dtype, a device or a "
                            f"tensor")
    if self.is_local:
        kw = {"copy": copy, "non_blocking": non_blocking}
        if memory_format is not None:
            kw["memory_format"] = memory_format
        out = self._local.to(device=device, dtype=dtype, **kw)
        return self if out is self._local else Tensor(out)
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != self.device.type:
            raise ValueError(
                f"to({str(dev)!r}): a global tensor lives on its placement {self.placement!r}; "
                f"move it with x.to_global(placement=sbpflow.placement({dev.type!r}, ranks), "
                f"sbp=x.sbp)")
    return cast(self, self.dtype if dtype is None else dtype, copy)


def _caster(name: str, dtype: torch.dtype):
    def method(self):
        return cast(self, dtype)

    method.__name__ = name
    method.__doc__ = (f"``x.{name}()`` is ``x.to({dtype})`` (layout kept; a P tensor cast to "
                      f"an integer or bool dtype is boxed to B first).")
    return method


def _type(self, dtype=None, non_blocking: bool = False):
    """``torch.Tensor.type``: without arguments the type string (``'torch.FloatTensor'``,
    of the local shard); with a dtype or a type string, the cast (``to``)."""
    if dtype is None:
        return self._local.type()
    if isinstance(dtype, str):
        obj = torch
        try:
            for part in dtype.split(".")[1:]:
                obj = getattr(obj, part)
            dtype = obj.dtype
        except AttributeError:
            raise ValueError(f"type(): invalid type {dtype!r}") from None
    return cast(self, dtype)


def _type_as(self, other):
    """``x.type_as(other)`` is ``x.to(other.dtype)``."""
    return cast(self, want_tensor("type_as", "other", other).dtype)


def _cpu(self):
    """A local tensor on the CPU (``torch.Tensor.cpu``); a global tensor on a CPU
    placement is returned as is (move global tensors with ``to_global(placement=...)``)."""
    if self.is_local:
        return Tensor(self._local.cpu())
    if self.placement.type != "cpu":
        raise ValueError(f"cpu() of a global tensor on {self.placement!r}: move it with "
                         f"x.to_global(placement=sbpflow.placement('cpu', ranks), sbp=...)")
    return self


# ---------------------------------------------------------------- Tensor methods
for _name, _dtype in (("bfloat16", torch.bfloat16), ("bool", torch.bool),
                      ("byte", torch.uint8), ("char", torch.int8), ("short", torch.int16),
                      ("cfloat", torch.complex64), ("cdouble", torch.complex128),
                      ("chalf", torch.complex32),
                      ("double", torch.float64), ("float", torch.float32),
                      ("half", torch.float16), ("int", torch.int32), ("long", torch.int64)):
    method(_name)(_caster(_name, _dtype))
method("to")(_to)
method("type")(_type)
method("type_as")(_type_as)
method("cpu")(_cpu)

