"""(placeholder: more creation and sampling ops with placement= and sbp=, issue 3)."""

from __future__ import annotations

__all__: list[str] = []
