"""(placeholder: torch.nn.functional counterparts, issue 3)."""

from __future__ import annotations

from ..ops._random import dropout

__all__ = ["dropout"]
