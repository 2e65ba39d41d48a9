"""``fullshard consolidate CHECKPOINT_DIR OUT``: one plain state dict from a
sharded checkpoint, offline (no process group): one of ``fullshard.checkpoint.save``
(FullyShardedDataParallel or ``fully_shard``) or of ``dcp.save({"model": ...,
...})`` by torch FSDP2 / ``fully_shard`` scripts (the same format: see
save_load.py [Note: one checkpoint format]).

``.safetensors``: streamed, one tensor at a time. The header (names, dtypes,
shapes, byte offsets) comes from the DCP metadata alone, then each tensor is
read through DCP's reader (which assembles it from every rank's shards),
written and freed, so peak memory is about the largest tensor.
``.pt``: ``torch.save`` needs the whole dict, so peak memory is the model.

Either output loads with ``load_state_dict`` into the unwrapped model (the
names are the plain model's; tied weights appear under each name, equal, so
Hugging Face's ``from_pretrained`` finds every key it expects). The
``.safetensors`` header's ``__metadata__`` holds ``{"format": "pt"}`` and, for
a checkpoint of ``fullshard train``, the run's arguments as JSON under
``"fullshard.args"`` (so ``eval-lm`` / ``generate`` know the architecture) and
its data's tokenizer record under ``"fullshard.tokenizer"`` (so they can refuse
text or data of another tokenizer).
"""
from __future__ import annotations

import json
import os
import resource
import struct
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from .save_load import CheckpointError, read_extra, resolve, verify

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def model_tensors(checkpoint_dir: str) -> tuple[str, list[tuple[str, torch.Size, torch.dtype]]]:
    """(resolved path, [(name, full shape, dtype)] of the model's tensors in saved order).

    Raises:
        CheckpointError: a missing or damaged checkpoint (files named); one
            with no ``model.`` tensors (the top-level keys it has are named).
    """
    path = resolve(checkpoint_dir)
    verify(path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = []
    for key, meta in md.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            out.append((key[len("model."):], torch.Size(meta.size), meta.properties.dtype))
    if not out:
        tops = sorted({key.split(".", 1)[0] for key in md})
        raise CheckpointError(f"consolidate: checkpoint {path} holds no model tensors (no 'model.' keys; its "
                              f"top-level keys are {tops[:10]}); save it as dcp.save({{'model': "
                              "model_state_dict, ...}) or with fullshard.checkpoint.save")
    return path, out


def read_tensor(path: str, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One full tensor of the checkpoint's model (assembled from all ranks' shards)."""
    t = torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": {name: t}}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return t


def _metadata(path: str) -> dict:
    """The ``.safetensors`` ``__metadata__`` (string to string): format, the training arguments and the
    training data's tokenizer record."""
    meta = {"format": "pt"}
    extra = read_extra(path)
    if isinstance(extra, dict) and isinstance(extra.get("args"), dict):
        meta["fullshard.args"] = json.dumps(extra["args"])
    if isinstance(extra, dict) and isinstance(extra.get("tokenizer"), str):
        meta["fullshard.tokenizer"] = extra["tokenizer"]
    return meta


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def consolidate(checkpoint_dir: str, out: str) -> dict:
    """Write the checkpoint's model as one ``.safetensors`` or ``.pt`` file.

    Returns:
        ``{"tensors", "bytes", "largest_tensor_bytes", "peak_rss_bytes", "seconds"}``;
        ``peak_rss_bytes`` is the growth of the process's peak resident memory during the call.
    Raises:
        ValueError: ``out`` ends in neither ``.safetensors`` nor ``.pt``.
        CheckpointError: a missing or damaged checkpoint.
    """
    if not out.endswith((".safetensors", ".pt")):
        raise ValueError(f"consolidate: OUT must end in .safetensors or .pt, got {out!r}")
    start, rss0 = time.perf_counter(), _maxrss_bytes()
    path, tensors = model_tensors(checkpoint_dir)
    sizes = [s.numel() * torch.empty((), dtype=d).element_size() for _, s, d in tensors]
    tmp = out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".pt"):
        torch.save({n: read_tensor(path, n, s, d) for n, s, d in tensors}, tmp)
    else:
        header, offset = {"__metadata__": _metadata(path)}, 0
        for (name, shape, dtype), nbytes in zip(tensors, sizes):
            if dtype not in _ST_DTYPES:
                raise ValueError(f"consolidate: '{name}' has dtype {dtype}, which safetensors cannot hold")
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in tensors:
                t = read_tensor(path, name, shape, dtype)
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                del t
    os.replace(tmp, out)
    return dict(tensors=len(tensors), bytes=sum(sizes), largest_tensor_bytes=max(sizes, default=0),
                peak_rss_bytes=_maxrss_bytes() - rss0, seconds=time.perf_counter() - start)
