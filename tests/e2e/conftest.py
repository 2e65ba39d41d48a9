"""Shared fixtures of the end-to-end CLI tests: a CLI runner and a tiny preprocessed corpus."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.common import run_cli


@pytest.fixture(scope="session")
def cli():
    """The `fullshard` command as a function: cli('train', DATA, ...) -> CompletedProcess."""
    return run_cli


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """First 150 documents of the built-in corpus, preprocessed (10% held out as valid)."""
    from fullshard.data import builtin_corpus_documents

    root = tmp_path_factory.mktemp("corpus")
    text = root / "corpus.txt"
    text.write_text("\n\n".join(d.strip() for d in builtin_corpus_documents()[:150]) + "\n")
    dest = root / "data"
    proc = run_cli("preprocess", "--trainpref", str(text), "--destdir", str(dest), "--valid-fraction", "0.1")
    assert proc.returncode == 0, proc.stderr
    assert (dest / "meta.json").is_file()
    return dest
