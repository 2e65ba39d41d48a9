"""Binarize text corpora into flat token files (like ``fairseq-preprocess --only-source``).

(Named ``binarize`` so that ``fullshard.data.preprocess`` stays the function.)

Output layout of ``destdir`` (see [Note: binarized layout]):

- ``{split}.bin``: a flat array of token ids, every document followed by the
  tokenizer's end-of-sequence id (``<|endoftext|>``, 50256, for GPT-2 BPE);
  ``uint16`` for a tokenizer of at most 65,536 ids, ``uint32`` above (Llama 3,
  Qwen2); meta.json's ``dtype`` names it (a meta.json without it: ``uint16``).
  Read it with ``np.memmap(path, dtype=meta["dtype"], mode="r")``.
- ``meta.json``: ``format_version``, ``tokenizer``, ``vocab_size``, ``eos_id``,
  ``dtype``, ``splits`` (per split: ``file``, ``num_tokens``,
  ``num_documents``), ``source`` (what was read, the valid split rule) and
  ``fingerprint`` (a SHA-256 of the inputs' contents and the options, used
  to skip identical re-runs).

[Note: binarized layout]
Files are written to temporary names in ``destdir`` and moved into place with
``os.replace``; an old ``meta.json`` is removed first and the new one moved
last, so a directory with a ``meta.json`` always has complete, matching
``.bin`` files. :class:`fullshard.data.TokenBlockDataset` relies on this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from fullshard.digest import file_sha256

from .corpus import BUILTIN_CORPUS_NAME, builtin_corpus_documents, builtin_corpus_path, read_text_documents, text_files
from .errors import DataError
from .tokenizer import GPT2Tokenizer, HFTokenizer, load_gpt2_tokenizer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")
"""The dtypes a ``{split}.bin`` may hold, narrowest first (meta.json's ``dtype``)."""
META_FILE = "meta.json"
SPLITS = ("train", "valid", "test")
_ENCODE_CHUNK_DOCS = 1024


@dataclass(frozen=True)
class PreprocessResult:
    """What :func:`preprocess` did.

    Attributes:
        meta: The contents of ``meta.json``.
        cached: True if ``destdir`` already held the output for identical
            inputs and nothing was rewritten.
    """

    meta: dict
    cached: bool


def _fingerprint(sources: dict[str, list[Path]], builtin: bool, valid_fraction: float,
                 seed: int, tokenizer_name: str) -> str:
    # Content hashes, not mtimes: copying a corpus must not invalidate the cache.
    record = {"format_version": FORMAT_VERSION, "tokenizer": tokenizer_name,
              "builtin": builtin, "valid_fraction": valid_fraction, "seed": seed,
              "sources": {split: [[p.name, file_sha256(p)] for p in files]
                          for split, files in sources.items()}}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _cached_meta(destdir: Path, fingerprint: str) -> dict | None:
    """Returns the existing meta if it was made from identical inputs and its files are intact."""
    try:
        meta = json.loads((destdir / META_FILE).read_text())
        if meta.get("fingerprint") != fingerprint:
            return None
        itemsize = np.dtype(meta["dtype"]).itemsize
        for info in meta["splits"].values():
            path = destdir / info["file"]
            if not path.is_file() or path.stat().st_size != info["num_tokens"] * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable or foreign meta.json: rebuild
    return meta


def _split_valid(docs: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Moves a seeded random ``valid_fraction`` of documents (at least one) to valid."""
    if valid_fraction == 0.0:
        return docs, []
    num_valid = max(1, round(len(docs) * valid_fraction))
    if num_valid >= len(docs):
        raise DataError(f"{len(docs)} training document(s) cannot be split with valid fraction "
                        f"{valid_fraction}; add text, pass --validpref, or --valid-fraction 0")
    valid_idx = set(np.random.default_rng(seed).permutation(len(docs))[:num_valid].tolist())
    train = [d for i, d in enumerate(docs) if i not in valid_idx]
    valid = [d for i, d in enumerate(docs) if i in valid_idx]
    return train, valid


def _encode_chunks(tokenizer: GPT2Tokenizer, docs: Sequence[str],
                   workers: int) -> Iterable[list[list[int]]]:
    for start in range(0, len(docs), _ENCODE_CHUNK_DOCS):
        chunk = docs[start:start + _ENCODE_CHUNK_DOCS]
        if workers > 1:
            yield tokenizer.encode_batch(chunk)
        else:
            yield [tokenizer.encode(d) for d in chunk]


def token_dtype(vocab_size: int) -> str:
    """The narrowest of :data:`TOKEN_DTYPES` holding ids in ``[0, vocab_size)``.

    Raises:
        DataError: ``vocab_size`` exceeds 2**32.
    """
    for name in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    raise DataError(f"a tokenizer of {vocab_size:,} ids does not fit uint32 token files")


def _write_split(path: Path, docs: Sequence[str], tokenizer: GPT2Tokenizer,
                 workers: int, dtype: str) -> int:
    """Writes ``docs`` (each + eos) as ``dtype`` ids to ``path``; returns the token count."""
    num_tokens = 0
    with open(path, "wb") as f:
        for encoded in _encode_chunks(tokenizer, docs, workers):
            flat = [t for ids in encoded for t in (*ids, tokenizer.eos_id)]
            np.asarray(flat, dtype=dtype).tofile(f)
            num_tokens += len(flat)
    return num_tokens


def _resolve_sources(trainpref, validpref, testpref, builtin) -> dict[str, list[Path]]:
    if builtin and trainpref is not None:
        raise DataError("pass either --trainpref or --builtin-corpus, not both")
    if not builtin and trainpref is None:
        raise DataError("no training text: pass --trainpref PATH or --builtin-corpus")
    sources = {"train": [builtin_corpus_path()] if builtin else text_files(trainpref)}
    for split, pref in (("valid", validpref), ("test", testpref)):
        if pref is not None:
            sources[split] = text_files(pref)
    return sources


def _load_documents(sources, trainpref, validpref, testpref, builtin, valid_fraction,
                    seed) -> dict[str, list[str]]:
    train = builtin_corpus_documents() if builtin else read_text_documents(trainpref)
    what = BUILTIN_CORPUS_NAME if builtin else str(trainpref)
    if not train:
        raise DataError(f"training corpus {what} holds no text; pass a non-empty corpus")
    docs = {"train": train}
    if validpref is None:
        docs["train"], valid = _split_valid(train, valid_fraction, seed)
        if valid:
            docs["valid"] = valid
    for split, pref in (("valid", validpref), ("test", testpref)):
        if pref is not None:
            docs[split] = read_text_documents(pref)
            if not docs[split]:
                raise DataError(f"{split} corpus {pref} holds no text; pass a non-empty corpus")
    return docs


def preprocess(destdir: str | Path, trainpref: str | Path | None = None,
               validpref: str | Path | None = None, testpref: str | Path | None = None,
               builtin: bool = False, valid_fraction: float = 0.01, seed: int = 1,
               workers: int = 1, tokenizer: str | Path | None = None) -> PreprocessResult:
    """Tokenizes corpora with GPT-2 BPE (or a Hugging Face checkpoint's tokenizer) and writes
    ``{split}.bin`` + ``meta.json``.

    Documents (see :mod:`.corpus`: blank-line-separated blocks of text files,
    or articles of the built-in corpus) are encoded and each is followed by
    ``<|endoftext|>``. Without ``validpref``, a ``valid_fraction`` of the
    training documents (at least one; a permutation by ``np.random.default_rng(seed)``)
    becomes the valid split; the rest keep their order. If ``destdir``
    already holds the output for identical inputs (same file contents and
    options), nothing is rewritten.

    Args:
        destdir: Output directory (created if missing, only once inputs are valid).
        trainpref: Text file or directory of ``*.txt`` for the train split.
        validpref: Same, for the valid split (disables the fraction split).
        testpref: Same, for the test split.
        builtin: Use the built-in Wikipedia corpus as the training text.
        valid_fraction: Fraction of training documents held out, in [0, 1).
        seed: Seed of the document-level train/valid split.
        workers: 1 encodes sequentially; more uses the tokenizers library's
            parallel Rust batch encoding (thread count: ``RAYON_NUM_THREADS``,
            default all cores). The output is identical either way.
        tokenizer: a Hugging Face checkpoint directory whose ``tokenizer.json`` encodes (see
            :class:`HFTokenizer`); None: GPT-2 BPE.

    Returns:
        :class:`PreprocessResult` with the meta dict and whether it was cached.

    Raises:
        DataError: Missing input path, empty corpus, conflicting or invalid
            options, missing tokenizer/corpus package; nothing is left behind.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid fraction must be in [0, 1), got {valid_fraction}")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    destdir = Path(destdir)
    sources = _resolve_sources(trainpref, validpref, testpref, builtin)
    tokenizer = load_gpt2_tokenizer() if tokenizer is None else HFTokenizer(tokenizer)
    fingerprint = _fingerprint(sources, builtin, valid_fraction, seed, tokenizer.name)
    cached = _cached_meta(destdir, fingerprint)
    if cached is not None:
        logger.info("%s already holds these inputs binarized; skipping", destdir)
        return PreprocessResult(meta=cached, cached=True)

    docs = _load_documents(sources, trainpref, validpref, testpref, builtin,
                           valid_fraction, seed)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": token_dtype(tokenizer.vocab_size),
        "splits": {},
        "source": {
            "train": BUILTIN_CORPUS_NAME if builtin else str(trainpref),
            "valid": str(validpref) if validpref is not None
            else f"{valid_fraction} of train documents, seed {seed}",
            **({"test": str(testpref)} if testpref is not None else {}),
            "document": "built-in article" if builtin else "blank-line-separated block",
        },
        "fingerprint": fingerprint,
    }
    _write_outputs(destdir, docs, meta, tokenizer, workers)
    return PreprocessResult(meta=meta, cached=False)


def _write_outputs(destdir: Path, docs: dict[str, list[str]], meta: dict,
                   tokenizer: GPT2Tokenizer, workers: int) -> None:
    """Writes every split and meta.json atomically (see [Note: binarized layout])."""
    created = not destdir.exists()
    destdir.mkdir(parents=True, exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    temps: list[Path] = []
    try:
        for split, split_docs in docs.items():
            tmp = destdir / f"{split}.bin{tag}"
            temps.append(tmp)
            num_tokens = _write_split(tmp, split_docs, tokenizer, workers, meta["dtype"])
            meta["splits"][split] = {"file": f"{split}.bin", "num_tokens": num_tokens,
                                     "num_documents": len(split_docs)}
        meta_tmp = destdir / f"{META_FILE}{tag}"
        temps.append(meta_tmp)
        meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
        (destdir / META_FILE).unlink(missing_ok=True)
        for split in SPLITS:
            if split in docs:
                os.replace(destdir / f"{split}.bin{tag}", destdir / f"{split}.bin")
            else:  # a stale split from an earlier run would not match meta.json
                (destdir / f"{split}.bin").unlink(missing_ok=True)
        os.replace(meta_tmp, destdir / META_FILE)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        if created and not any(destdir.iterdir()):
            destdir.rmdir()
        raise
