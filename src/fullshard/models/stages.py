"""A GPT cut into pipeline stages that keep the plain model's parameter names.

[Note: pipeline stages]
Stage ``s`` of a split ``[n_0, ..., n_{S-1}]`` (layers per stage, in order)
holds blocks ``sum(n_<s) .. sum(n_<=s) - 1`` in a ``ModuleDict`` keyed by
their index in the whole model (``layers.3.attn...`` as in ``GPT.layers``),
the embeddings (and embedding dropout) when it is the first stage, the final
LayerNorm and the output projection when it is the last, and ``None`` in
place of what it lacks (torchtitan's way), so a stage's ``state_dict`` is the
plain model's restricted to it and checkpoints keep one format.

The output projection is tied to ``embed_tokens.weight``. The tie crosses
stages, so the last stage holds its own copy (``output_projection.weight``,
initialized to the same values: the plain model's state dict has both names
with equal values). Whoever trains the stages must keep the copy equal to
the tied weight: sum the two ends' gradients into the first stage's, step
the first stage's, copy it back (``fullshard/train/pipeline.py`` does);
that equals the tied one-process model. This module never imports the
engine.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .gpt import GPT


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible, the remainder to the middle stages (the first and
    last also hold the embeddings and the output head).

    Raises:
        ValueError: fewer layers than stages, or ``num_stages < 1``.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} pipeline stages: every stage needs "
                         "a layer; use fewer stages (--pipeline-parallel-size x --pipeline-stages-per-rank) "
                         "or more --decoder-layers")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    start = (num_stages - extra) // 2  # the middle `extra` stages take one more
    for i in range(start, start + extra):
        counts[i] += 1
    return counts


def check_split(split: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """``split`` as a list after checking it cuts ``num_layers`` into ``num_stages`` non-empty stages.

    Raises:
        ValueError: a wrong count of stages, a stage without layers, or counts not adding up.
    """
    split = [int(n) for n in split]
    if len(split) != num_stages:
        raise ValueError(f"--pipeline-split {','.join(map(str, split))} has {len(split)} stages, the run has "
                         f"{num_stages} (--pipeline-parallel-size x --pipeline-stages-per-rank); give {num_stages} "
                         "counts")
    if min(split) < 1 or sum(split) != num_layers:
        raise ValueError(f"--pipeline-split {','.join(map(str, split))} must give every stage at least one layer "
                         f"and add up to the model's {num_layers} layers (it adds up to {sum(split)})")
    return split


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`~fullshard.models.GPT` (see [Note: pipeline stages]).

    Attributes:
        embed_tokens, embed_positions: first stage only, else None.
        layers: ``ModuleDict`` of this stage's blocks keyed by their index in the whole model.
        layer_norm, output_projection: last stage only, else None (``output_projection.weight``
            is the last stage's own copy of the tied weight).
    """

    def __init__(self, model: GPT, first_layer: int, end_layer: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.embed_tokens if is_first else None
        self.embed_positions = model.embed_positions if is_first else None
        self.dropout = model.dropout if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first_layer, end_layer)})
        self.layer_norm = model.layer_norm if is_last else None
        self.output_projection = model.output_projection if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids (B, T) int64 -> hidden (B, T, C); middle stages: (B, T, C) ->
        (B, T, C); last stage: -> logits (B, T, V), in the parameters' (compute) dtype."""
        if self.embed_tokens is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.dropout(self.embed_tokens(x) + self.embed_positions(positions))
        for layer in self.layers.values():
            x = layer(x)
        if self.output_projection is not None:
            x = self.output_projection(self.layer_norm(x))
        return x


def cut_gpt(model: GPT, split: Sequence[int], stage: int) -> GPTStage:
    """Stage ``stage`` of ``model`` cut by ``split`` (layers per stage).

    Build a fresh ``model`` (on the meta device for deferred init) per stage: the stage shares its
    modules, and the last stage's ``output_projection.weight`` is then the copy of the tied weight
    that its own model's ``embed_tokens`` (not in the stage) also holds, so
    ``make_param_init_fn(model, ...)`` initializes it as ``embed_tokens.weight``.

    Args:
        model: the whole GPT.
        split: layers per stage, all stages (``check_split``).
        stage: 0-based stage index.
    Raises:
        ValueError: a split that does not cut the model (``check_split``), or ``stage`` out of range.
    """
    split = check_split(split, model.config.num_layers, len(split))
    if not 0 <= stage < len(split):
        raise ValueError(f"stage {stage} out of range for {len(split)} stages")
    start = sum(split[:stage])
    return GPTStage(model, start, start + split[stage], stage == 0, stage == len(split) - 1)


def join_stages(stages: Sequence[GPTStage], with_tied_copy: bool = True) -> nn.Module:
    """One module over the stages of one rank, for what reads a model by parameter name (optimizer,
    checkpoints): it holds the stages' own modules, so its ``named_parameters()`` are the plain
    model's names of every parameter the stages hold. It has no forward. One stage (with its copy
    of the tied weight) is returned as is.

    Args:
        stages: this rank's stages.
        with_tied_copy: keep the last stage's ``output_projection`` (False: the parameters an
            optimizer steps, the tied weight once, as ``embed_tokens.weight``).
    """
    if len(stages) == 1 and with_tied_copy:
        return stages[0]
    view = nn.Module()
    for name in ("embed_tokens", "embed_positions", "layer_norm", "output_projection"):
        held = [getattr(s, name) for s in stages if getattr(s, name) is not None]
        keep = held and (with_tied_copy or name != "output_projection")
        setattr(view, name, held[0] if keep else None)
    layers = {key: block for s in stages for key, block in s.layers.items()}
    view.layers = nn.ModuleDict({key: layers[key] for key in sorted(layers, key=int)})
    return view
