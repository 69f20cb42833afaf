"""Where a parameter's sparse gradients come from: set by the module that makes them
(``nn.PartialFC``), read by the optimizers that refuse sparse gradients (``Adam``,
``AdamW``) for an error that names the origin and the fix. Kept while the parameter
lives (a weak reference; sbpflow Tensors take no new attributes)."""

from __future__ import annotations

import weakref

_SOURCES: dict[int, tuple] = {}  # id(param) -> (weakref, origin, dense_fix)


def note_sparse_grad(param, origin: str, dense_fix: str) -> None:
    """Record that ``param``'s gradients are sparse because of ``origin`` (e.g.
    ``"nn.PartialFC (...)"``) and that ``dense_fix`` gives dense ones."""
    key = id(param)
    _SOURCES[key] = (weakref.ref(param, lambda _, k=key: _SOURCES.pop(k, None)), origin,
                     dense_fix)


def sparse_grad_source(param) -> tuple[str, str] | None:
    """``(origin, dense_fix)`` recorded for ``param``, or None."""
    entry = _SOURCES.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1], entry[2]
