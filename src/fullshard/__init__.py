"""fullshard: Fully Sharded Data Parallel training for PyTorch.

Drop-in names for ``torch.distributed.fsdp``::

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fullshard.wrap import ModuleWrapPolicy
"""
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .fsdp import FSDP, FullyShardedDataParallel
from . import wrap

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "CPUOffload", "wrap"]
__version__ = "0.1.0"
