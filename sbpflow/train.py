"""(placeholder: `sbpflow train`, issue 5)."""

from __future__ import annotations


def main(argv: list[str], prog: str = "sbpflow train") -> int:
    raise SystemExit(f"{prog}: not built yet (issue 5)")
