"""Token-block datasets over the binarized splits written by :func:`preprocess`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .binarize import META_FILE, TOKEN_DTYPES
from .errors import DataError


def read_meta(data_dir: str | Path) -> dict:
    """Reads ``data_dir/meta.json`` (see [Note: binarized layout]).

    Args:
        data_dir: A directory written by ``fullshard preprocess``.

    Returns:
        The parsed meta dict (``tokenizer``, ``vocab_size``, ``eos_id``,
        ``dtype``, ``splits``, ``source``, ...); ``dtype`` is ``"uint16"``
        where meta.json has none (data written before uint32 token files).

    Raises:
        DataError: The directory or its meta.json is missing or unreadable,
            or its ``dtype`` is not one of ``uint16``, ``uint32``.
    """
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise DataError(
            f"{path} not found; run `fullshard preprocess --destdir {data_dir} ...` first")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); rerun `fullshard preprocess`") from e
    if not isinstance(meta, dict) or "splits" not in meta:
        raise DataError(f"{path} lacks 'splits'; rerun `fullshard preprocess`")
    meta.setdefault("dtype", TOKEN_DTYPES[0])
    if meta["dtype"] not in TOKEN_DTYPES:
        raise DataError(f"{path} records token dtype {meta['dtype']!r}, not one of {', '.join(TOKEN_DTYPES)}; "
                        "rerun `fullshard preprocess`")
    return meta


class TokenBlockDataset(torch.utils.data.Dataset):
    """Contiguous, non-overlapping blocks of a binarized split, for LM training.

    Item ``i`` reads tokens ``[i*T, i*T + T + 1)`` (blocks of T+1 tokens at
    stride T, so consecutive blocks share one boundary token) and returns
    ``(input, target)`` with ``target[j] == input[j + 1]`` in the stream.
    Blocks cross document boundaries (``<|endoftext|>`` separates documents),
    like fairseq's ``--sample-break-mode none``. The file is memory-mapped
    lazily, so the dataset pickles cheaply into DataLoader workers.

    Args:
        data_dir: Directory written by ``fullshard preprocess``.
        split: ``"train"``, ``"valid"`` or ``"test"``.
        tokens_per_sample: Block length T in tokens.

    Raises:
        DataError: Missing directory/meta/split file, an unknown token dtype,
            a file whose size is not a multiple of the dtype's item size or
            does not match meta.json, or fewer than ``tokens_per_sample + 1`` tokens.
        ValueError: ``tokens_per_sample < 1``.
    """

    def __init__(self, data_dir: str | Path, split: str, tokens_per_sample: int) -> None:
        if tokens_per_sample < 1:
            raise ValueError(f"tokens_per_sample must be >= 1, got {tokens_per_sample}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.tokens_per_sample = tokens_per_sample
        meta = read_meta(self.data_dir)
        self.tokenizer: str | None = meta.get("tokenizer")  # checkpoints record it (generate, eval-lm, resume)
        info = meta["splits"].get(split)
        if info is None:
            raise DataError(f"{self.data_dir} has no split {split!r} (has: "
                            f"{', '.join(meta['splits'])}); run `fullshard preprocess` with it")
        self.path = self.data_dir / info["file"]
        self.dtype = np.dtype(meta["dtype"])
        self.num_tokens = int(info["num_tokens"])
        expected_bytes = self.num_tokens * self.dtype.itemsize
        size = self.path.stat().st_size if self.path.is_file() else None
        if size is not None and size % self.dtype.itemsize:
            raise DataError(f"{self.path} holds {size:,} bytes, not a whole number of {self.dtype.name} token ids "
                            f"(meta.json's dtype); rerun `fullshard preprocess`")
        if size != expected_bytes:
            raise DataError(f"{self.path} is missing or does not match meta.json; "
                            f"rerun `fullshard preprocess`")
        if self.num_tokens < tokens_per_sample + 1:
            raise DataError(f"split {split!r} in {self.data_dir} has {self.num_tokens} tokens, "
                            f"fewer than tokens_per_sample + 1 = {tokens_per_sample + 1}; "
                            f"use more text or a smaller --tokens-per-sample")
        self._data: np.ndarray | None = None

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.tokens_per_sample

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(input, target)``, both int64 tensors of shape (T,).

        Raises:
            IndexError: ``index`` out of range.
        """
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"block {index} out of range for {n} blocks")
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.tokens_per_sample
        block = torch.from_numpy(
            self._data[start:start + self.tokens_per_sample + 1].astype(np.int64))
        return block[:-1], block[1:]

    def __getstate__(self) -> dict:
        # A memmap would pickle as a full in-memory copy; reopen in the worker.
        state = self.__dict__.copy()
        state["_data"] = None
        return state
