"""Parameters added to a unit's modules after it sharded them.

[Note: parameters added after sharding]
A unit shards the parameters its modules held when it was built. A trainable parameter registered on them
later (``module.extra = nn.Parameter(...)``, a submodule with parameters assigned into the unit, adapters added
after wrapping) is in no flat shard: no all-gather brings it and no reduce-scatter averages its gradient, so
each rank trains its own copy while ``named_parameters()`` lists it (torch FSDP2 trains it the same way; DDP
averages it). :func:`record` keeps each of a unit's modules with its numbers of parameters and children;
:func:`check`, at the start of each iteration with the view check, compares them and only when one changed
walks that module for trainable parameters that no unit holds and that it did not hold when recorded, and
raises naming the first. Frozen ones are left alone: they get no gradient to average.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch.nn as nn

from . import collectives, registry
from .module import UnitModule


def record(unit, modules: Iterable[nn.Module]) -> None:
    """Remember ``modules`` (those the unit owns: not inside a nested unit) as they are now, on the unit
    (``unit.watched``: its modules, as its slots' owners are, so a deleted model is one collectable cycle)."""
    modules = list(modules)
    known = {id(p) for m in modules for p in m.parameters()}  # ignored modules' and nested units' too
    unit.watched = ([(m, len(m._parameters), len(m._modules)) for m in modules], known)


def _unheld(module: nn.Module, known: set) -> Iterator[str]:
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for attr, p in m._parameters.items():
            if p is not None and p.requires_grad and id(p) not in known and registry.find(p) is None:
                yield f"{prefix}{attr}"
        stack.extend((f"{prefix}{name}.", c) for name, c in m._modules.items()
                     if c is not None and not isinstance(c, UnitModule))


def check(unit) -> None:
    """Raise for a trainable parameter added to one of the unit's modules after :func:`record`.

    Raises:
        RuntimeError: naming the module's class and the parameter.
    """
    rec = getattr(unit, "watched", None)
    if rec is None:
        return
    rows, known = rec
    for i, (m, n_params, n_children) in enumerate(rows):
        if len(m._parameters) == n_params and len(m._modules) == n_children:
            continue
        for name in _unheld(m, known):
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{unit.name}': parameter '{name}' of its {type(m).__name__} was "
                "added after sharding; the unit neither gathers nor reduces it, so each rank would train its own "
                "copy (DDP averages its gradient). Add parameters before wrapping / fully_shard, or freeze it")
        rows[i] = (m, len(m._parameters), len(m._modules))
