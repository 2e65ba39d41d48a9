"""Dtype casting around a unit's forward: the forward-input caster of a
``MixedPrecision`` policy (``cast_forward_inputs``) and full-precision runs
of units inside a low-precision model (``full_precision_module_classes``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .tree import map_tensors, tensors_in


class _InputCaster:
    """Casts floating-point tensors in a unit's forward inputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return map_tensors(self._cast, args), map_tensors(self._cast, kwargs)


def input_caster(mp, root: bool = False) -> Optional[_InputCaster]:
    """The forward-input caster of a unit (``root``: of the root unit) under a mixed-precision policy, or None."""
    cast = mp.cast_forward_inputs or root and getattr(mp, "cast_root_forward_inputs", False)
    if mp.param_dtype is None or not cast:
        return None
    return _InputCaster(mp.param_dtype)


class FullPrecisionRun:
    """Runs a full-precision unit inside a low-precision model: inputs cast up
    to ``dtype``, floating-point outputs cast back to the dtype of the first
    floating-point input (see ``MixedPrecision.full_precision_module_classes``)."""

    def __init__(self, dtype: torch.dtype):
        self.up = _InputCaster(dtype)

    def __call__(self, fn, args: tuple, kwargs: dict):
        dtypes = [t.dtype for t in tensors_in((args, kwargs)) if t.is_floating_point()]
        args, kwargs = self.up(args, kwargs)
        out = fn(*args, **kwargs)
        if not dtypes or dtypes[0] == self.up.dtype:
            return out
        return map_tensors(_InputCaster(dtypes[0])._cast, out)
