"""How `fullshard train` shards the GPT: ``--fsdp-version`` picks the front door.

Both front doors build the same units on the same engine (one unit per
transformer block of ``model.layers``, one root unit for the embeddings, the
final norm and the tied output projection), so a run gives the same losses,
bit for bit, and the same checkpoints under either version.

[Note: fsdp versions]
======================  ==========================================  ===============================================
the run asks for        --fsdp-version 1                            --fsdp-version 2
======================  ==========================================  ===============================================
wrapping                ``FullyShardedDataParallel`` with           ``fully_shard`` on each block of
                        ``ModuleWrapPolicy({TransformerBlock})``    ``model.layers``, then on the root
FULL_SHARD              ``sharding_strategy=FULL_SHARD``            ``reshard_after_forward=True``, 1-D mesh
SHARD_GRAD_OP           ``SHARD_GRAD_OP``                           ``reshard_after_forward=False``, 1-D mesh
HYBRID_SHARD            ``HYBRID_SHARD`` (shard within a node)      2-D mesh (replicate = nodes, shard =
                                                                    LOCAL_WORLD_SIZE ranks), ``True``
NO_SHARD                ``NO_SHARD``                                2-D mesh (world, 1): shards of one rank,
                                                                    gradients all-reduced (the trainer has no
                                                                    flag for it; :func:`device_mesh` maps it)
--cpu-offload           ``CPUOffload(offload_params=True)``         ``CPUOffloadPolicy()``
--bf16 / --fp16         ``MixedPrecision(low, fp32 reduce, low)``   ``MixedPrecisionPolicy(low, fp32 reduce)``
--checkpoint-act...     ``CheckpointWrapper`` per block, before     the same, before ``fully_shard`` (which then
                        wrapping                                    shards the wrapper: the same parameters)
deferred init           ``param_init_fn`` materializes each         built on meta, ``to_empty``, then each rank
                        rank's rows                                 fills its rows (:func:`init_local_rows`)
no_sync micro-batches   ``model.no_sync()``                         ``set_requires_gradient_sync(False)``
--clip-norm             ``model.clip_grad_norm_``                   ``fullshard.clip_grad_norm_(model)`` (the same
                                                                    norm, summed in the same order)
--world-size-invariant  ``world_size_invariant=True`` (propagated   ``world_size_invariant=True`` on every call
                        to the auto-wrapped units)
--optimizer muon        ``shard_placement_fn=muon_placement_fn``    torch.chunk rows (``Shard(0)`` DTensors hold
                        (each Muon matrix ``Owned`` by one rank:    no others): every rank gathers each matrix's
                        its owner alone runs Newton-Schulz)         update and runs Newton-Schulz on all of it
checkpoints             ``fullshard.checkpoint`` (by original name, DTensor ``Shard(0)`` values): one format
======================  ==========================================  ===============================================
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    clip_grad_norm_ as clip_sharded_grad_norm_,
    fully_shard,
)
from fullshard.core import collectives
from fullshard.models import TransformerBlock
from fullshard.train import optimizers
from fullshard.train.config import TrainConfig
from fullshard.wrap import ModuleWrapPolicy


def strategy_of(cfg: TrainConfig) -> ShardingStrategy:
    """The sharding strategy the flags ask for: FULL_SHARD, SHARD_GRAD_OP (--no-reshard-after-forward)
    or HYBRID_SHARD (--hybrid-shard: shard within a node, replicate across nodes)."""
    if cfg.hybrid_shard:
        return ShardingStrategy.HYBRID_SHARD
    return ShardingStrategy.FULL_SHARD if cfg.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def low_precision(cfg: TrainConfig):
    """The compute dtype of --fp16 / --bf16, or None (fp32)."""
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def shard_model(model: nn.Module, cfg: TrainConfig, device: torch.device, init_fn, blocks=None,
                prepare=None) -> nn.Module:
    """Shard ``model`` (a GPT built on the meta device) as ``cfg.fsdp_version`` says (see [Note: fsdp
    versions]); every rank calls it.

    Args:
        model: the GPT on meta, activation checkpointing already applied to its blocks.
        cfg: the run's configuration (strategy, precision, offload, version).
        device: the compute device.
        init_fn: ``fullshard.models.make_param_init_fn(model, seed, device)``, made before any wrapping
            (for a Hugging Face model: ``hf_model.RowReader``).
        blocks: the modules that become units before the root (default: ``model.layers``, whose
            TransformerBlocks the wrapper's auto-wrap policy finds); under activation checkpointing,
            the CheckpointWrappers that hold them.
        prepare: version 2 only: ``prepare(block)`` runs on each block just before it is sharded
            (``--quantize-base``: train/qlora.py).
    Returns:
        The model to train: a FullyShardedDataParallel root (version 1) or ``model`` itself, now a
        ``FSDPModule`` with DTensor parameters (version 2).
    Raises:
        ValueError: an fsdp version other than 1 or 2; ``prepare`` (QLoRA's quantizer) with version 1.
    """
    if cfg.fsdp_version == 1:
        if prepare is not None:  # QLoRA's quantizer: it would be dropped, the base trained unquantized
            raise ValueError(f"[rank {collectives.rank()}] quantize_base='nf4' needs fsdp_version=2 (fully_shard "
                             "gathers NF4 weights as packed bytes; the FSDP1 wrapper's flat parameters cannot "
                             "hold them)")
        classes = {TransformerBlock} if blocks is None else {type(_inner(b)) for b in blocks}
        return _fsdp1(model, cfg, device, init_fn, classes)
    if cfg.fsdp_version == 2:
        return _fully_shard(model, cfg, device, init_fn, model.layers if blocks is None else blocks, prepare=prepare)
    raise ValueError(f"[rank {collectives.rank()}] --fsdp-version {cfg.fsdp_version!r}: use 1 or 2")


def shard_stage(stage: nn.Module, cfg: TrainConfig, device: torch.device, init_fn, mesh: DeviceMesh) -> nn.Module:
    """Shard one pipeline stage (``fullshard.models.stages.GPTStage`` on meta) as --fsdp-version 2 does a
    whole model (one unit per block, then the stage), over the data-parallel ``mesh``.

    Args:
        stage: the stage on meta, activation checkpointing already applied to its blocks.
        init_fn: ``make_param_init_fn`` of the model the stage was cut from.
        mesh: the stage's data-parallel sub-mesh: 1-D ``mesh["dp"]`` of the (pp, dp) mesh, or 2-D
            ``mesh["replicate", "shard"]`` under --hybrid-shard (`pipeline.pipeline_mesh`).
    """
    if cfg.fsdp_version == 1:
        groups = mesh.get_group(0) if mesh.ndim == 1 else (mesh.get_group(1), mesh.get_group(0))
        return _fsdp1(stage, cfg, device, init_fn, {TransformerBlock}, groups)
    return _fully_shard(stage, cfg, device, init_fn, None, mesh)


def placement_kwargs(cfg: TrainConfig, model: nn.Module) -> dict:
    """``{"shard_placement_fn": fn}`` when the optimizer needs whole tensors on one rank (--optimizer
    muon: each Muon matrix ``Owned``), else nothing (every parameter row-sharded)."""
    fn = optimizers.placement_fn(cfg, model)
    return {} if fn is None else {"shard_placement_fn": fn}


def invariance_kwargs(cfg: TrainConfig) -> dict:
    """``{"world_size_invariant": True}`` under --world-size-invariant, else nothing (the engine's
    default: gradients averaged, the path that matches DDP)."""
    return {"world_size_invariant": True} if cfg.world_size_invariant else {}


def _inner(block: nn.Module) -> nn.Module:
    """The block a CheckpointWrapper holds, or ``block``."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _fsdp1(model: nn.Module, cfg: TrainConfig, device: torch.device, init_fn, classes: set,
           process_group=None) -> nn.Module:
    extra = {**invariance_kwargs(cfg), **placement_kwargs(cfg, model)}
    low = low_precision(cfg)
    if low is not None:
        # --hf-model: buffers stay fp32 (rotary inv_freq, which transformers reads in fp32), as under
        # fully_shard's MixedPrecisionPolicy, which casts no buffers.
        extra["mixed_precision"] = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32,
                                                  buffer_dtype=None if cfg.hf_model else low)
    if cfg.cpu_offload:
        extra["cpu_offload"] = CPUOffload(offload_params=True)
    return FullyShardedDataParallel(model, sharding_strategy=strategy_of(cfg), param_init_fn=init_fn,
                                    auto_wrap_policy=ModuleWrapPolicy(classes), device_id=device,
                                    process_group=process_group, **extra)


