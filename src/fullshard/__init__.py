"""fullshard: Fully Sharded Data Parallel training for PyTorch.

Drop-in names for ``torch.distributed.fsdp``::

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fullshard.wrap import ModuleWrapPolicy
"""
from . import optim, wrap
from .activation_checkpointing import CheckpointWrapper, apply_activation_checkpointing, offload_activations
from .amp import ShardedGradScaler
from .api import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from .core.norms import clip_grad_norm_
from .core.placement import BlockShard, Owned, RowShard, shard_info
from .forward_methods import register_fsdp_forward_method
from .fsdp import FSDP, FullyShardedDataParallel
from .fsdp2 import FSDPModule, UnshardHandle, fully_shard
from .memory import memory_stats
from .optim import OffloadAdamW

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "CPUOffload", "StateDictType", "FullStateDictConfig",
           "ShardedStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "LocalStateDictConfig", "LocalOptimStateDictConfig", "ShardedGradScaler",
           "apply_activation_checkpointing", "CheckpointWrapper", "offload_activations", "memory_stats", "wrap",
           "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "register_fsdp_forward_method", "clip_grad_norm_", "RowShard", "BlockShard", "Owned", "shard_info",
           "optim", "OffloadAdamW"]
__version__ = "0.1.0"
