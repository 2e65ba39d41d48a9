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


def nf4_problem(checkpoint_dir: str, worlds: Optional[list]) -> Optional[str]:
    """Why the checkpoint directory ``checkpoint_dir``, when its recorded arguments say ``--quantize-base nf4``
    (QLoRA), cannot be read at the world sizes ``worlds`` (None: into one file, as ``fullshard consolidate``
    writes); None when it can. torch.distributed.checkpoint cuts the rows each rank saved of the frozen NF4 base
    to the rows a loading rank holds, and torchao's ``NF4Tensor`` cannot be cut at other rows (nor read back as
    a plain tensor), so such a checkpoint loads at the world size it was saved at only.

    Raises:
        CheckpointError, OSError, ValueError: an unreadable checkpoint.
    """
    from fullshard.checkpoint import read_extra  # lazy: start-up speed (see `read`)
    from fullshard.checkpoint.manifest import resolve

    path = resolve(checkpoint_dir)
    extra = read_extra(path) or {}
    quantized = (extra.get("args") or {}).get("quantize_base") or "none"
    if quantized == "none":
        return None
    saved_world = extra.get("world_size")
    if worlds is not None and set(worlds) == {saved_world}:
        return None
    head = (f"{path} is a QLoRA checkpoint (--quantize-base {quantized}) saved by {saved_world} ranks; its "
            "quantized base")
    if worlds is None:
        return (f"{head} cannot be written into one file; export the adapter instead (`fullshard train ... "
                "--save-hf DIR` at the end of a run, or fullshard.adapters.save_adapter)")
    return (f"{head} loads at that world size only, not at {' or '.join(map(str, worlds))} ranks: use "
            f"--nproc-per-node {saved_world}")


FIRST_START = ("restore_file", "reset_optimizer", "reset_dataloader", "reset_lr_scheduler", "reset_meters")
"""The flags that act at a run's first start only (see :func:`resume_path`)."""


def resume_path(save_dir: str, restore_file: str, flags: dict) -> tuple[Optional[str], bool]:
    """(the checkpoint directory a run resumes, None for none; whether it is the run's own ``checkpoint_last``,
    which it resumes as it stands).

    ``--restore-file`` and ``--reset-*`` act at a run's first start: when ``<save-dir>/checkpoint_last`` was
    written by a start with the same values of those flags and the same ``--optimizer`` (``flags``: this run's
    values by field name), this run is a restart (``--max-restarts``, torchrun, or the same command run again)
    and continues it; applying them again would throw away its progress or reset it a second time. A
    ``--restore-file`` naming another checkpoint of ``save_dir`` (a rewind) is loaded whenever it is given."""
    last = os.path.join(save_dir, "checkpoint_last")
    path = restore_file
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(save_dir, path)
    rewind = os.path.dirname(os.path.abspath(path)) == os.path.abspath(save_dir) and \
        os.path.abspath(path) != os.path.abspath(last)
    if not rewind and (os.path.isdir(last) or os.path.isdir(last + ".old")):
        from fullshard.checkpoint import CheckpointError  # lazy: start-up speed (see `read`)
        from fullshard.checkpoint.manifest import resolve

        try:
            saved = read(resolve(last))[0] or {}
        except (CheckpointError, OSError, ValueError):
            saved = {}  # loading it reports what is wrong with it
        if saved and all(saved.get(k) == flags[k] for k in (*FIRST_START, "optimizer")):
            return last, any(flags[k] for k in FIRST_START[1:]) or restore_file != "checkpoint_last"
    if os.path.isdir(path) or os.path.isdir(path + ".old"):
        return path, False
    return None, False
