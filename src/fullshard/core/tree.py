"""Finding and mapping the tensors inside a unit's forward inputs and outputs.

Models return more than tuples: namedtuples, dicts, dataclasses and Hugging
Face ``ModelOutput`` (an ``OrderedDict`` that is also a dataclass). The
engine must arm its pre-backward hook on every tensor in an output and cast
every floating-point tensor in an input (``MixedPrecision.cast_forward_inputs``),
whatever container holds it. ``torch.utils._pytree`` does not descend into
unregistered dataclasses, so the walk is ours.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (tensors, lists, tuples, namedtuples, sets,
    mappings, dataclass instances, nested to any depth), depth first."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``.

    Containers are rebuilt with their own type (a shallow copy for mappings
    and dataclasses, so a ``ModelOutput`` stays a ``ModelOutput``); the input
    is never modified. Containers holding no tensor are returned as they are.
    """
    if torch.is_tensor(obj):
        return fn(obj)
    if not any(True for _ in tensors_in(obj)):
        return obj
    if isinstance(obj, Mapping):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = map_tensors(fn, v)
        return out
    if _is_namedtuple(obj):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if dataclasses.is_dataclass(obj):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            # object.__setattr__: frozen dataclasses are rebuilt too.
            object.__setattr__(out, f.name, map_tensors(fn, getattr(obj, f.name, None)))
        return out
    return obj


def plain_tensors(tensors: list) -> list[torch.Tensor]:
    """The tensors with storage behind ``tensors``: plain tensors as they are,
    a traceable tensor subclass (``__tensor_flatten__``: torchao's float8 and
    NF4 weights, all-gather extensions) as its inner tensors, recursively;
    anything else (not a tensor, an opaque subclass) is left out."""
    out = []
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            out.append(t)
        elif hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            out += plain_tensors([getattr(t, n) for n in names])
    return out
