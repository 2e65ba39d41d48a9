"""The index of ``[Note: ...]`` blocks in ``src/fullshard``, for docs/design.md.

A note is defined by a line that holds only ``[Note: title]`` (in a docstring,
or after ``#`` in a comment), followed by its text; any other mention of
``[Note: title]`` is a reference to it. The index is generated, never typed, so
it cannot go stale:

* as an mkdocs hook (``hooks:`` in mkdocs.yml): ``mkdocs build`` replaces the
  marker line ``<!-- notes-index -->`` in design.md with the index, and logs a
  warning (an error under ``--strict``) for a reference, in the source or in
  the docs, to a note that no file defines, and for a title defined twice;
* as a script: ``python docs/gen_notes_index.py`` prints the index.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, field

MARKER = "<!-- notes-index -->"
DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")
REFERENCE = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LOG = logging.getLogger("mkdocs.hooks.gen_notes_index")


@dataclass
class Note:
    """One note: its title, where it is defined, and the files that refer to it."""

    title: str
    path: str
    line: int
    referenced_from: set[str] = field(default_factory=set)


def _flatten(text: str) -> str:
    """The text with comment markers and line breaks removed, so that a
    reference wrapped over two lines reads as one."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def collect(src_dir: str, rel_to: str) -> tuple[dict[str, Note], list[str]]:
    """Scan every ``*.py`` file under ``src_dir``.

    Args:
        src_dir: the package directory (``src/fullshard``).
        rel_to: paths in the result are relative to this directory (the repository root).
    Returns:
        ``(notes, problems)``: notes by title, in file order; and one line per
        problem (a title defined twice, a reference no file defines).
    """
    notes: dict[str, Note] = {}
    problems: list[str] = []
    refs: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(src_dir):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, rel_to)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            defined_here = set()
            for number, line in enumerate(text.splitlines(), 1):
                match = DEFINITION.match(line)
                if match is None:
                    continue
                title = " ".join(match.group(1).split())
                defined_here.add(title)
                if title in notes:
                    problems.append(f"[Note: {title}] is defined twice: {notes[title].path}:{notes[title].line} "
                                    f"and {rel}:{number}")
                    continue
                notes[title] = Note(title, rel, number)
            for title in REFERENCE.findall(_flatten(text)):
                title = " ".join(title.split())
                if title not in defined_here:
                    refs.append((title, rel))
    for title, rel in refs:
        if title in notes:
            notes[title].referenced_from.add(rel)
        else:
            problems.append(f"{rel} refers to [Note: {title}], which no file under src defines")
    return notes, problems


def undefined_in_markdown(markdown: str, notes: dict[str, Note]) -> list[str]:
    """Titles of ``[Note: ...]`` references in ``markdown`` (outside inline code) that no note defines."""
    text = INLINE_CODE.sub("", _flatten(markdown))
    return [t for t in (" ".join(m.split()) for m in REFERENCE.findall(text)) if t not in notes]


def render(notes: dict[str, Note]) -> str:
    """The index as a Markdown table, one row per note, in file order."""
    rows = ["| note | defined in | referred to from |", "|---|---|---|"]
    for note in notes.values():
        refs = ", ".join(f"`{r}`" for r in sorted(note.referenced_from)) or "-"
        title = note.title.replace("|", "\\|")
        rows.append(f"| {title} | `{note.path}:{note.line}` | {refs} |")
    return "\n".join(rows) + "\n"


def _repo_root_of(config_file: str) -> str:
    return os.path.dirname(os.path.abspath(config_file))


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: put the index in design.md; warn about references to undefined notes."""
    root = _repo_root_of(config.config_file_path)
    notes, problems = collect(os.path.join(root, "src", "fullshard"), root)
    if page.file.src_uri == "design.md":
        if MARKER not in markdown:
            LOG.warning("design.md has no %s line for the index of notes", MARKER)
        for problem in problems:
            LOG.warning(problem)
        markdown = markdown.replace(MARKER, render(notes))
    for title in undefined_in_markdown(markdown, notes):
        LOG.warning("%s refers to [Note: %s], which no file under src defines", page.file.src_uri, title)
    return markdown


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    notes, problems = collect(os.path.join(root, "src", "fullshard"), root)
    sys.stdout.write(render(notes))
    for problem in problems:
        print(f"gen_notes_index: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
