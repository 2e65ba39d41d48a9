"""``fullshard plan --hf-model DIR``: per-rank model-state bytes of fine-tuning a local Hugging Face
checkpoint, fully or with LoRA (``--lora-rank R``, ``--base-dtype bf16``) or QLoRA (``--quantize-base
nf4``), counted apart for the frozen base, the trainable parameters, their gradient shards and their
optimizer state.

    fullshard plan --hf-model DIR --world-size 8 --lora-rank 16 --base-dtype bf16 [--quantize-base nf4]

The model is built on the meta device exactly as `fullshard train --hf-model` builds it
(:func:`fullshard.train.hf_model.load_meta`: PEFT applied, the base cast to ``--base-dtype``; no
weight is read) and cut into its units: one per decoder layer, then the root with the rest (a tied
parameter once). Each unit's parameters of one dtype form one flat shard (core/mixed.py [Note: units
that mix dtypes]) laid out by the engine's own layout math (:func:`fullshard.core.flat.make_layout`),
so the counts are the engine's, padding included:

* parameter shards, per dtype, split into frozen and trainable slots (``ceil(R / N)`` rows each);
  with ``--quantize-base nf4`` the decoder layers' frozen Linear weights are a part of their own,
  ``NF4Tensor`` (train/qlora.py): each rank's packed codes, block scales and factors, plus the scaler
  mean and code table every shard keeps (:func:`fullshard.train.qlora.nf4_bytes`; no padding: every
  such weight must split into whole scaler blocks per rank);
* gradient shards: the trainable slots only (frozen parameters get no gradient, no reduce-scatter);
* optimizer state: ``--optimizer``'s on the trainable parameters of the rank holding the most
  (:func:`fullshard.train.optim_state.state_elements`); frozen parameters get none;
* full parameters in flight, each part in its compute dtype (its own, or ``--bf16``/``--fp16``'s; an
  NF4 part: its gathered codes, scales and factors):
  FULL_SHARD the root, the running unit and one prefetched unit; SHARD_GRAD_OP every unit;
* the largest trainable unit's full gradient (``N·S`` elements of its trainable dtype's flat, frozen
  slots of that dtype included, as the engine's pooled gradient is) and its reduce-scatter input
  (the trainable slots, fp32).

Activations are not counted for a Hugging Face model (the GPT plan's Korthikanti et al. formula is
for fullshard's own GPT blocks).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
from typing import Optional

import torch
import torch.nn as nn

from fullshard.api import ShardingStrategy
from fullshard.core.flat import make_layout
from fullshard.train import hf_model, qlora
from fullshard.train.optim_state import OPTIMIZER_STATE, ParamRecord, UnitRecord, state_elements


@dataclasses.dataclass(frozen=True)
class Part:
    """The parameters of one dtype in one unit: ``(fqn, shape, trainable)`` in order; ``nf4``: frozen
    weights stored as torchao ``NF4Tensor`` of ``dtype`` (a packed part, core/packed.py)."""

    dtype: torch.dtype
    params: tuple
    nf4: bool = False


@dataclasses.dataclass(frozen=True)
class HFUnit:
    """One unit: its name and its parts (the trainable dtype's first, as the engine's main unit)."""

    name: str
    parts: tuple


def hf_units(model: nn.Module, layers: nn.ModuleList, nf4: bool = False) -> tuple[HFUnit, ...]:
    """The units `fullshard train --hf-model` makes of ``model`` (meta is fine): each item of ``layers``
    named by its module path, then the root (``""``) with the parameters left, a tied parameter once,
    where it is first met. ``nf4``: each layer's frozen Linear weights (:func:`qlora.base_linears`) form
    an NF4 part of their own, as `--quantize-base nf4` stores them."""
    paths = {id(m): n for n, m in model.named_modules()}
    packed = {id(lin.weight) for layer in layers for _, lin in qlora.base_linears(layer)} if nf4 else set()
    seen: set[int] = set()
    out = []
    for name, module in [(paths[id(m)], m) for m in layers] + [("", model)]:
        groups: dict[tuple, list] = {}  # (dtype, nf4) -> params
        for fqn, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                groups.setdefault((p.dtype, id(p) in packed), []).append((fqn, tuple(p.shape), p.requires_grad))
        main = next((k for k, ps in groups.items() if any(t for _, _, t in ps)), None)
        order = sorted(groups, key=lambda k: k != main)  # stable: the trainable dtype first
        out.append(HFUnit(name, tuple(Part(k[0], tuple(groups[k]), k[1]) for k in order)))
    return tuple(out)


def _size(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def plan_hf(units: tuple[HFUnit, ...], strategy: ShardingStrategy, world: int, optimizer: str = "adam",
            param_dtype: Optional[torch.dtype] = None) -> dict:
    """Per-rank bytes of one fine-tuning step's model state, by component.

    Args:
        units: :func:`hf_units`.
        strategy: FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (a one-rank shard group).
        world: N, data-parallel ranks.
        optimizer: a key of :data:`fullshard.train.optim_state.OPTIMIZER_STATE` (not muon).
        param_dtype: the compute dtype every part is cast to (``--bf16``/``--fp16``); None: each
            part computes in its own dtype.
    Returns:
        ``frozen`` and ``trainable`` (``{dtype name: bytes}`` of parameter shards; NF4 parts under
        ``"NF4Tensor"``, as ``memory_stats``' ``by_dtype``), ``grads``
        (gradient shards), ``optimizer``, ``full_params``, ``full_grads`` (ints, bytes),
        ``device_total`` (their sum), ``frozen_numel``, ``trainable_numel`` (Ψ of each).
    Raises:
        ValueError: an unknown optimizer, or muon.
    """
    if optimizer == "muon":
        raise ValueError("--hf-model with --optimizer muon is not supported; use adam, adafactor or lamb")
    n = 1 if strategy is ShardingStrategy.NO_SHARD else world
    frozen: dict[str, int] = {}
    trainable: dict[str, int] = {}
    grads = 0
    full = []  # per unit: unsharded bytes of every part in its compute dtype
    full_grad = 0
    numel = {True: 0, False: 0}
    records = []
    for unit in units:
        unit_full = 0
        for i, part in enumerate(unit.parts):
            if part.nf4:  # frozen packed bytes: no gradient, no optimizer state, no padding
                sizes = [qlora.nf4_bytes(shape, n, _size(part.dtype)) for _, shape, _ in part.params]
                frozen["NF4Tensor"] = frozen.get("NF4Tensor", 0) + sum(sh for sh, _ in sizes)
                unit_full += sum(g for _, g in sizes)
                numel[False] += sum(math.prod(shape) for _, shape, _ in part.params)
                continue
            layout = make_layout([(f, torch.Size(s), t) for f, s, t in part.params], n)
            size, name = _size(part.dtype), str(part.dtype).removeprefix("torch.")
            train = sum(lay.shard_numel for lay in layout.params if lay.requires_grad) * size
            trainable[name] = trainable.get(name, 0) + train
            frozen[name] = frozen.get(name, 0) + layout.shard_numel * size - train
            grads += layout.grad_shard_numel * size
            compute = _size(param_dtype or part.dtype)
            unit_full += layout.unsharded_numel * compute
            if i == 0 and layout.grad_shard_numel:  # the pooled full gradient, then the fp32 reduce-scatter input
                full_grad = max(full_grad, layout.unsharded_numel * compute + n * layout.grad_shard_numel * 4)
            for _, shape, t in part.params:
                numel[t] += math.prod(shape)
            records.append(UnitRecord(unit.name, tuple(ParamRecord(s) for _, s, t in part.params if t)))
        full.append(unit_full)
    state = 4 * max(state_elements(records, optimizer, n))
    mixed = param_dtype is not None and param_dtype != torch.float32
    if strategy is ShardingStrategy.NO_SHARD:
        in_flight = sum(full) if mixed else 0
    elif strategy is ShardingStrategy.SHARD_GRAD_OP:
        in_flight = sum(full)
    else:
        in_flight = full[-1] + sum(sorted(full[:-1])[-2:])  # the root, the running and the prefetched unit
    out = dict(frozen=frozen, trainable=trainable, grads=grads, optimizer=state, full_params=in_flight,
               full_grads=full_grad)
    out["device_total"] = sum(frozen.values()) + sum(trainable.values()) + grads + state + in_flight + full_grad
    out.update(frozen_numel=numel[False], trainable_numel=numel[True])
    return out


def format_plan_hf(title: str, est: dict, optimizer: str) -> str:
    """Human-readable breakdown: GB (1e9 bytes, as `fullshard plan`) and exact bytes."""
    row = lambda name, x: f"  {name:<44}{x / 1e9:10.3f} GB {x:>16,} B"  # noqa: E731
    lines = [title, f"  frozen {est['frozen_numel']:,} parameters, trainable {est['trainable_numel']:,}"]
    for dtype, x in est["frozen"].items():
        if x:
            lines.append(row(f"frozen parameter shards ({dtype})", x))
    for dtype, x in est["trainable"].items():
        if x:
            lines.append(row(f"trainable parameter shards ({dtype})", x))
    lines += [row("gradient shards (trainable only)", est["grads"]),
              row(f"{OPTIMIZER_STATE[optimizer]}, trainable only", est["optimizer"]),
              row("full parameters in flight", est["full_params"]),
              row("largest unit's full gradient + reduce input", est["full_grads"]),
              row("per-rank total (activations not counted)", est["device_total"])]
    return "\n".join(lines)


def run(p, args: argparse.Namespace, dtype: torch.dtype) -> int:
    """`fullshard plan --hf-model DIR`: check the fine-tuning flags (one line, exit 2) and print the plan."""
    if args.lora_rank < 0:
        p.fail(f"--lora-rank must be >= 0 (0 = full fine-tuning), got {args.lora_rank}")
    if args.base_dtype != "fp32" and not args.lora_rank:
        p.fail(f"--base-dtype {args.base_dtype} needs --lora-rank R (> 0): only a frozen base is stored in it")
    if args.lora_target_modules and not args.lora_rank:
        p.fail("--lora-target-modules needs --lora-rank R (> 0)")
    if args.optimizer == "muon":
        p.fail("--hf-model with --optimizer muon is not supported yet; use adam, adafactor or lamb")
    nf4 = args.quantize_base == "nf4"
    if nf4 and not args.lora_rank:
        p.fail("--quantize-base nf4 needs --lora-rank R (> 0): only a frozen base is quantized (QLoRA)")
    cfg = types.SimpleNamespace(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                lora_target_modules=args.lora_target_modules, base_dtype=args.base_dtype, seed=1)
    try:
        model, layers, _ = hf_model.load_meta(cfg, args.hf_model)
    except hf_model.HFModelError as e:
        p.fail(str(e))
    strategy = ShardingStrategy[args.sharding_strategy]
    if nf4:
        try:  # the rule `fullshard train` applies to each layer (whole scaler blocks per rank)
            for layer in layers:
                qlora.check_world(layer, 1 if strategy is ShardingStrategy.NO_SHARD else args.world_size)
        except qlora.QuantizeError as e:
            p.fail(str(e))
    est = plan_hf(hf_units(model, layers, nf4), strategy, args.world_size, args.optimizer,
                  None if dtype == torch.float32 else dtype)
    what = f"LoRA r={args.lora_rank}, {args.base_dtype} base" if args.lora_rank else "full fine-tune"
    what += ", NF4 decoder-layer Linear weights" if nf4 else ""
    compute = {torch.float32: "", torch.bfloat16: ", --bf16", torch.float16: ", --fp16"}[dtype]
    print(format_plan_hf(f"{args.hf_model}: {what}{compute}, {strategy.value}, N={args.world_size}", est,
                         args.optimizer))
    return 0
