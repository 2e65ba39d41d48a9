"""A loud error for a backward that reads parameters ``set_unshard_in_backward(False)`` left unsharded.

A unit that is not gathered for its backward has freed the storage of its
full parameters (``flat_full``) by then. Autograd does not check saved
tensors against their storage's size: a backward that reads a saved full
parameter (a ``Linear``'s ``weight``, a gate multiplied in) reads freed
memory, which crashes the process or raises an error naming no unit. While
such a unit runs forward, saved-tensor hooks mark every tensor saved for
backward that views its full parameters; unpacking one while the storage is
empty raises one error naming the rank, the unit and the fix. Tensors that
do not view the unit's parameters (an embedding's indices) pass unchanged.
"""
from __future__ import annotations

import weakref

import torch

from . import collectives
from .params import local_of

_ACTIVE: list = []  # units in forward with the guard on, innermost last
_HOOKS: list = []  # the pushed saved_tensors_hooks context while _ACTIVE is not empty


class _Saved:
    """A saved tensor that views a guarded unit's full parameters."""

    __slots__ = ("tensor", "unit_ref")

    def __init__(self, tensor: torch.Tensor, unit):
        self.tensor = tensor
        self.unit_ref = weakref.ref(unit)


def _storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage; 0 when it is empty or ``t`` has none."""
    try:
        storage = local_of(t).untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, other subclasses)
        return 0
    return storage.data_ptr() if storage.nbytes() else 0


def _pack(t: torch.Tensor):
    ptr = _storage_ptr(t)
    if ptr:
        for unit in _ACTIVE:
            if ptr == _storage_ptr(unit.flat_full):
                return _Saved(t, unit)
    return t


def _unpack(packed):
    if not isinstance(packed, _Saved):
        return packed
    if not _storage_ptr(packed.tensor):
        unit = packed.unit_ref()
        name = unit.name if unit is not None else "?"
        raise RuntimeError(
            f"[rank {collectives.rank()}] unit '{name}': its backward reads full parameters that "
            "set_unshard_in_backward(False) left unsharded; call set_unshard_in_backward(True) on it (False is "
            "only for modules whose backward needs no parameters, such as nn.Embedding)")
    return packed.tensor


def enter(unit) -> None:
    """Guard the tensors ``unit``'s forward saves until :func:`leave` (no-op if already guarded)."""
    if any(u is unit for u in _ACTIVE):
        return
    _ACTIVE.append(unit)
    if len(_ACTIVE) == 1:
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        _HOOKS.append(hooks)


def leave(unit) -> None:
    """End :func:`enter` of ``unit`` (forward returned or raised); no-op if not guarded."""
    for i in range(len(_ACTIVE) - 1, -1, -1):
        if _ACTIVE[i] is unit:
            del _ACTIVE[i]
            break
    if not _ACTIVE and _HOOKS:
        _HOOKS.pop().__exit__(None, None, None)
