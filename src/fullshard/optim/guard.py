"""The opt-out of the loud error for optimizers that need whole tensors; the
check itself is in ``core/optim_guard.py`` (installed when fullshard builds
its first unit; see its [Note: optimizers that see whole tensors])."""
from __future__ import annotations

from ..core.optim_guard import ELEMENTWISE, ShardedOptimizerError, allow_elementwise, disallow

__all__ = ["ELEMENTWISE", "ShardedOptimizerError", "allow_elementwise", "disallow"]
