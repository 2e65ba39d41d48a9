"""What a checkpoint of ``fullshard train`` records beside its tensors, read without loading them: the
training arguments, the update count and the training data's tokenizer (``checkpoint_utils.save``
writes them into a checkpoint directory's extra state; ``fullshard consolidate`` copies the arguments
and the tokenizer into a ``.safetensors`` header). ``trained_model`` (eval-lm, generate) and
``options`` (--finetune-from-model) read them here."""
from __future__ import annotations

import json
import os
from typing import Optional

from safetensors import safe_open


def read(path: str) -> tuple[Optional[dict], Optional[int], Optional[str]]:
    """(training arguments, num_updates, the training data's tokenizer record) of a checkpoint
    directory or consolidated file, each None when absent (a ``.pt`` records nothing).

    Raises:
        CheckpointError, OSError, ValueError: an unreadable checkpoint or header.
    """
    if os.path.isdir(path):
        # Lazy for start-up speed (torch.distributed.checkpoint: about 0.7 s of every `fullshard` command).
        from fullshard.checkpoint import read_extra

        extra = read_extra(path) or {}
        return extra.get("args"), extra.get("train_state", {}).get("num_updates"), extra.get("tokenizer")
    if path.endswith(".safetensors"):
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        return (json.loads(meta["fullshard.args"]) if "fullshard.args" in meta else None), None, \
            meta.get("fullshard.tokenizer")
    return None, None, None


def nf4_problem(path: str, saved: Optional[dict], worlds: Optional[list]) -> Optional[str]:
    """Why the checkpoint directory ``path``, whose recorded ``saved`` arguments may say ``--quantize-base
    nf4`` (QLoRA), cannot be read at the world sizes ``worlds`` (None: into one file, as ``fullshard
    consolidate`` writes); None when it can. torch.distributed.checkpoint cuts the rows each rank saved of the
    frozen NF4 base to the rows a loading rank holds, and torchao's ``NF4Tensor`` cannot be cut at other rows
    (nor read back as a plain tensor), so such a checkpoint loads at the world size it was saved at only."""
    quantized = (saved or {}).get("quantize_base") or "none"
    if quantized == "none":
        return None
    from fullshard.checkpoint import read_extra  # lazy: start-up speed (see `read`)

    saved_world = (read_extra(path) or {}).get("world_size")
    if worlds is not None and set(worlds) == {saved_world}:
        return None
    head = (f"{path} is a QLoRA checkpoint (--quantize-base {quantized}) saved by {saved_world} ranks; its "
            "quantized base")
    if worlds is None:
        return (f"{head} cannot be written into one file; export the adapter instead (`fullshard train ... "
                "--save-hf DIR` at the end of a run, or fullshard.adapters.save_adapter)")
    return (f"{head} loads at that world size only, not at {' or '.join(map(str, worlds))} ranks: use "
            f"--nproc-per-node {saved_world}")
