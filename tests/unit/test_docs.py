"""Cheap checks of README.md and docs/ that need no mkdocs (`make docs` runs
the strict build): the README's size and figures, relative links and their
anchors, included benchmark files, and the docs hooks' own logic."""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
README_MAX_BYTES = 8192

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
SNIPPET = re.compile(r"^-{1,}8<-{1,}\s+\"([^\"]+)\"\s*$", re.MULTILINE)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", os.path.join(DOCS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pages() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code (where links are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """The anchor of a heading as mkdocs' toc extension (and GitHub, for plain headings) makes it."""
    text = heading.replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {_slug(h) for _, h in HEADING.findall(FENCE.sub("", f.read()))}


def _links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prose = _prose(f.read())
    return LINK.findall(prose) + REF_DEF.findall(prose)


def test_readme_is_short():
    size = os.path.getsize(README)
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail into "
                                      f"a page under docs/ and link to it")


def test_readme_states_no_figures_outside_code():
    # Measured numbers belong in docs/ next to the command that produced them; in
    # the README only pasted command output (fenced blocks) may hold numbers.
    with open(README, encoding="utf-8") as f:
        prose = _prose(f.read())
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets are paths, not figures
    prose = prose.replace("CC BY-SA 4.0", "")  # a licence's name
    figures = re.findall(r"(?<![\w-])\d[\w.,%×]*", prose)  # numbers, not names such as FSDP2 or GPT-2
    assert not figures, f"README.md states figures outside code blocks: {figures}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    base = os.path.dirname(page)
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(base, path)) if path else page
        if not os.path.exists(resolved):
            bad.append(f"{target}: no file {os.path.relpath(resolved, ROOT)}")
            continue
        if page != README and not resolved.startswith(DOCS + os.sep):
            bad.append(f"{target}: outside docs/, which the built site does not contain")
        if anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(resolved, ROOT)}")
    assert not bad, f"{os.path.relpath(page, ROOT)}: broken links: {bad}"


def test_included_files_exist():
    included = []
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            included += SNIPPET.findall(f.read())
    assert "docs/benchmarks/quick/bench.md" in included
    missing = [p for p in included if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"snippets include files that do not exist: {missing}"


def test_link_checker_finds_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading\n")
    page.write_text("[ok](other.md#a-code-heading) [gone](missing.md) [anchor](other.md#nope)\n"
                    "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n[web](https://example.com)\n")
    links = _links(str(page))
    assert links == ["other.md#a-code-heading", "missing.md", "other.md#nope", "https://example.com"]
    assert _anchors(str(tmp_path / "other.md")) == {"other", "a-code-heading"}


def test_notes_index(tmp_path):
    gen = _load("gen_notes_index")
    pkg = tmp_path / "src" / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text('"""Module.\n\n[Note: flat layouts]\nHow elements sit.\n"""\n'
                              "# see [Note: buffer\n# reuse] and [Note: flat layouts]\n")
    (pkg / "sub" / "b.py").write_text("    # [Note: buffer reuse]\n    # the pool.\nx = 1  # [Note: gone]\n")
    notes, problems = gen.collect(str(pkg), str(tmp_path))
    assert list(notes) == ["flat layouts", "buffer reuse"]
    assert (notes["flat layouts"].path, notes["flat layouts"].line) == ("src/pkg/a.py", 3)
    assert notes["flat layouts"].referenced_from == set()  # a file's mention of its own note is no reference
    assert notes["buffer reuse"].referenced_from == {"src/pkg/a.py"}  # wrapped over two comment lines
    assert problems == ["src/pkg/sub/b.py refers to [Note: gone], which no file under src defines"]
    table = gen.render(notes)
    assert "| buffer reuse | `src/pkg/sub/b.py:1` | `src/pkg/a.py` |" in table
    assert gen.undefined_in_markdown("see [Note: flat layouts], [Note: nope], `[Note: ...]`", notes) == ["nope"]
    (pkg / "c.py").write_text("[Note: flat layouts]\n")
    _, problems = gen.collect(str(pkg), str(tmp_path))
    assert any("defined twice" in p for p in problems)


def test_notes_in_source_resolve():
    gen = _load("gen_notes_index")
    notes, problems = gen.collect(os.path.join(ROOT, "src", "fullshard"), ROOT)
    assert notes, "no [Note: ...] block found under src/fullshard"
    assert not problems


def test_rst_roles_stripped():
    roles = _load("rst_roles")
    html = ("a :class:<code>ShardingStrategy</code> and :func:<code>~fullshard.bench.rank.rank_main</code>; "
            "<code>:class:</code> alone stays")
    assert roles.strip_roles(html) == ("a <code>ShardingStrategy</code> and <code>rank_main</code>; "
                                       "<code>:class:</code> alone stays")


def test_docstring_sections_separated():
    sections = _load("griffe_sections")
    text = "Save.\n\nArgs:\n    x: one.\nReturns:\n    Seconds.\nRaises:\n    E: when.\n```\nReturns:\n```"
    assert sections.separate_sections(text) == ("Save.\n\nArgs:\n    x: one.\n\nReturns:\n    Seconds.\n\n"
                                                "Raises:\n    E: when.\n```\nReturns:\n```")
    assert sections.separate_sections("Args:\n    x: one.") == "Args:\n    x: one."
