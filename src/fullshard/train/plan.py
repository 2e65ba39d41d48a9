"""``fullshard plan``, the memory planner: per-rank bytes of a GPT training step
under fullshard, and the configurations that fit a budget.

    fullshard plan --arch transformer_lm_gpt3_xl --world-size 8 --bf16 --budget-gb 16

The flags are `fullshard train`'s (model shape, memory features, precision,
batch) plus the planner's own (:class:`PlanOptions`); the position table is the
one `fullshard train` builds for the arch.

Model state follows fullshard's engine, unit by unit (one unit per
``TransformerBlock`` plus the root for embeddings and the final norm):

* parameter shards are the fp32 master copy, 4·Ψ/N bytes (NO_SHARD: 4·Ψ), counted exactly: each
  parameter's slot of ``ceil(R / N)`` rows, and under ``--optimizer muon`` the largest rank's
  owned matrices (:func:`fullshard.train.optim_state.shard_elements`);
* gradient shards are fp32 too, the same size;
* the optimizer state of ``--optimizer`` on the rank that holds the most (Adam and LAMB two fp32
  moments, 8·Ψ/N; Muon one momentum per owned matrix plus AdamW's two moments for the rest;
  Adafactor row and column factors per matrix): see ``optim_state.py`` [Note: optimizer state
  per rank];
* full parameters exist in the compute dtype (p bytes per element) only while
  a unit runs: FULL_SHARD holds the root unit, the running unit and one
  prefetched unit; SHARD_GRAD_OP keeps every unit from forward to backward
  (p·Ψ); NO_SHARD needs a separate compute copy only under mixed precision;
* a unit's full gradient (p bytes) and its reduce-scatter input (fp32) exist
  for the largest unit at a time.

For comparison :func:`zero_model_state_bytes` gives the ZeRO paper's
accounting (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, §5.1, Figure 1): mixed-precision Adam
with fp16 parameters and gradients (2 + 2 bytes) and K = 12 bytes of fp32
optimizer state per parameter. Its totals differ from fullshard's because
fullshard's gradient shards are fp32 and its low-precision parameters are
transient (see the README's planner section).

Activations per transformer layer follow Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", MLSys 2023, §4.1,
equation (1) without tensor or sequence parallelism: s·b·h·(34 + 5·a·s/h)
bytes with 16-bit activations (scaled by p/2 for other widths). Its MLP
share, 19·s·b·h at FFN width 4h, is 3·s·b·h + 4·s·b·F for FFN width F. With
activation checkpointing each layer keeps only its input (2·s·b·h·p/2 bytes)
and one layer's activations are rebuilt at a time. The logits and the loss
add b·s·V·(p + 4) bytes (logits in the compute dtype, fp32 log-softmax).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import ClassVar, Optional

import torch

from fullshard.api import ShardingStrategy
from fullshard.models import ARCHS, TransformerBlock, build_model, make_config
from fullshard.train import plan_hf
from fullshard.train.config import (
    DatasetOptions,
    DistributedOptions,
    FinetuneOptions,
    OptimizationOptions,
    PrecisionOptions,
)
from fullshard.train.flags import add_options, flag
from fullshard.train.optim_state import OPTIMIZER_STATE, gpt_units, shard_elements, state_elements
from fullshard.train.options import OneLineArgumentParser, add_model_args, check_tokens_per_sample, resolve_arch

ZERO_K = 12
"""Bytes of optimizer state per parameter for mixed-precision Adam (ZeRO §3.1)."""


def zero_model_state_bytes(psi: float, world: int, stage: int, k: int = ZERO_K) -> float:
    """Per-rank model-state bytes under ZeRO stage ``stage`` (0 = DDP baseline,
    1 = P_os, 2 = P_os+g, 3 = P_os+g+p), Rajbhandari et al. 2020, §5.1, Figure 1.

    Args:
        psi: Ψ, number of parameters.
        world: N, data-parallel degree.
        stage: 0 to 3.
        k: optimizer-state bytes per parameter (12 for mixed-precision Adam).
    Raises:
        ValueError: ``stage`` outside 0..3.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    params = 2 * psi / (world if stage >= 3 else 1)
    grads = 2 * psi / (world if stage >= 2 else 1)
    optim = k * psi / (world if stage >= 1 else 1)
    return params + grads + optim


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: sizes of a GPT and of its batch.

    Attributes:
        psi: Ψ, number of parameters.
        largest_unit_numel: elements of the largest FSDP unit (the root's included).
        root_unit_numel: elements of the root unit (embeddings, final norm).
        num_layers, embed_dim, num_heads, vocab_size: model shape (L, h, a, V).
        batch_size: sequences per rank (b).
        tokens_per_sample: sequence length (s).
        ffn_embed_dim: MLP hidden width F; None means 4·h.
        units: the units' parameters (:func:`fullshard.train.optim_state.gpt_units`); empty: count
            model state from Ψ alone (no padding, Adam).
        largest_block_numel: elements of the largest transformer-block unit (0: ``largest_unit_numel``).
    """

    psi: int
    largest_unit_numel: int
    root_unit_numel: int
    num_layers: int
    embed_dim: int
    num_heads: int
    vocab_size: int
    batch_size: int
    tokens_per_sample: int
    ffn_embed_dim: Optional[int] = None
    units: tuple = dataclasses.field(default=(), repr=False)
    largest_block_numel: int = 0


def gpt_workload(arch, batch_size: int, tokens_per_sample: int, vocab_size: int = 50257,
                 max_positions: Optional[int] = None) -> Workload:
    """Count a GPT's parameters per unit exactly (built on the meta device).

    Args:
        arch: a key of :data:`fullshard.models.ARCHS` or a
            :class:`fullshard.models.ArchSpec` (a named shape with overrides).
        batch_size: sequences per rank.
        tokens_per_sample: sequence length, tokens.
        vocab_size: token ids V.
        max_positions: rows of the learned position table (``fullshard train`` uses the
            arch's, 2048 for the GPT-3 family); None means ``tokens_per_sample``.
    Raises:
        ValueError: unknown arch name or invalid shape.
    """
    positions = max_positions or tokens_per_sample
    model = build_model(arch, vocab_size=vocab_size, max_positions=positions, device="meta")
    cfg = make_config(arch, vocab_size, positions)
    psi = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, TransformerBlock)]
    root = psi - sum(blocks)
    return Workload(psi, max(blocks + [root]), root, cfg.num_layers, cfg.embed_dim, cfg.num_heads,
                    vocab_size, batch_size, tokens_per_sample, ffn_embed_dim=cfg.ffn_embed_dim,
                    units=gpt_units(model), largest_block_numel=max(blocks))


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of training: sharding strategy, precision and memory features."""

    strategy: ShardingStrategy
    world_size: int
    param_dtype: torch.dtype = torch.float32
    cpu_offload: bool = False
    checkpoint_activations: bool = False
    optimizer: str = "adam"
    """``--optimizer``: what its state holds (see :mod:`fullshard.train.optim_state`)."""

    def label(self) -> str:
        parts = [self.strategy.value, {torch.float32: "fp32", torch.bfloat16: "bf16",
                                       torch.float16: "fp16"}[self.param_dtype]]
        if self.optimizer != "adam":
            parts.append(self.optimizer)
        if self.checkpoint_activations:
            parts.append("checkpoint-activations")
        if self.cpu_offload:
            parts.append("cpu-offload")
        return " + ".join(parts)


def plan(work: Workload, cfg: Config) -> dict[str, int]:
    """Per-rank bytes of one training step, by component.

    Returns:
        ``params``, ``grads``, ``optimizer`` (shards, on the host with CPU
        offload; the optimizer state of the rank holding the most, ``optimizer_min`` of the one
        holding the least), ``full_params`` and ``full_grads`` (transient unsharded
        units), ``activations``, ``device_total`` (everything not offloaded)
        and ``host_offloaded``.
    """
    n = 1 if cfg.strategy is ShardingStrategy.NO_SHARD else cfg.world_size
    p = torch.finfo(cfg.param_dtype).bits // 8
    mixed = cfg.param_dtype != torch.float32
    if work.units:
        shard = 4 * shard_elements(work.units, n, owned=cfg.optimizer == "muon")
        state = [4 * e for e in state_elements(work.units, cfg.optimizer, n)]
    else:
        shard, state = 4 * work.psi // n, [8 * work.psi // n]
    out = {"params": shard, "grads": shard, "optimizer": max(state), "optimizer_min": min(state)}
    if cfg.strategy is ShardingStrategy.NO_SHARD:
        full = p * work.psi if mixed else 0
    elif cfg.strategy is ShardingStrategy.SHARD_GRAD_OP:
        full = p * work.psi
    else:
        # The root stays gathered from forward into backward; beside it one block computes and the next is
        # prefetched (counting the root as the largest unit twice more overstated this 2.8x).
        full = p * (work.root_unit_numel + 2 * (work.largest_block_numel or work.largest_unit_numel))
    out["full_params"] = full
    out["full_grads"] = (p + 4) * work.largest_unit_numel
    out["activations"] = activation_bytes(work, p, cfg.checkpoint_activations)
    state = out["params"] + out["grads"] + out["optimizer"]
    out["host_offloaded"] = state if cfg.cpu_offload else 0
    out["device_total"] = sum(out[k] for k in ("full_params", "full_grads", "activations")) + (
        0 if cfg.cpu_offload else state)
    return out


def layer_activation_bytes(work: Workload, p: int) -> float:
    """Activations one transformer layer keeps for backward, bytes (Korthikanti et al. 2023, §4.1,
    eq. (1)); see module docstring."""
    s, b, h, a = work.tokens_per_sample, work.batch_size, work.embed_dim, work.num_heads
    f = work.ffn_embed_dim or 4 * h
    # eq. (1)'s 34·s·b·h holds an MLP term 19·s·b·h = 3·s·b·h + 4·s·b·f at f = 4h; written for any f.
    return s * b * (18 * h + 4 * f + 5 * a * s) * p / 2


def checkpointed_layer_bytes(work: Workload, p: int) -> float:
    """What a layer under activation checkpointing keeps: its input, s·b·h elements of p bytes."""
    return 2 * work.tokens_per_sample * work.batch_size * work.embed_dim * p / 2


def logits_bytes(work: Workload, p: int) -> int:
    """The logits (compute dtype) and the fp32 log-softmax of the loss: b·s·V·(p + 4) bytes."""
    return work.batch_size * work.tokens_per_sample * work.vocab_size * (p + 4)


def activation_bytes(work: Workload, p: int, checkpoint: bool) -> int:
    """Activations of one step (Korthikanti et al. 2023, §4.1, eq. (1)); see module docstring."""
    per_layer = layer_activation_bytes(work, p)
    layers = (work.num_layers * checkpointed_layer_bytes(work, p) + per_layer) if checkpoint \
        else work.num_layers * per_layer
    return int(layers + logits_bytes(work, p))


def _speed_rank(cfg: Config) -> tuple:
    """Order of expected step time, cheapest first: no host round trip, no
    recomputation (about 1/3 more compute), less communication (NO_SHARD and
    SHARD_GRAD_OP 2Ψ, FULL_SHARD 3Ψ), then 16-bit compute before fp32 (the
    accelerator case; on a CPU without fast bf16 kernels fp32 may win)."""
    comm = 3 if cfg.strategy is ShardingStrategy.FULL_SHARD else 2
    return (cfg.cpu_offload, cfg.checkpoint_activations, comm, cfg.param_dtype == torch.float32,
            cfg.strategy is ShardingStrategy.NO_SHARD)


def fitting(work: Workload, world_size: int, budget_bytes: float,
            strategies=(ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD),
            dtypes=(torch.float32, torch.bfloat16), optimizer: str = "adam") -> list[tuple[Config, dict]]:
    """Every configuration whose device bytes fit ``budget_bytes``, fastest first
    (by :func:`_speed_rank`, a cost order, not a measurement)."""
    out = []
    for strategy, dtype, ckpt, offload in itertools.product(strategies, dtypes, (False, True), (False, True)):
        cfg = Config(strategy, world_size, dtype, offload, ckpt, optimizer)
        est = plan(work, cfg)
        if est["device_total"] <= budget_bytes:
            out.append((cfg, est))
    return sorted(out, key=lambda ce: _speed_rank(ce[0]))


def format_plan(work: Workload, cfg: Config, est: dict, budget_bytes: Optional[float] = None) -> str:
    """Human-readable breakdown (GB = 1e9 bytes, as the ZeRO paper)."""
    gb = lambda x: f"{x / 1e9:10.3f} GB"  # noqa: E731
    lines = [f"{cfg.label()}, N={cfg.world_size}, Ψ={work.psi:,}, batch {work.batch_size} x "
             f"{work.tokens_per_sample} tokens per rank"]
    names = {"params": "parameter shards (fp32)", "grads": "gradient shards (fp32)",
             "optimizer": OPTIMIZER_STATE[cfg.optimizer], "full_params": "full parameters in flight",
             "full_grads": "largest unit's full gradient", "activations": "activations and logits"}
    for key, name in names.items():
        where = " (host)" if cfg.cpu_offload and key in ("params", "grads", "optimizer") else ""
        lines.append(f"  {name + where:<40}{gb(est[key])}")
    if est.get("optimizer_min", est["optimizer"]) < 0.99 * est["optimizer"]:  # e.g. muon's owned matrices
        lines.append(f"  {'  (the rank holding the least)':<40}{gb(est['optimizer_min'])}")
    lines.append(f"  {'per-rank device total':<40}{gb(est['device_total'])}")
    if est["host_offloaded"]:
        lines.append(f"  {'host (offloaded shards)':<40}{gb(est['host_offloaded'])}")
    zero = ", ".join(f"stage {s}: {zero_model_state_bytes(work.psi, cfg.world_size, s) / 1e9:.2f}"
                     for s in range(4))
    lines.append(f"  ZeRO §5.1 model states (mixed-precision Adam, GB): {zero}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the `fullshard plan` command
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The planner's own flags (the others are `fullshard train`'s)."""

    TITLE: ClassVar[str] = "plan"
    world_size: int = flag(help="N, data-parallel ranks", type=int)
    sharding_strategy: str = flag("FULL_SHARD", "how parameters, gradients and optimizer state are sharded "
                                  "(default: %(default)s)", choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
    vocab_size: int = flag(50257, "token ids V (default: %(default)s)")
    budget_gb: Optional[float] = flag(None, "list every configuration fitting this many GB per rank", type=float)


def add_args(p: argparse.ArgumentParser) -> None:
    """Register `fullshard plan`'s flags on ``p``."""
    add_model_args(p, dict(default=None, choices=sorted(ARCHS),
                           help="a named GPT (see `fullshard train --help`); or --hf-model DIR"))
    add_options(p, PlanOptions)
    add_options(p, DistributedOptions, ("cpu_offload", "checkpoint_activations"))
    add_options(p, PrecisionOptions, ("fp16", "bf16"))
    add_options(p, DatasetOptions, ("tokens_per_sample", "batch_size"))
    add_options(p, OptimizationOptions, ("optimizer",))
    add_options(p, FinetuneOptions, ("hf_model", "lora_rank", "lora_alpha", "lora_target_modules", "base_dtype",
                                           "quantize_base"))


def check_args(p: OneLineArgumentParser, args: argparse.Namespace) -> tuple:
    """Check the flags every plan reads (one line, exit 2 on bad input).

    Returns:
        ``(shape, max_positions, dtype)``: the model's :class:`fullshard.models.ArchSpec`, its
        position-table size and the compute dtype (torch.float32, bfloat16 or float16).
    """
    for name in ("world_size", "batch_size", "tokens_per_sample", "vocab_size"):
        if getattr(args, name) < 1:
            p.fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.bf16 and args.fp16:
        p.fail("--bf16 and --fp16 are exclusive; pick one")
    if args.budget_gb is not None and args.budget_gb <= 0:
        p.fail(f"--budget-gb must be > 0, got {args.budget_gb}")
    if args.arch is None:
        p.fail("give --arch NAME (a GPT) or --hf-model DIR (a Hugging Face checkpoint)")
    try:
        shape = resolve_arch(args.arch, vars(args))
    except ValueError as e:
        p.fail(str(e))
    positions = check_tokens_per_sample(p, args, shape)  # the position table `fullshard train` builds
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return shape, positions, dtype


# How `fullshard train` runs each strategy (a NO_SHARD fit is for the library's wrapper).
_TRAIN_FLAGS = {ShardingStrategy.FULL_SHARD: "",
                ShardingStrategy.SHARD_GRAD_OP: "  (train: --no-reshard-after-forward)",
                ShardingStrategy.NO_SHARD: "  (library only: fullshard train has no NO_SHARD)"}


def run(p: OneLineArgumentParser, args: argparse.Namespace) -> int:
    """Check the flags (one line, exit 2 on bad input), print the plan and what fits the budget."""
    if args.hf_model:
        return _run_hf(p, args)
    for name in ("lora_rank", "lora_target_modules"):
        if getattr(args, name):
            p.fail(f"--{name.replace('_', '-')} needs --hf-model DIR")
    if args.base_dtype != "fp32" or args.quantize_base != "none":
        p.fail(f"--{'base-dtype' if args.base_dtype != 'fp32' else 'quantize-base'} needs --hf-model DIR and "
               "--lora-rank R")
    shape, positions, dtype = check_args(p, args)
    work = gpt_workload(shape, args.batch_size, args.tokens_per_sample, args.vocab_size, max_positions=positions)
    cfg = Config(ShardingStrategy[args.sharding_strategy], args.world_size, dtype, args.cpu_offload,
                 args.checkpoint_activations, args.optimizer)
    print(format_plan(work, cfg, plan(work, cfg)))
    if args.budget_gb is not None:
        fits = fitting(work, args.world_size, args.budget_gb * 1e9, optimizer=args.optimizer)
        print(f"configurations fitting {args.budget_gb:g} GB per rank, expected fastest first:"
              + ("" if fits else " none"))
        for c, est in fits:
            print(f"  {est['device_total'] / 1e9:8.3f} GB  {c.label()}{_TRAIN_FLAGS[c.strategy]}")
    return 0


def _run_hf(p: OneLineArgumentParser, args: argparse.Namespace) -> int:
    """`fullshard plan --hf-model DIR` (:mod:`fullshard.train.plan_hf`): model state only."""
    if args.arch is not None:
        p.fail("--arch and --hf-model are exclusive; the plan is of one model")
    for name, given in (("--budget-gb", args.budget_gb is not None), ("--cpu-offload", args.cpu_offload),
                        ("--checkpoint-activations", args.checkpoint_activations),
                        ("--pipeline-parallel-size", args.pipeline_parallel_size is not None)):
        if given:
            p.fail(f"{name} is not planned for --hf-model yet (model state only); drop it")
    if args.world_size < 1:
        p.fail(f"--world-size must be >= 1, got {args.world_size}")
    if args.bf16 and args.fp16:
        p.fail("--bf16 and --fp16 are exclusive; pick one")
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return plan_hf.run(p, args, dtype)
