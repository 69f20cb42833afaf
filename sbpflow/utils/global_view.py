"""``sbpflow.utils.global_view``: OneFlow's ``oneflow.utils.global_view`` (OneFlow-only API).

* :class:`global_mode` ``(enabled, placement=None, sbp=None)``: a block in which creation
  ops called without ``placement=``/``sbp=`` (``ones``, ``randn``, ``arange``, ``tensor``...)
  make global tensors on ``placement`` laid out as ``sbp``; it is
  :func:`sbpflow.default_placement` with OneFlow's arguments.
* :func:`current_global_mode`: what the innermost block set (``is_enabled``,
  ``placement``, ``sbp``).
* :func:`to_global` / :func:`to_local`: ``Tensor.to_global`` / ``Tensor.to_local`` over
  the tensors of a nested list/tuple/dict (a state dict, a batch).

Differences from OneFlow: in OneFlow ``global_mode`` also lets ``.device`` and
``.to(device)`` be used on global tensors; sbpflow allows both everywhere (``.device`` is
the local shard's device, ``.to`` of the same device type keeps the layout), so the block
only changes creation. A global tensor's ``.to_local()`` is the shard in both.

Layer: utils, a peer of ops (it uses :mod:`sbpflow.ops.creation`'s default layout).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..ops.creation import current_default_placement, default_placement
from ..placement import placement as Placement
from ..sbp import SBP, broadcast, normalize_nd_sbp
from ..tensor import Tensor

__all__ = ["current_global_mode", "global_mode", "to_global", "to_local"]


class global_mode:  # noqa: N801 - OneFlow's spelling
    """``with global_mode(True, placement=pl, sbp=sbp):`` creation ops without
    ``placement=``/``sbp=`` make global tensors on ``pl`` laid out as ``sbp`` (one SBP or
    one per mesh axis; checked against each created tensor's dims). ``global_mode(False)``
    turns it off inside an enclosing block. Blocks nest; leaving one restores the outer.

    Every rank of the world must run the same creation calls inside the block (they are
    global ops: sizes and data are the global ones, as with explicit ``placement=``).

    Raises:
        ValueError: ``enabled`` is True without both ``placement`` and ``sbp`` (OneFlow
            requires both too), or an ``sbp`` with the wrong number of mesh axes.
        TypeError: ``placement`` is not an :class:`sbpflow.placement`, or ``sbp`` is not
            an SBP or a sequence of them.
    """

    def __init__(self, enabled: bool, placement: Placement | None = None, sbp=None):
        self.enabled = bool(enabled)
        if self.enabled:
            if placement is None or sbp is None:
                raise ValueError(f"global_mode(True, ...) needs both placement= and sbp= (got "
                                 f"placement={placement!r}, sbp={sbp!r}); e.g. global_mode("
                                 f"True, placement=sbpflow.placement.all('cpu'), "
                                 f"sbp=sbpflow.sbp.broadcast)")
            if not isinstance(placement, Placement):
                raise TypeError(f"global_mode: placement must be an sbpflow.placement, got "
                                f"{placement!r}")
            normalize_nd_sbp(sbp, placement.ndim)
        self.placement = placement if self.enabled else None
        self.sbp = sbp if self.enabled else None
        self._cm = None

    def __enter__(self) -> global_mode:
        self._cm = default_placement(self.placement, self.sbp)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        cm, self._cm = self._cm, None
        cm.__exit__(*exc)


@dataclass(frozen=True)
class GlobalModeInfo:
    """What :func:`current_global_mode` returns. ``sbp`` is a tuple (one SBP per mesh
    axis, as OneFlow's); ``placement`` and ``sbp`` are None when not enabled."""

    is_enabled: bool
    placement: Placement | None
    sbp: tuple | None


def current_global_mode() -> GlobalModeInfo:
    """The innermost :class:`global_mode` (or :func:`sbpflow.default_placement`) block's
    settings: ``is_enabled``, ``placement``, ``sbp`` (a tuple; all broadcast for a
    ``default_placement`` block without sbp)."""
    cur = current_default_placement()
    if cur is None:
        return GlobalModeInfo(False, None, None)
    pl, sbp = cur
    nd = (broadcast,) * pl.ndim if sbp is None else normalize_nd_sbp(sbp, pl.ndim)
    return GlobalModeInfo(True, pl, nd)


def _map(obj, fn, warn: bool, what: str):
    if isinstance(obj, Tensor):
        return fn(obj)
    if obj is None:
        return None
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn, warn, what)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_map(v, fn, warn, what) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn, warn, what) for v in obj)
    if warn:
        warnings.warn(f"{what}: leaf {type(obj).__name__} is not a tensor; it is returned "
                      f"as is", stacklevel=3)
    return obj


def to_global(input, placement: Placement | None = None, sbp=None, *,  # noqa: A002
              warn_on_non_tensor_leaf: bool = True, **kwargs):
    """``Tensor.to_global(placement, sbp, **kwargs)`` on every tensor of ``input`` (a
    tensor, or a nested list/tuple/dict of them: a state dict, a batch); other leaves are
    returned as they are (with a warning unless ``warn_on_non_tensor_leaf=False``; None
    silently). ``sbp`` may be a callable ``sbp(tensor) -> SBP`` choosing per tensor.
    Local tensors need both ``placement`` and ``sbp`` (their rules are
    :meth:`sbpflow.Tensor.to_global`'s); global ones need at least one. Collective.

    Raises:
        ValueError: no placement and no sbp, or what ``Tensor.to_global`` raises.
    """
    if placement is None and sbp is None:
        raise ValueError("to_global: give placement= and/or sbp= (both for local tensors)")

    def one(t: Tensor) -> Tensor:
        want = sbp(t) if callable(sbp) and not isinstance(sbp, SBP) else sbp
        return t.to_global(placement, want, **kwargs)

    return _map(input, one, warn_on_non_tensor_leaf, "to_global")


def to_local(input, *, copy: bool = False):  # noqa: A002
    """``Tensor.to_local()`` (this rank's shard, no communication) on every tensor of
    ``input`` (a tensor, or a nested list/tuple/dict of them); ``copy=True`` clones each
    shard. Local tensors pass through (cloned with ``copy``)."""

    def one(t: Tensor) -> Tensor:
        loc = t.to_local()
        return loc.clone() if copy else loc

    return _map(input, one, False, "to_local")
