"""Deferred (meta-device) initialization of a unit's modules and the
placement of their buffers, at construction and after a conversion.

See the ``param_init_fn`` protocol in docs/design.md: an object with
``init_rows(param, row_start, row_end, device[, out=])`` lets each unit materialize
only its rank's rows (:func:`rowwise_init`, written straight into the shard when it
takes ``out=``: :func:`rows_fn`); a plain ``fn(module)``
materializes one module at a time (:func:`materialize`).
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn


def _has_meta(m: nn.Module) -> bool:
    tensors = list(m._parameters.values()) + list(m._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


def has_meta_buffers(m: nn.Module) -> bool:
    return any(b is not None and b.is_meta for b in m._buffers.values())


def rowwise_init(param_init_fn) -> bool:
    """Whether ``param_init_fn`` can initialize row ranges of a parameter
    (``param_init_fn.init_rows(param, row_start, row_end, device)``), so each
    rank materializes only its own shard."""
    return param_init_fn is not None and callable(getattr(param_init_fn, "init_rows", None))


def rows_fn(param_init_fn, param: torch.Tensor, device: torch.device) -> Callable:
    """``fn(row_start, row_end, out)`` for a meta ``param``: its rows initialized by
    ``param_init_fn.init_rows``, written into ``out`` (a tensor of the rows' shape and
    ``param.dtype``, e.g. a view of the flat shard) when the initializer takes ``out=``, so no
    transient copy of the rows is made; otherwise a new tensor (``out`` ignored). Either way the
    caller copies the result into ``out`` unless it is ``out``."""
    init_rows = param_init_fn.init_rows
    takes_out = "out" in inspect.signature(init_rows).parameters

    def fn(row_start: int, row_end: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if takes_out and out is not None and out.dtype == param.dtype and out.device == torch.device(device):
            return init_rows(param, row_start, row_end, device, out=out)
        return init_rows(param, row_start, row_end, device)
    return fn


def materialize(modules: list[nn.Module], param_init_fn: Optional[Callable[[nn.Module], None]],
                device: torch.device) -> None:
    """Materialize the meta parameters/buffers that ``modules`` own directly.

    Each module is handled alone (``recurse=False``) so peak memory is one
    unit's full parameters. Tied parameters stay tied: once one owner is
    materialized, every other owner of the same meta tensor gets the new one.

    Raises:
        ValueError: a meta module with neither ``param_init_fn`` nor
            ``reset_parameters``, or meta tensors left after ``param_init_fn``.
    """
    ties: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for attr, p in m._parameters.items():
            if p is not None and p.is_meta:
                ties.setdefault(id(p), []).append((m, attr))
    for m in modules:
        if not _has_meta(m):
            continue
        before = {attr: id(p) for attr, p in m._parameters.items() if p is not None}
        if param_init_fn is not None:
            param_init_fn(m)
        elif hasattr(m, "reset_parameters"):
            m.to_empty(device=device, recurse=False)
            with torch.no_grad():
                m.reset_parameters()
        else:
            raise ValueError(
                f"module {type(m).__name__} has meta-device parameters but no reset_parameters(); "
                "pass param_init_fn=fn(module) to FullyShardedDataParallel to materialize it")
        if _has_meta(m):
            raise ValueError(f"param_init_fn left meta-device tensors on {type(m).__name__}; it must "
                             "materialize the module's own parameters and buffers")
        for attr, old in before.items():
            for other, other_attr in ties.get(old, ()):
                if other is not m or other_attr != attr:
                    other._parameters[other_attr] = m._parameters[attr]


def buffers_of(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [b for m in modules for b in m._buffers.values() if b is not None]


def move_buffers(modules: Iterable[nn.Module], device: torch.device,
                 dtype: Optional[torch.dtype] = None) -> None:
    """Move buffers to ``device``; cast floating-point ones to ``dtype`` if given."""
    for m in modules:
        for name, b in m._buffers.items():
            if b is None:
                continue
            to_dtype = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if b.device != device or b.dtype != to_dtype:
                m._buffers[name] = b.to(device, to_dtype)
