"""The optimizer of `fullshard train` (``--optimizer``): its flags' checks, the placement it needs,
its parameter groups and the line the run header logs.

==========  =======================================================  =====================================
optimizer   built                                                    flags read
==========  =======================================================  =====================================
adam        ``torch.optim.AdamW`` (foreach under --cpu-offload)       --adam-betas --adam-eps
cpu_adam    ``torch.optim.AdamW(fused=True)`` on host shards; with    --adam-betas --adam-eps
            --cpu-offload ``fullshard.optim.OffloadAdamW`` (fused,
            each unit stepped during backward, --clip-norm its
            max_norm) where :func:`overlap_refusal` allows it
muon        ``fullshard.optim.Muon``: Muon on the 2-D weights of      --muon-* and, for the AdamW group,
            the transformer blocks, AdamW on the rest (one object,    --adam-betas --adam-eps
            ``use_muon`` groups); --fsdp-version 1 places each Muon
            matrix whole on one rank (``muon_placement_fn``);
            fully_shard's rows stay torch.chunk's, every rank
            gathers the update and orthogonalizes the whole matrix
adafactor   ``fullshard.optim.Adafactor`` (torch.optim.Adafactor's)  --adafactor-*
lamb        ``fullshard.optim.Lamb``                                  --lamb-*
==========  =======================================================  =====================================

Every optimizer gets ``--lr`` and ``--weight-decay`` (decoupled, on parameters whose full shape has
>= 2 dimensions; biases and norms get none). Groups are chosen by original parameter names and
full shapes, so the same groups, in the same order, come out under c10d and both fsdp versions:
their checkpoints load into each other.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from fullshard import optim as fullshard_optim
from fullshard.construct import clean_name

_DDP_PREFIX = "module."  # DistributedDataParallel holds the model as its submodule `module`

# The flags that only one kind of optimizer reads; given with another --optimizer they would do
# nothing, so `check_flags` refuses a non-default value (a silently ignored flag is a wrong run).
FAMILY_FLAGS = {
    "adam": ("adam_betas", "adam_eps"),
    "muon": ("muon_momentum", "muon_nesterov", "muon_ns_coefficients", "muon_eps", "muon_ns_steps",
             "muon_adjust_lr_fn"),
    "adafactor": ("adafactor_beta2_decay", "adafactor_eps", "adafactor_d"),
    "lamb": ("lamb_betas", "lamb_eps"),
}
FAMILIES_OF = {"adam": ("adam",), "cpu_adam": ("adam",), "muon": ("muon", "adam"), "adafactor": ("adafactor",),
               "lamb": ("lamb",)}
"""``--optimizer`` -> the flag families it reads (muon's AdamW group reads the adam flags)."""


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_flags(args, defaults: Dict[str, object]) -> Optional[str]:
    """The first problem with the optimizer flags of parsed ``fullshard train`` arguments, as one
    line, or None. ``defaults``: ``{field: default}`` of the flags (to tell a given value).

    Checks the ranges torch's constructors check (so no rank fails with a traceback) and that no
    flag of another optimizer was given a value.
    """
    used = FAMILIES_OF[args.optimizer]
    if args.world_size_invariant and args.optimizer in ("adafactor", "lamb"):
        return (f"--world-size-invariant with --optimizer {args.optimizer}: its per-tensor sums (norms"
                f"{', column means' if args.optimizer == 'adafactor' else ''}) are added over the ranks holding each "
                "tensor's rows, in an order that depends on the world size; drop --world-size-invariant or use "
                "--optimizer adam or muon")
    for family, names in FAMILY_FLAGS.items():
        for name in names:
            if family not in used and getattr(args, name) != defaults[name]:
                return (f"{_option(name)} is a flag of --optimizer {family}{' and muon' if family == 'adam' else ''}, "
                        f"this run has --optimizer {args.optimizer}; drop it or pick that optimizer")
    for name in ("adam_betas", "lamb_betas"):
        if not all(0.0 <= b < 1.0 for b in getattr(args, name)):
            return f"{_option(name)} must be two numbers in [0, 1), got {getattr(args, name)}"
    for name in ("adam_eps", "lamb_eps", "muon_eps", "muon_momentum"):
        if not getattr(args, name) >= 0:
            return f"{_option(name)} must be >= 0, got {getattr(args, name)}"
    if not 1 <= args.muon_ns_steps < 100:
        return f"--muon-ns-steps must be in [1, 100), got {args.muon_ns_steps}"
    if not args.adafactor_beta2_decay <= 0:
        return f"--adafactor-beta2-decay must be <= 0 (the decay is 1 - t^c), got {args.adafactor_beta2_decay}"
    eps1, eps2 = args.adafactor_eps
    if (eps1 is not None and not eps1 >= 0) or not eps2 >= 0:
        return f"--adafactor-eps must be (None or >= 0, >= 0), got {args.adafactor_eps}"
    if not args.adafactor_d >= 1:
        return f"--adafactor-d must be >= 1 (an update RMS clipping threshold), got {args.adafactor_d}"
    return None


def muon_recipe(cfg) -> dict:
    """Keyword arguments of ``muon_param_groups`` / ``muon_placement_fn`` that give Muon the same
    matrices as on the whole GPT (every block's 2-D weight). Under --pipeline-parallel-size a stage
    is a part of the model, whose last ``nn.Linear`` is a block's weight (or the last stage's copy
    of the tied weight), not the head the recipe's ``head_adamw`` means: name the tied output
    projection instead, so each stage's Muon matrices are the whole model's of that stage."""
    if cfg.pipeline_parallel_size > 1:
        return {"exclude": ("output_projection.weight",), "head_adamw": False}
    return {}


def overlap_refusal(cfg) -> Optional[str]:
    """Why this run's ``--optimizer cpu_adam --cpu-offload`` steps after backward with
    ``torch.optim.AdamW(fused=True)`` rather than unit by unit during it
    (``fullshard.optim.OffloadAdamW``, the same bits), as a phrase for the run header; None when
    it overlaps. Only combinations OffloadAdamW cannot do, or that its tests do not cover, fall back."""
    if cfg.fp16:
        return "--fp16 (the loss scaler's inf check must come before any step)"
    if cfg.pipeline_parallel_size > 1:
        return "--pipeline-parallel-size (the stages are not one root module)"
    if cfg.update_freq > 1 and cfg.accumulate_mode != "no_sync":
        return (f"--accumulate-mode {cfg.accumulate_mode} (every micro-batch reduces, so a step taken during "
                "one backward would be put back by the next)")
    if cfg.hf_model:
        return "--hf-model (frozen base weights: not covered by OffloadAdamW's tests)"
    if cfg.world_size_invariant:
        return "--world-size-invariant (not covered by OffloadAdamW's tests)"
    return None


def overlaps(cfg, host_shards: bool) -> bool:
    """The run builds ``fullshard.optim.OffloadAdamW`` (see :func:`overlap_refusal`)."""
    return (cfg.optimizer == "cpu_adam" and cfg.cpu_offload and host_shards and cfg.ddp_backend == "fully_sharded"
            and overlap_refusal(cfg) is None)


def placement_fn(cfg, model: torch.nn.Module) -> Optional[Callable]:
    """The ``shard_placement_fn`` the wrapper (``--fsdp-version 1``) takes for the optimizer on the
    unwrapped ``model`` (called before sharding it), or None: muon keeps each Muon matrix whole on one
    rank (``Owned``), so only its owner runs Newton-Schulz on it."""
    if cfg.optimizer == "muon":
        return fullshard_optim.muon_placement_fn(model, **muon_recipe(cfg))
    return None


def original_name(name: str, known: Dict[str, torch.Size], ddp: bool = False) -> str:
    """Map a wrapped model's parameter name to the unwrapped model's name.

    Args:
        name: a name from the wrapped model's ``named_parameters()``.
        known: the unwrapped model's ``{name: shape}``.
        ddp: the wrapper is DistributedDataParallel: its names are the model's behind exactly one
            leading ``module.`` (only that first segment is dropped; a submodule of the model
            called ``module`` keeps its name). Else fullshard's wrapper segments are dropped
            wherever they are (`fullshard.construct.clean_name`).

    Raises:
        KeyError: the name matches no parameter of the unwrapped model.
    """
    inner = name
    if ddp:
        inner = name[len(_DDP_PREFIX):] if name.startswith(_DDP_PREFIX) else None
    original = clean_name(inner) if inner is not None else None
    if original not in known:
        raise KeyError(f"parameter {name!r} of the wrapped model matches no parameter of the model")
    return original


def _names(model: torch.nn.Module, shapes: Dict[str, torch.Size]) -> Dict[int, str]:
    """id(parameter of the wrapped ``model``) -> its original name (a tied parameter once)."""
    ddp = isinstance(model, DistributedDataParallel)
    return {id(p): original_name(name, shapes, ddp) for name, p in model.named_parameters()}


def split_decay(params, names: Dict[int, str], shapes: Dict[str, torch.Size], weight_decay: float,
                **extra) -> List[dict]:
    """``params`` as two groups: full shape >= 2-D with ``weight_decay``, the rest with 0 (both with
    ``extra``); an empty group is kept, so every rank and backend has the same groups."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if len(shapes[names[id(p)]]) >= 2]
    no_decay = [p for p in params if len(shapes[names[id(p)]]) < 2]
    return [{"params": decay, "weight_decay": weight_decay, **extra},
            {"params": no_decay, "weight_decay": 0.0, **extra}]


def param_groups(model: torch.nn.Module, shapes: Dict[str, torch.Size], weight_decay: float) -> List[dict]:
    """Two groups of the wrapped ``model``'s trained parameters chosen by ORIGINAL name: >=2-D
    weights decay; biases / norms don't (adam, cpu_adam, adafactor, lamb).

    Args:
        model: the wrapped model (FullyShardedDataParallel, whose parameters are shards, a
            ``fully_shard`` model, whose parameters are DTensors, or DistributedDataParallel).
        shapes: the unwrapped model's ``{name: full shape}``.
        weight_decay: decoupled weight decay of the first group.
    """
    return split_decay(model.parameters(), _names(model, shapes), shapes, weight_decay)


def build(cfg, model: torch.nn.Module, shapes: Dict[str, torch.Size], host_shards: bool) -> torch.optim.Optimizer:
    """The optimizer of ``model`` (wrapped: FullyShardedDataParallel, a ``fully_shard`` model or
    DistributedDataParallel) as ``cfg.optimizer`` says (see the module docstring).

    Args:
        cfg: the run's TrainConfig.
        model: the wrapped model.
        shapes: the unwrapped model's ``{original name: full shape}``.
        host_shards: the shards the optimizer steps on are in host memory (CPU, --cpu-offload).
    Raises:
        ValueError: an unknown ``cfg.optimizer`` (`options.validate` refuses it first).
    """
    if cfg.optimizer in ("adam", "cpu_adam"):
        # --cpu-offload: foreach batches the per-parameter Adam math into a few multi-tensor kernels.
        # --optimizer cpu_adam (fairseq's DeepSpeed CPU Adam): torch's fused CPU AdamW kernel.
        kernel = {"foreach": True} if cfg.cpu_offload else {}
        if cfg.optimizer == "cpu_adam" and host_shards:
            kernel = {"fused": True}
        groups = param_groups(model, shapes, cfg.weight_decay)
        if overlaps(cfg, host_shards):  # --clip-norm 0 only measures the norm (trainer._clip's inf)
            return fullshard_optim.OffloadAdamW(model, params=groups, lr=cfg.lr, betas=cfg.adam_betas,
                                                eps=cfg.adam_eps, max_norm=cfg.clip_norm or float("inf"))
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, **kernel)
    if cfg.optimizer == "muon":
        names, groups = _names(model, shapes), []
        for group in fullshard_optim.muon_param_groups(model, **muon_recipe(cfg)):
            params = group.pop("params")
            if group.get("use_muon"):  # 2-D matrices: all decay
                groups.append({"params": list(params), "weight_decay": cfg.weight_decay, **group})
            else:
                groups += split_decay(params, names, shapes, cfg.weight_decay, **group)
        return fullshard_optim.Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                    nesterov=cfg.muon_nesterov, ns_coefficients=cfg.muon_ns_coefficients,
                                    eps=cfg.muon_eps, ns_steps=cfg.muon_ns_steps,
                                    adjust_lr_fn=cfg.muon_adjust_lr_fn, adamw_betas=cfg.adam_betas,
                                    adamw_eps=cfg.adam_eps)
    groups = param_groups(model, shapes, cfg.weight_decay)
    if cfg.optimizer == "adafactor":
        return fullshard_optim.Adafactor(groups, lr=cfg.lr, beta2_decay=cfg.adafactor_beta2_decay,
                                         eps=cfg.adafactor_eps, d=cfg.adafactor_d)
    if cfg.optimizer == "lamb":
        return fullshard_optim.Lamb(groups, lr=cfg.lr, betas=cfg.lamb_betas, eps=cfg.lamb_eps)
    raise ValueError(f"unknown --optimizer {cfg.optimizer!r}")


def describe(cfg, optimizer: torch.optim.Optimizer) -> str:
    """The run header's optimizer line: the class, its hyper-parameters, tensors per group kind."""
    groups = optimizer.param_groups
    count = lambda gs: sum(len(g["params"]) for g in gs)  # noqa: E731
    wd = f"weight decay {cfg.weight_decay:g} on >=2-D weights"
    if cfg.optimizer in ("adam", "cpu_adam"):
        overlap = ""
        if isinstance(optimizer, fullshard_optim.OffloadAdamW):
            overlap = ", each unit stepped during backward (OffloadAdamW)"
        elif cfg.optimizer == "cpu_adam" and cfg.cpu_offload and cfg.ddp_backend == "fully_sharded":
            overlap = f", stepped after backward: {overlap_refusal(cfg)}"
        return (f"optimizer {cfg.optimizer}: AdamW (betas {cfg.adam_betas}, eps {cfg.adam_eps:g}, {wd}"
                f"{', fused' if groups[0].get('fused') else ''}{overlap}) on {count(groups)} tensors")
    if cfg.optimizer == "muon":
        muon = [g for g in groups if g.get("use_muon")]
        adamw = [g for g in groups if not g.get("use_muon")]
        return (f"optimizer muon: Muon (momentum {cfg.muon_momentum:g}, nesterov {cfg.muon_nesterov}, ns_steps "
                f"{cfg.muon_ns_steps}, ns_coefficients {cfg.muon_ns_coefficients}, eps {cfg.muon_eps:g}, "
                f"adjust_lr_fn {cfg.muon_adjust_lr_fn}) on {count(muon)} block matrices, AdamW (betas "
                f"{cfg.adam_betas}, eps {cfg.adam_eps:g}) on {count(adamw)} other tensors, {wd}")
    if cfg.optimizer == "adafactor":
        return (f"optimizer adafactor: Adafactor (lr = max relative step, beta2_decay {cfg.adafactor_beta2_decay:g}, "
                f"eps {cfg.adafactor_eps}, d {cfg.adafactor_d:g}, {wd}) on {count(groups)} tensors")
    return f"optimizer lamb: LAMB (betas {cfg.lamb_betas}, eps {cfg.lamb_eps:g}, {wd}) on {count(groups)} tensors"
