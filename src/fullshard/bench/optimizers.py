"""The optimizer every mode of one `fullshard bench` run steps with (``--optimizer``).

``adam`` is ``torch.optim.AdamW`` in every mode, baselines included. ``muon``, ``adafactor`` and
``lamb`` are ``fullshard.optim``'s, which read where fullshard keeps each parameter's rows
(``fullshard.core.placement.shard_info``) or take a parameter as whole when fullshard does not shard
it: they run on the fullshard modes and on ``ddp`` (whole parameters: the single-device result each
fullshard mode must match), not on torch FSDP or DeepSpeed, whose shards they cannot see, nor on the
pipeline modes (`fullshard train` refuses them with pipelining). Every
optimizer gets the job's lr and weight decay on every parameter; muon's wrapper modes place each Muon
matrix whole on one rank (``shard_placement_fn=muon_placement_fn``), as ``fullshard train
--fsdp-version 1``; its ``fully_shard`` modes keep torch.chunk rows, and every rank gathers each
matrix's update and orthogonalizes all of it.
"""
from __future__ import annotations

import torch

from fullshard import optim as fullshard_optim
from fullshard.bench.modes import MODES, Job

OPTIMIZERS = ("adam", "muon", "adafactor", "lamb")
"""``--optimizer`` choices of ``fullshard bench``."""
LABELS = {"adam": "AdamW", "muon": "Muon + AdamW", "adafactor": "Adafactor", "lamb": "LAMB"}


def runs_on(optimizer: str, mode_key: str) -> bool:
    """Whether ``mode_key`` can step with ``optimizer`` (see the module docstring)."""
    mode = MODES[mode_key]
    return optimizer == "adam" or (mode.family in ("fullshard", "ddp") and not mode.pipeline)


def placement_kwargs(job: Job, model: torch.nn.Module) -> dict:
    """Keyword arguments for the FullyShardedDataParallel wrapping of the unwrapped ``model``: muon's
    placement (``fully_shard`` keeps torch.chunk rows; Muon gathers each matrix's update there)."""
    if job.optimizer == "muon":
        return {"shard_placement_fn": fullshard_optim.muon_placement_fn(model)}
    return {}


def build(job: Job, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``job.optimizer`` over the parameters of the wrapped ``model``.

    Raises:
        ValueError: an unknown optimizer (``suite.validate`` refuses it first).
    """
    if job.optimizer == "adam":
        return torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    if job.optimizer == "muon":
        return fullshard_optim.Muon(fullshard_optim.muon_param_groups(model), lr=job.lr,
                                    weight_decay=job.weight_decay, adamw_betas=(0.9, 0.999))  # AdamW's
    if job.optimizer == "adafactor":
        return fullshard_optim.Adafactor(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    if job.optimizer == "lamb":
        return fullshard_optim.Lamb(model.parameters(), lr=job.lr, weight_decay=job.weight_decay)
    raise ValueError(f"unknown optimizer {job.optimizer!r}; one of {', '.join(OPTIMIZERS)}")
