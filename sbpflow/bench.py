"""(placeholder: `sbpflow bench`, issue 5)."""

from __future__ import annotations


def main(argv: list[str], prog: str = "sbpflow bench") -> int:
    raise SystemExit(f"{prog}: not built yet (issue 5)")
