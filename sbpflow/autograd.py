"""(placeholder: sbpflow.autograd.grad and friends, issue 3)."""

from __future__ import annotations

__all__: list[str] = []
