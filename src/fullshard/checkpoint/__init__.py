"""Saved state: state dicts (full, sharded as DTensor, local; ``state_dict.py``
and ``module_hooks.py``), optimizer state by name (``optim.py``), and sharded
checkpoints through ``torch.distributed.checkpoint`` (``save_load.py``)::

    from fullshard import checkpoint
    checkpoint.save("ckpt/step100", model, optimizer, extra={"step": 100})
    extra = checkpoint.load("ckpt/step100", model, optimizer)

``save_load`` is imported on first use: ``torch.distributed.checkpoint``
costs about a second of ``import fullshard`` (start-up speed of the CLI).
"""
import importlib

_LAZY = {"save": "save_load", "load": "save_load", "read_extra": "save_load", "verify": "save_load",
         "CheckpointError": "save_load", "init_optim_state": "optim"}

__all__ = ["save", "load", "read_extra", "verify", "CheckpointError", "init_optim_state"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
