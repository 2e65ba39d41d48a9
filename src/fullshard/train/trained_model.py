"""What a trained model is, read offline from its checkpoint: architecture,
sizes and training arguments, for ``eval-lm`` and ``generate``.

A CHECKPOINT is a directory written by ``fullshard train`` /
:func:`fullshard.checkpoint.save` (``checkpoint_last``, ...) or a file written
by ``fullshard consolidate`` (``.safetensors`` or ``.pt``). The vocabulary and
position-table sizes come from the tensors' shapes; the architecture from the
run's saved arguments (a checkpoint directory's ``extra``, or the
``.safetensors`` header that ``consolidate`` writes) or from ``--arch``; so
does the shape: the arch's, with the run's recorded ``--decoder-*`` overrides
(explicit ``--decoder-*`` flags win; an explicit ``--arch`` other than the
recorded one drops the recorded overrides).

A `fullshard train --hf-model DIR` run's checkpoint is read through ``hf_trained.py``: the model is the
one DIR and the run's recorded LoRA flags build, and --arch / --decoder-* do not apply.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from safetensors import safe_open

from fullshard.models import ARCHS, ArchSpec, build_model
from fullshard.train import checkpoint_record, hf_model, hf_trained, options
from fullshard.train.checkpoint_utils import load_weights


class ModelSpecError(ValueError):
    """A CHECKPOINT that names no usable GPT; the message is one line saying what to do."""


def add_model_args(p: argparse.ArgumentParser, group: bool = True) -> None:
    """Register `fullshard train`'s --arch and --decoder-* flags on ``p`` for a command that reads the
    model from a checkpoint: both default to what the checkpoint records."""
    options.add_model_args(p, dict(default=None, help="architecture (default: the one the checkpoint records)"),
                           group=group)


@dataclass(frozen=True)
class ModelSpec:
    """The model a checkpoint holds."""

    path: str
    """The checkpoint directory or consolidated file."""
    arch: str
    """A key of ``fullshard.models.ARCHS`` (a --hf-model run: its config's ``model_type``)."""
    vocab_size: int
    """Token ids V (rows of ``embed_tokens.weight``)."""
    max_positions: int
    """Positions P (rows of ``embed_positions.weight``), tokens."""
    args: Optional[dict]
    """The training run's arguments (``TrainConfig.to_dict()``), or None."""
    num_updates: Optional[int]
    """Updates the checkpoint was trained for, or None when unknown."""
    shape: Optional[ArchSpec] = None
    """The model's shape: ``arch`` with the --decoder-* overrides; None means ``ARCHS[arch]``."""
    hf_model: Optional[str] = None
    """The Hugging Face directory a `fullshard train --hf-model` run fine-tuned (None: a fullshard GPT)."""
    tokenizer: Optional[str] = None
    """The training data's tokenizer record (meta.json's ``tokenizer``: ``"gpt2-bpe"`` or
    ``"hf:<name>:<digest>"``); None for a checkpoint written before it was recorded."""


def _shapes(path: str) -> dict:
    """{name: shape} of the model tensors of a checkpoint directory or consolidated file."""
    if os.path.isdir(path):
        # Lazy for start-up speed (torch.distributed.checkpoint: about 0.7 s of every `fullshard` command).
        from fullshard.checkpoint.consolidate import model_tensors

        return {n: tuple(s) for n, s, _ in model_tensors(path)[1]}
    if path.endswith(".safetensors"):
        with safe_open(path, "pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {n: tuple(t.shape) for n, t in sd.items()}


def read_spec(path: str, arch: Optional[str] = None,
              overrides: Optional[Mapping[str, Optional[int]]] = None) -> ModelSpec:
    """Read what model ``path`` holds; ``arch`` and ``overrides`` override the saved ones.

    Args:
        path: a checkpoint directory or consolidated ``.safetensors`` / ``.pt`` file.
        arch: the architecture, or None for the recorded one.
        overrides: ``{"decoder_layers": L, ...}`` (keys of ``options.ARCH_OVERRIDES``; None = not
            given, other keys ignored), replacing the recorded shape's values.

    Raises:
        ModelSpecError: a missing, damaged or foreign checkpoint, an unknown
            arch, no arch known (a ``.pt`` file without ``--arch``), an invalid
            ``--decoder-*`` value, or a shape whose tensors differ from the checkpoint's.
    """
    from fullshard.checkpoint import CheckpointError  # lazy for start-up speed, as above

    if not os.path.exists(path):
        raise ModelSpecError(f"checkpoint {path!r} does not exist; give a checkpoint directory "
                             "(e.g. checkpoints/checkpoint_last) or a consolidated .safetensors/.pt file")
    if not os.path.isdir(path) and not path.endswith((".safetensors", ".pt")):
        raise ModelSpecError(f"checkpoint {path!r} is neither a directory nor a .safetensors/.pt file")
    try:
        shapes = _shapes(path)
        args, num_updates, tokenizer = checkpoint_record.read(path)
    except (CheckpointError, OSError, RuntimeError, ValueError) as e:
        raise ModelSpecError(f"cannot read checkpoint {path!r}: {str(e).splitlines()[0]}") from None
    if hf_trained.base_dir(args):
        try:
            model_type, vocab, positions = hf_trained.describe(path, args, shapes, arch, overrides)
        except hf_model.HFModelError as e:
            raise ModelSpecError(str(e)) from None
        return ModelSpec(path, model_type, vocab, positions or int(args["tokens_per_sample"]), args, num_updates,
                         hf_model=hf_trained.base_dir(args), tokenizer=tokenizer)
    if "embed_tokens.weight" not in shapes or "embed_positions.weight" not in shapes:
        raise ModelSpecError(f"checkpoint {path!r} holds no fullshard GPT (no embed_tokens.weight / "
                             "embed_positions.weight)")
    saved = args or {}
    arch = arch or saved.get("arch")
    if arch is None:
        raise ModelSpecError(f"checkpoint {path!r} does not record its architecture; pass --arch")
    # The recorded shape belongs to the recorded arch; explicit --decoder-* flags override it.
    try:
        recorded = options.resolve_arch(arch, saved if arch == saved.get("arch") else {})
    except ValueError as e:
        raise ModelSpecError(f"checkpoint {path!r} records an invalid shape: {e}") from None
    try:
        shape = options.resolve_arch(arch, overrides or {}, recorded,
                                     "the checkpoint" if recorded != ARCHS[arch] else None)
    except ValueError as e:
        raise ModelSpecError(str(e)) from None
    vocab, positions = shapes["embed_tokens.weight"][0], shapes["embed_positions.weight"][0]
    want = {n: tuple(t.shape) for n, t in build_model(shape, vocab, positions, device="meta").state_dict().items()}
    if want != shapes:
        raise ModelSpecError(f"checkpoint {path!r} is not a {arch} model ({shape.describe()}; its tensor names or "
                             "shapes differ); pass the --arch and --decoder-* flags it was trained with")
    return ModelSpec(path, arch, vocab, positions, args, num_updates, shape, tokenizer=tokenizer)


def load_plain_model(spec: ModelSpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The checkpoint's GPT as a plain module in eval mode, offline (no process group); for a --hf-model
    run, its ``transformers`` / ``peft`` model on the CPU (`hf_trained.load_plain_model`).

    Raises:
        ModelSpecError: the weights cannot be loaded (damaged checkpoint), or a --hf-model model that
            cannot be built offline (a --quantize-base nf4 run).
    """
    from fullshard.checkpoint import CheckpointError  # lazy for start-up speed, as above

    try:
        if spec.hf_model:
            return hf_trained.load_plain_model(spec.path, spec.args, load_weights)
        model = build_model(spec.shape or spec.arch, spec.vocab_size, spec.max_positions, device="meta")
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives each slot its own Parameter
        load_weights(spec.path, model)
    except hf_model.HFModelError as e:
        raise ModelSpecError(str(e)) from None
    except (CheckpointError, RuntimeError) as e:
        raise ModelSpecError(f"cannot load checkpoint {spec.path!r}: {str(e).splitlines()[0]}") from None
    return model.eval()
