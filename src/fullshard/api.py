"""Public enums and frozen config dataclasses. No logic lives here."""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch
import torch.nn as nn


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are split.

    Attributes:
        FULL_SHARD: parameters, gradients and optimizer state sharded; full
            parameters are freed after each unit's forward and gathered again for
            its backward (ZeRO-3; Rajbhandari et al. 2020, §5.3). 3Ψ elements of
            communication per step.
        SHARD_GRAD_OP: gradients and optimizer state sharded; full parameters are
            kept from forward until the unit's backward ends (ZeRO-2-like). 2Ψ.
        NO_SHARD: every rank keeps everything; gradients are all-reduced (DDP).
        HYBRID_SHARD: FULL_SHARD inside a shard group, replicated across groups;
            gradients are reduce-scattered in the shard group, then all-reduced
            across the replicate group.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    Attributes:
        BACKWARD_PRE: as soon as the current unit's backward starts (more overlap,
            one extra unit of full parameters alive).
        BACKWARD_POST: after the current unit's gradients were handed to
            reduce-scatter (less memory, less overlap).

    Pass ``None`` to the wrapper for no prefetch.
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


_NORM_CLASSES: tuple[type, ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
    nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)
"""torch.nn's norm layers with running statistics (every public subclass of its
private ``_NormBase``), the default ``full_precision_module_classes``."""


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision policy; the sharded (master) parameters stay in their
    original dtype (fp32; a later ``model.double()`` / ``.half()`` converts
    them, while the dtypes set here stay) and are what the optimizer updates.

    Attributes:
        param_dtype: dtype of full parameters: the all-gather moves it and
            forward/backward compute in it (None = the master dtype).
        reduce_dtype: dtype gradients are reduce-scattered in (None =
            param_dtype); the result is accumulated into fp32 gradient shards
            (but see ``keep_low_precision_grads``).
        buffer_dtype: dtype module buffers are cast to (None = unchanged).
        keep_low_precision_grads: leave the sharded parameters' ``.grad`` in
            ``param_dtype`` after the reduce instead of casting it to the
            master dtype (torch FSDP1's option): gradient shards take half
            the memory of fp32 ones. Reduced gradients are still summed in
            the master dtype (across backwards without ``zero_grad``, one
            rounding per backward), then rounded to ``param_dtype``. The
            parameters stay in the master dtype, so ``p.grad.dtype !=
            p.dtype``: the optimizer must accept that. ``torch.optim.SGD``,
            ``Adagrad``, ``RMSprop``, ``Adadelta``, ``ASGD``, ``Rprop`` and
            ``Adafactor`` do (their state may then be in ``param_dtype``);
            ``Adam``, ``AdamW``, ``Adamax``, ``NAdam`` and ``RAdam`` raise
            RuntimeError ("expected dtype float for `end`") at ``step()``.
            ``clip_grad_norm_`` (norm computed in fp32), ``no_sync``, CPU
            offload and ``ShardedGradScaler`` work with such gradients. No
            effect without ``param_dtype`` and on units of
            ``full_precision_module_classes`` (their gradients stay in the
            master dtype, as in torch FSDP1).
        cast_forward_inputs: cast floating-point tensors passed to each unit's
            forward (inside tensors, lists, tuples, dicts and dataclasses) to
            ``param_dtype``.
        cast_root_forward_inputs: cast the root unit's floating-point forward
            inputs to ``param_dtype`` also when ``cast_forward_inputs`` is
            False (torch FSDP1's field and default).
        full_precision_module_classes: modules of these classes run in full
            precision when ``param_dtype`` is set: each becomes a unit of its
            own whose parameters and buffers stay in the master dtype, whose
            inputs are cast up to it and whose outputs are cast back to the
            inputs' dtype. Default: norm layers with running statistics
            (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``,
            ``nn.InstanceNorm1d/2d/3d`` and their lazy forms, with
            subclasses), whose statistics lose too much in bf16/fp16 (torch
            FSDP1 does the same for BatchNorm).
    Source: Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = True
    cast_root_forward_inputs: bool = True
    full_precision_module_classes: tuple[type, ...] = _NORM_CLASSES


@dataclasses.dataclass(frozen=True)
class CPUOffload:
    """Keep parameter shards, gradient shards (and so the optimizer state and
    step) in host memory; each unit's shard is copied to the compute device
    for its all-gather and gradient shards are copied back.

    Attributes:
        offload_params: True to offload; False ("off") keeps shards on the
            compute device.
    Source: ZeRO-Offload, Ren et al., USENIX ATC 2021, §4.
    """

    offload_params: bool = False


class StateDictType(enum.Enum):
    """What ``state_dict()`` / ``load_state_dict()`` and
    ``FullyShardedDataParallel.optim_state_dict`` exchange (torch FSDP1's names).

    Attributes:
        FULL_STATE_DICT: full tensors under the original (unwrapped) names, the
            same keys and shapes as the plain model's ``state_dict()``.
        SHARDED_STATE_DICT: ``torch.distributed.tensor.DTensor`` values placed
            ``Shard(0)`` on a 1-D device mesh over the shard group; the local tensor
            is this rank's ``torch.chunk`` rows (no copy). Buffers are plain tensors.
        LOCAL_STATE_DICT: each unit's flat shard as one 1-D tensor under
            ``<unit prefix>_flat_param`` (``layout.shard_numel`` elements, the
            master dtype) instead of its parameters; buffers as usual. It loads
            only at the same world size into the same model (a different size
            raises ValueError); the optimizer's own ``state_dict()`` is the
            matching optimizer state.
    """

    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"
    LOCAL_STATE_DICT = "LOCAL_STATE_DICT"


@dataclasses.dataclass(frozen=True)
class FullStateDictConfig:
    """Options of FULL_STATE_DICT.

    Attributes:
        offload_to_cpu: copy every gathered tensor to host memory.
        rank0_only: only rank 0 returns the tensors; other ranks take part in
            the gathers and get an empty dict.
    """

    offload_to_cpu: bool = False
    rank0_only: bool = False


@dataclasses.dataclass(frozen=True)
class ShardedStateDictConfig:
    """Options of SHARDED_STATE_DICT.

    Attributes:
        offload_to_cpu: local shards are copied to host memory (a copy, where
            the default is a view of the live shard).
    """

    offload_to_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class LocalStateDictConfig:
    """Options of LOCAL_STATE_DICT.

    Attributes:
        offload_to_cpu: the flat shard is copied to host memory (a copy,
            where the default is the live flat shard).
    """

    offload_to_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class FullOptimStateDictConfig:
    """Options of the optimizer state under FULL_STATE_DICT (see FullStateDictConfig)."""

    offload_to_cpu: bool = False
    rank0_only: bool = False


@dataclasses.dataclass(frozen=True)
class ShardedOptimStateDictConfig:
    """Options of the optimizer state under SHARDED_STATE_DICT (see ShardedStateDictConfig)."""

    offload_to_cpu: bool = False


@dataclasses.dataclass(frozen=True)
class LocalOptimStateDictConfig:
    """Options of the optimizer state under LOCAL_STATE_DICT. The optimizer's
    own ``state_dict()`` already holds this rank's shards, so
    ``FSDP.optim_state_dict`` refuses LOCAL_STATE_DICT and names it."""

    offload_to_cpu: bool = False


# ------------------------------------------------------- fully_shard (FSDP2)
@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision of :func:`fullshard.fully_shard` (torch FSDP2's
    ``MixedPrecisionPolicy``, same fields and meaning).

    Attributes:
        param_dtype: dtype of the all-gathered full parameters and of the
            forward/backward compute; None = the sharded parameters' dtype.
            Sharded parameters (fp32 master) and their gradients keep theirs.
        reduce_dtype: dtype gradients are reduce-scattered (and all-reduced)
            in; None = ``param_dtype``.
        output_dtype: dtype floating-point forward outputs are cast to; None
            = no cast.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (torch FSDP2's ``OffloadPolicy``): shards live on the
    mesh's device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live in host memory; the optimizer
    steps there and each unit's shard is copied to the device for its
    all-gather (torch FSDP2's ``CPUOffloadPolicy``).

    Attributes:
        pin_memory: keep the host shards in pinned (page-locked) memory so
            host-to-device copies are asynchronous (only with an accelerator).
    """

    pin_memory: bool = True
