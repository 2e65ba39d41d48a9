"""Parameter and module names as the unwrapped model gives them.

One home for the wrapper's path segments, read by the front doors, state
dicts, the memory report and the optimizers (which may import core only).
"""
from __future__ import annotations

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Module-path segments of our wrappers, absent from the names users see."""


def clean_name(path: str) -> str:
    """A module path as the unwrapped model names it: wrapper segments dropped."""
    return ".".join(s for s in path.split(".") if s not in WRAPPER_SEGMENTS)