def device_mesh(strategy: ShardingStrategy, device_type: str) -> DeviceMesh:
    """The ``fully_shard`` mesh of a sharding strategy over the whole world.

    FULL_SHARD and SHARD_GRAD_OP: 1-D over every rank. HYBRID_SHARD: 2-D (replicate, shard) with
    shard groups of ``LOCAL_WORLD_SIZE`` consecutive ranks (one node), as the wrapper's default
    groups. NO_SHARD: 2-D (world, 1), shards of one rank whose gradients are all-reduced over the
    world, as the wrapper's NO_SHARD (hybrid sharding with one-rank shard groups).

    Raises:
        ValueError: HYBRID_SHARD with a world size that is not a multiple of LOCAL_WORLD_SIZE.
    """
    world = collectives.world_size()
    if strategy is ShardingStrategy.HYBRID_SHARD:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise ValueError(f"[rank {collectives.rank()}] HYBRID_SHARD: world size {world} is not a multiple of "
                             f"LOCAL_WORLD_SIZE {local}; launch the same number of ranks on every node")
        return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    if strategy is ShardingStrategy.NO_SHARD:
        return init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))


def _fully_shard(model: nn.Module, cfg: TrainConfig, device: torch.device, init_fn, blocks=None,
                 mesh: DeviceMesh | None = None, prepare=None) -> nn.Module:
    strategy = strategy_of(cfg)
    low = low_precision(cfg)
    kwargs = dict(mesh=mesh if mesh is not None else device_mesh(strategy, device.type),
                  reshard_after_forward=strategy is not ShardingStrategy.SHARD_GRAD_OP,
                  mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None),
                  offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
                  **invariance_kwargs(cfg))
    originals = dict(model.named_parameters())  # meta parameters, a tied one once
    if blocks is None:  # a pipeline stage (models/stages.py) keeps its blocks in a ModuleDict
        blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:  # a CheckpointWrapper(block) under --checkpoint-activations
        if prepare is not None:  # --quantize-base: the block's base weights quantized (train/qlora.py)
            prepare(block)
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # Shards live where the optimizer steps: host memory under --cpu-offload (torchtitan's order).
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_local_rows(model, originals, init_fn)
    return model


