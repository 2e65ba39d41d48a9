"""Tensors a unit's forward stored on its modules instead of returning them.

[Note: stored outputs]
A forward may keep a tensor as a module attribute (``self.loss = ...``)
and the user may call ``backward()`` from it. That tensor needs the unit's
pre-backward hook as much as an output does, so both front doors look for
attributes that forward added or replaced. The look costs host time on the
forward's critical path for every unit (a GPU waits on it), so it is done
in C where it can: :func:`snapshot` keeps each module's ``__dict__`` values
as a tuple, and :func:`stored_since` compares them by identity
(``map(operator.is_, ...)``) and walks only a dictionary that changed. A
snapshot holds the old values until the unit's post-forward, so no id in
it can be reused by a new tensor in between.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.nn as nn

Snapshot = list[tuple[dict, tuple]]


def snapshot(modules: Iterable[nn.Module]) -> Snapshot:
    """Each module's attribute dictionary with its values now."""
    return [(d, tuple(d.values())) for d in (m.__dict__ for m in modules)]


def stored_since(snap: Snapshot) -> tuple[torch.Tensor, ...]:
    """Tensors with a ``grad_fn`` that a module of ``snap`` holds now and held
    in no module at the snapshot, in module and attribute order."""
    changed = [d for d, old in snap if len(d) != len(old) or not all(map(operator.is_, d.values(), old))]
    if not changed:
        return ()
    before = {id(v) for _, old in snap for v in old if isinstance(v, torch.Tensor)}
    return tuple(v for d in changed for v in d.values()
                 if isinstance(v, torch.Tensor) and v.grad_fn is not None and id(v) not in before)
