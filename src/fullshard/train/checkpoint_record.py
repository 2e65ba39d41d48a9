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
