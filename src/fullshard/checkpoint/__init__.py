"""Saved state: state dicts (full, sharded as DTensor; ``state_dict.py``),
optimizer state by name (``optim.py``)."""
from .optim import init_optim_state

__all__ = ["init_optim_state"]
