"""Refusing a backward through a graph built before its unit's parameters changed.

[Note: stale graphs]
A unit gathers its full parameters again for backward, into storage whose
version counter the gather does not bump: the views its forward saved must
stay valid across reshard and re-gather (core/unit.py). So autograd's own
check, which makes one process and DDP raise when a tensor saved for
backward was written in place, cannot see an optimizer step that ran between
a forward and the backward of its graph (a graph kept with
``retain_graph=True`` and used again after ``optimizer.step()``, or kept from
an earlier iteration): the backward would silently gather the new parameters
into the old graph, a gradient of no function. So each forward records, per
unit, the optimizer steps that named the unit's parameters, and the unit's
pre-backward hook compares and raises. (Not the shards' version counters:
the engine itself writes some shards in place between a forward and its
backward, an all-gather extension's, say.) Steps are counted per unit, not
per process: a discriminator's step between a generator's forward and its
backward (GAN training) leaves the generator's graph valid, as under DDP. An optimizer stepping inside backward
(post-accumulate-grad hooks) steps a unit after the unit's own backward, so
it never trips the check. ``load_state_dict`` into a unit counts as a step
(:func:`updated`); other in-place writes to the parameters between a
forward and its backward go unseen.
"""
from __future__ import annotations

import weakref

import torch

from . import collectives, optim_hooks, registry

# unit -> optimizer steps that named one of its registered parameters, and loads into it
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# optimizer -> (its parameter groups' structure, _units_of): optim_hooks.per_optimizer
_UNITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _units_of(optimizer: torch.optim.Optimizer) -> list[weakref.ref]:
    """Weak references to the units whose registered parameters ``optimizer`` steps."""
    units = {id(found[0]): weakref.ref(found[0]) for g in optimizer.param_groups for p in g["params"]
             for found in [registry.find(p)] if found is not None}
    return list(units.values())


def _count(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Pre-step callback ([Note: optimizer step hooks]): count the step for each unit it touches (the units
    found once per parameter-group structure, not at every step)."""
    for ref in optim_hooks.per_optimizer(_UNITS, optimizer, _units_of):
        unit = ref()
        if unit is not None:
            _STEPS[unit] = _STEPS.get(unit, 0) + 1


def updated(unit) -> None:
    """``unit``'s shards are being written outside an optimizer step (``load_state_dict``): count it as a step."""
    _STEPS[unit] = _STEPS.get(unit, 0) + 1


def snapshot(unit) -> int:
    """What a forward of ``unit`` ran on: the optimizer steps that named its parameters so far."""
    optim_hooks.add_pre_step("unit steps", _count)
    return _STEPS.get(unit, 0)


def check(unit, seen: int) -> None:
    """Before ``unit``'s backward of a forward that recorded ``seen`` (:func:`snapshot`).

    Raises:
        RuntimeError: an optimizer step or a ``load_state_dict`` updated the unit's parameters since that forward.
    """
    if snapshot(unit) != seen:
        raise RuntimeError(
            f"[rank {collectives.rank()}] unit '{unit.name}': backward through a graph whose forward ran before "
            "the unit's parameters were updated (by an optimizer step or load_state_dict: a graph kept with "
            "retain_graph=True across optimizer.step(), say); run the forward again")
