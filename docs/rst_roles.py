"""mkdocs hook: Sphinx roles in docstrings, rendered for the API reference.

The source's docstrings use reStructuredText roles (``:class:`X```,
``:func:`~pkg.mod.f```), which Markdown renders as the role's name followed by
code: ``:class:<code>X</code>``. This drops the role and, as Sphinx does for a
``~`` target, keeps only the target's last component.
"""
from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _replace(match: re.Match) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"<code>{target}</code>"


def strip_roles(html: str) -> str:
    """``html`` with every ``:role:<code>target</code>`` written as ``<code>target</code>``."""
    return ROLE.sub(_replace, html)


def on_page_content(html, page, config, files):
    """mkdocs hook: strip the roles on every page (only docstrings contain them)."""
    return strip_roles(html)
