"""Shared fixtures of the end-to-end CLI tests: a CLI runner and a tiny preprocessed corpus."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.common import corpus_documents, run_cli, save_small_tokenizer


@pytest.fixture(scope="session")
def cli():
    """The `fullshard` command as a function: cli('train', DATA, ...) -> CompletedProcess."""
    return run_cli


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of 2,048 ids trained on the corpus of ``corpus_dir`` (see
    ``common.save_small_tokenizer``)."""
    return save_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory, small_tokenizer) -> Path:
    """First 150 documents of the built-in corpus, preprocessed with ``small_tokenizer`` (10% held out
    as valid)."""
    root = tmp_path_factory.mktemp("corpus")
    text = root / "corpus.txt"
    text.write_text("\n\n".join(corpus_documents()) + "\n")
    dest = root / "data"
    proc = run_cli("preprocess", "--trainpref", str(text), "--destdir", str(dest), "--valid-fraction", "0.1",
                   "--tokenizer", str(small_tokenizer))
    assert proc.returncode == 0, proc.stderr
    assert (dest / "meta.json").is_file()
    return dest
