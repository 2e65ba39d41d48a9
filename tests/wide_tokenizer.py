"""A Hugging Face tokenizer with more ids than uint16 holds (like Llama 3's 128,256 or Qwen2's 151,646),
built here with `tokenizers` (no download), for the unit and end-to-end tests of uint32 token files."""
from __future__ import annotations

import json
from pathlib import Path

WIDE_VOCAB = 70_000
"""Ids of the tokenizer: more than 65,536, so preprocess writes uint32."""
EOS = "</s>"


def word(i: int) -> str:
    """The word whose id is ``i`` (2 <= i < WIDE_VOCAB; 0 is ``<unk>``, 1 is ``</s>``)."""
    return f"w{i}"


def save_wide_tokenizer(path: Path) -> Path:
    """Writes ``tokenizer.json`` (a whitespace-split word-level vocabulary of :data:`WIDE_VOCAB` ids) and
    ``tokenizer_config.json`` (``eos_token`` ``</s>``, id 1) into ``path``; returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, EOS: 1, **{word(i): i for i in range(2, WIDE_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return path
