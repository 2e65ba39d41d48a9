"""Saved state: state dicts (full, sharded as DTensor; ``state_dict.py``),
optimizer state by name (``optim.py``), and sharded checkpoints through
``torch.distributed.checkpoint`` (``save_load.py``)::

    from fullshard import checkpoint
    checkpoint.save("ckpt/step100", model, optimizer, extra={"step": 100})
    extra = checkpoint.load("ckpt/step100", model, optimizer)
"""
from .optim import init_optim_state
from .save_load import CheckpointError, load, read_extra, save, verify

__all__ = ["save", "load", "read_extra", "verify", "CheckpointError", "init_optim_state"]
