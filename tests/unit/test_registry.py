"""The one registry of sharded parameters (``core/registry.py`` [Note:
sharded-parameter registry]): a parameter finds its unit and slot while the
unit lives, the registry follows a slot that takes over a replaced
parameter, and it keeps neither units nor parameters alive."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

from fullshard.core import registry
from fullshard.core.params import ParamSlot


class _Unit:
    """What the registry reads of a unit: ``name`` and ``slots``."""

    def __init__(self, name: str, n: int):
        self.name = name
        self.slots = [ParamSlot(f"w{i}", None, [], sharded=nn.Parameter(torch.zeros(2))) for i in range(n)]


def test_find_holder_and_stray_parameters():
    unit = _Unit("layers.0", 3)
    registry.register(unit)
    for slot in unit.slots:
        assert registry.find(slot.sharded) == (unit, slot)
        assert registry.holder(slot.sharded) == "layers.0"
    stray = nn.Parameter(torch.zeros(2))
    assert registry.find(stray) is None and registry.holder(stray) is None


def test_follows_take_over_and_reregistration():
    unit = _Unit("enc", 2)
    registry.register(unit)
    old, new = unit.slots[1].sharded, nn.Parameter(torch.ones(2))
    unit.slots[1].sharded = new  # what ParamSlot.take_over does to the slot
    assert registry.find(old) is None  # no longer registered on the modules
    assert registry.find(new) is None  # not registered until the unit says so
    registry.register(unit)
    assert registry.find(new) == (unit, unit.slots[1])
    assert registry.find(unit.slots[0].sharded) == (unit, unit.slots[0])
    assert registry.find(old) is None


def test_freed_unit_leaves_nothing_and_frees_its_parameters():
    gc.collect()
    before = registry.size()
    unit = _Unit("dec", 4)
    registry.register(unit)
    registry.register(unit)  # re-registered (adoption): still freed with the unit
    params = [weakref.ref(s.sharded) for s in unit.slots]
    unit_ref = weakref.ref(unit)
    assert registry.size() == before + 4
    del unit  # no collection needed: the registry holds no strong reference
    assert unit_ref() is None and all(p() is None for p in params)
    assert registry.size() == before


def test_live_parameter_of_a_freed_unit_is_not_found():
    unit = _Unit("head", 1)
    registry.register(unit)
    kept = unit.slots[0].sharded  # an optimizer may outlive the model
    del unit
    assert registry.find(kept) is None and registry.holder(kept) is None
