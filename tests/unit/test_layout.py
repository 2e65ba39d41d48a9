"""Source layout budgets (docs/design.md, "Sizes that keep this readable"):
every module of the package stays under the hard line limit."""
from __future__ import annotations

import pathlib

MAX_LINES = 500
SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "fullshard"


def test_every_source_file_is_at_most_500_lines():
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no sources under {SRC}"
    over = {}
    for path in files:
        with path.open(encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            over[str(path.relative_to(SRC.parent))] = n
    assert not over, (f"files over {MAX_LINES} lines (split them by concept; see docs/design.md): "
                      + ", ".join(f"{p} ({n})" for p, n in sorted(over.items())))
