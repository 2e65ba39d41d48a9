"""The checkpoint of a `fullshard train --hf-model DIR` run, read offline for ``eval-lm`` and ``generate``.

Such a checkpoint holds the trained weights under the names of the ``transformers`` model (with
``--lora-rank``: of the ``peft.PeftModel``, frozen base and adapters alike), and the run's flags in its
``extra``. The model's structure is not in it: it is rebuilt as the run built it, from ``DIR/config.json``
and the recorded --lora-* / --base-dtype / --quantize-base flags (`hf_model.load_meta`), and the text goes
through ``DIR/tokenizer.json``. So DIR must still be where the run read it; the recorded path is the one the
run was given (a relative one is read from the current directory).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch.nn as nn

from fullshard.data.errors import DataError
from fullshard.data.tokenizer import HFTokenizer
from fullshard.train import hf_model, options
from fullshard.train.config import TrainConfig


def base_dir(saved: Optional[Mapping]) -> Optional[str]:
    """The ``--hf-model`` directory a run's recorded arguments name, or None (a fullshard GPT run)."""
    return (saved or {}).get("hf_model") or None


def run_config(saved: Mapping) -> TrainConfig:
    """The `TrainConfig` a --hf-model run recorded (its flags as `fullshard train` resolved them).

    Raises:
        HFModelError: the record lacks a field that has no default (a damaged record).
    """
    try:
        return TrainConfig.from_saved(saved)
    except TypeError as e:
        raise hf_model.HFModelError(f"the checkpoint's recorded arguments are incomplete ({e})") from None


def describe(path: str, saved: Mapping, shapes: Mapping[str, tuple], arch: Optional[str],
             overrides: Optional[Mapping[str, Optional[int]]]) -> tuple[str, int, Optional[int]]:
    """Check that the run's --hf-model directory still builds the model ``path`` holds.

    Args:
        path: the checkpoint directory or consolidated file.
        saved: its recorded training arguments (``hf_model`` set).
        shapes: ``{name: shape}`` of its model tensors.
        arch, overrides: the command's --arch and --decoder-* flags (they do not apply: must be None).
    Returns:
        ``(model_type, vocabulary size V, positions P or None)`` of ``DIR/config.json``.
    Raises:
        HFModelError: --arch / --decoder-* given, DIR gone or unusable (see `hf_model.read_config`), or
            a model whose tensor names or shapes differ from the checkpoint's (DIR replaced).
    """
    hf_dir = base_dir(saved)
    given = ["--arch"] * (arch is not None) + [f"--{k.replace('_', '-')}" for k in options.ARCH_OVERRIDES
                                               if (overrides or {}).get(k) is not None]
    if given:
        raise hf_model.HFModelError(f"{given[0]} does not apply to checkpoint {path!r}: it is a fine-tune of the "
                                    f"Hugging Face model {hf_dir!r}, rebuilt from its config.json; drop {given[0]}")
    if not os.path.isdir(hf_dir):
        raise hf_model.HFModelError(f"checkpoint {path!r} is a fine-tune of the Hugging Face model {hf_dir!r}, "
                                    f"which is not a directory{_relative(hf_dir)}; its config.json and "
                                    "tokenizer.json are needed: put that directory back there")
    try:
        config = hf_model.read_config(hf_dir)
        model = hf_model.load_meta(run_config(saved))[0]  # on meta: no weights read
    except hf_model.HFModelError as e:
        raise hf_model.HFModelError(f"checkpoint {path!r}: {e}") from None
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if set(want) != set(shapes) or any(want[n] != shapes[n] for n in shapes):
        raise hf_model.HFModelError(f"checkpoint {path!r} does not fit the model that {hf_dir!r} and the run's "
                                    "--lora-* flags build (tensor names or shapes differ); was that directory "
                                    "replaced? Restore the one the run fine-tuned")
    return config.model_type, int(config.vocab_size), hf_model.max_positions(config)


def _relative(hf_dir: str) -> str:
    return f" (a relative path, read from {os.getcwd()!r})" if not os.path.isabs(hf_dir) else ""


def load_plain_model(path: str, saved: Mapping, load_weights) -> nn.Module:
    """The trained model of a --hf-model run's checkpoint as a plain module in eval mode, on the CPU,
    offline (no process group): the run's model (LoRA-wrapped with --lora-rank, the base in
    --base-dtype) with the checkpoint's weights.

    Args:
        path: the checkpoint directory or consolidated file.
        saved: its recorded training arguments.
        load_weights: ``fn(path, model)`` that loads the checkpoint into the module.
    Returns:
        A ``transformers`` causal LM or a ``peft.PeftModel``; ``model(ids)`` with (1, T) int64 ids gives
        an output whose ``.logits`` are (1, T, V).
    Raises:
        HFModelError: a --quantize-base nf4 run (its NF4 base loads only sharded, through the trainer).
    """
    cfg = run_config(saved)
    if cfg.quantize_base != "none":
        raise hf_model.HFModelError(f"checkpoint {path!r} has a --quantize-base {cfg.quantize_base} base, which "
                                    "generate cannot load yet; load the run's Hugging Face export with transformers "
                                    "(docs/finetuning.md, Export), or evaluate with eval-lm")
    model = hf_model.load_meta(cfg)[0]
    buffers = hf_model.buffers_of(model)  # real already (rotary inv_freq); to_empty would lose their values
    model.to_empty(device="cpu")
    hf_model.restore_buffers(buffers)
    model.tie_weights()  # to_empty gives each tied slot its own Parameter
    load_weights(path, model)
    return model.eval()


def load_tokenizer(hf_dir: str) -> HFTokenizer:
    """The tokenizer of the --hf-model directory (its ``tokenizer.json``).

    Raises:
        HFModelError: no tokenizer.json, or no end-of-sequence token.
    """
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        raise hf_model.HFModelError(f"the Hugging Face model {hf_dir!r} the checkpoint fine-tunes has no "
                                    "tokenizer.json; save its tokenizer there (AutoTokenizer.from_pretrained(...)"
                                    ".save_pretrained(DIR)) to generate")
    try:
        return HFTokenizer(hf_dir)
    except DataError as e:
        raise hf_model.HFModelError(str(e)) from None

