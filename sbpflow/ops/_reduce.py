"""(placeholder: filled by the op-library work of issue 3)."""

from __future__ import annotations

__all__: list[str] = []

# Tensor methods contributed by this module (installed by sbpflow.ops._methods.install).
METHODS: dict = {}