def _rows_of(param: DTensor) -> tuple[int, int]:
    """Dim-0 rows ``[lo, hi)`` of ``param`` this rank holds: ``torch.chunk`` of the rows over the
    mesh's last (shard) dimension, as ``Shard(0)`` places them."""
    mesh = param.device_mesh
    dim = mesh.ndim - 1
    size, coord = mesh.size(dim), mesh.get_local_rank(dim)
    rows = param.shape[0]
    chunk = -(-rows // size)
    lo = min(coord * chunk, rows)
    return lo, min(lo + chunk, rows)


@torch.no_grad()
def init_local_rows(model: nn.Module, originals: dict, init_fn) -> None:
    """Fill each DTensor parameter's local rows as ``init_fn`` initializes them, so the values equal
    the wrapper's deferred init (and a whole-model init) bit for bit; no rank builds a full parameter.

    Args:
        model: the ``fully_shard`` model after ``to_empty``.
        originals: ``{name: meta parameter}`` of the model before sharding (the keys ``init_fn`` knows).
        init_fn: ``make_param_init_fn``'s result (its ``init_rows``).
    Raises:
        RuntimeError: a parameter whose local rows are not ``torch.chunk``'s (names rank and parameter).
    """
    for name, param in model.named_parameters():
        local = param.to_local()
        if type(local) is not torch.Tensor and not local.requires_grad:
            continue  # materialized before sharding (an NF4 base weight, train/qlora.py): its values are its own
        lo, hi = _rows_of(param)
        if local.shape[0] != hi - lo:
            raise RuntimeError(f"[rank {collectives.rank()}] parameter '{name}': local shard has "
                               f"{local.shape[0]} rows, torch.chunk gives rows [{lo}, {hi}); cannot initialize "
                               "it by rows; report this with the model and mesh")
        rows = init_fn.init_rows(originals[name], lo, hi, local.device, out=local)  # written in place
        if rows is not local:
            local.copy_(rows)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Keep unsharded gradients locally over the backward passes inside (no communication); the
    first backward after it reduce-scatters the sum. Version 1: ``model.no_sync()``; version 2:
    ``set_requires_gradient_sync(False)``, then True again."""
    if not isinstance(model, FSDPModule):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip a sharded model's gradients to ``max_norm`` by their global L2 norm; returns the norm.

    Version 1: ``FullyShardedDataParallel.clip_grad_norm_``. Version 2: ``fullshard.clip_grad_norm_``
    on the root module, the same computation on the local shards of the DTensor gradients (each
    element counted once, summed over the root's groups in the same order), so both versions clip by
    the same norm bit for bit; ``torch.nn.utils.clip_grad_norm_`` on the DTensors gives the same norm
    up to rounding.

    Returns:
        The pre-clip norm, 0-dim fp32 on the host, identical on every rank.
    Raises:
        RuntimeError: during forward or backward.
    """
    if not isinstance(model, FSDPModule):
        return model.clip_grad_norm_(max_norm)
    return clip_sharded_grad_norm_(model, max_norm)
