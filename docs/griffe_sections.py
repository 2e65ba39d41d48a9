"""griffe extension for the API reference: Google sections without a blank line above.

The source writes Google-style sections directly under the text before them
(``Returns:`` right after the last ``Args:`` item), as Napoleon accepts. griffe's
Google parser only starts a section after a blank line and otherwise renders
``Returns: ... Raises: ...`` as one run-on paragraph. This inserts the blank
line when the docstrings are loaded, so the source keeps its style.
"""
from __future__ import annotations

import re

try:
    import griffe
except ImportError:  # an optional dependency (the docs extras): tests/unit/test_docs.py runs without it
    griffe = None

SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|"
                     r"Raises|Exceptions|Returns|Yields|Receives|Examples|Attributes|Warns|Warnings|"
                     r"Methods|Functions|Classes|Modules):\s*$")


def separate_sections(text: str) -> str:
    """``text`` with a blank line before every section header line that follows a non-blank line."""
    out: list[str] = []
    in_fence = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and SECTION.match(line) and out and out[-1].strip():
            out.append("")
        out.append(line)
    return "\n".join(out)


if griffe is not None:
    class SeparateSections(griffe.Extension):
        """Applies :func:`separate_sections` to every docstring griffe loads."""

        def on_object(self, *, obj, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = separate_sections(obj.docstring.value)
