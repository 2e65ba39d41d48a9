"""The one registry of sharded parameters: for each parameter a live unit
registered, that unit and the :class:`~fullshard.core.params.ParamSlot`
that holds it.

[Note: sharded-parameter registry]
Everything that asks "does fullshard shard this parameter, and where?" asks
here: ``shard_info`` (``core/placement.py``, what ``fullshard.optim`` and
the optimizer guard read), the gradient-norm and ``world_size_invariant``
checks, and construction's refusal to shard a sharded parameter again
(``construct.collect_slots``, ``fully_shard``'s adoption of a replaced
parameter). Units register every slot once their parameters are sharded
(``Unit.__init__``) and again after a slot takes over a replaced parameter
(``ParamSlot.take_over``), so the registry follows the object that is
registered on the modules now; an object replaced is found no more.

Nothing here keeps a model alive: the key is ``id(parameter)`` (parameters
are never held weakly: ``nn.Module._apply`` and ``torch.utils.swap_tensors``
refuse tensors with weak references), the value a weak reference to the
unit and the slot's index. When the unit is freed its entries go with it;
a lookup checks that the slot still holds that very object, so a stale or
reused id finds nothing.
"""
from __future__ import annotations

import weakref
from typing import Optional

# id(registered parameter) -> (weakref of its unit, index of its slot in unit.slots)
_SLOTS: dict[int, tuple[weakref.ref, int]] = {}
# id(original parameter a unit took and replaced by its sharded one) -> (weakref of it, (unit name, its name))
_TAKEN: dict[int, tuple[weakref.ref, tuple[str, str]]] = {}


def register(unit) -> None:
    """Record ``unit`` as the holder of its slots' registered parameters
    (``slot.sharded``), until the unit is freed."""
    keys = [id(slot.sharded) for slot in unit.slots]

    def forget(ref, keys=keys):
        for key in keys:
            if _SLOTS.get(key, (None,))[0] is ref:
                del _SLOTS[key]

    ref = weakref.ref(unit, forget)
    for i, key in enumerate(keys):
        _SLOTS[key] = (ref, i)


def find(param) -> Optional[tuple[object, object]]:
    """``(unit, slot)`` of a parameter a live unit registered, or None."""
    entry = _SLOTS.get(id(param))
    unit = entry[0]() if entry is not None else None
    if unit is None:
        return None
    slots = unit.slots
    i = entry[1]
    if i < len(slots) and slots[i].sharded is param:
        return unit, slots[i]
    return None


def holder(param) -> Optional[str]:
    """The name of the live unit that registered ``param``, or None."""
    found = find(param)
    return found[0].name if found is not None else None


def remember(table: dict, obj, value) -> None:
    """``table[id(obj)] = (weakref to obj, value)``, the entry removed when ``obj`` is freed: a record about
    an object that is never set as an attribute on it (construction's wrapped modules, taken parameters)."""
    key = id(obj)

    def forget(ref, key=key):
        if table.get(key, (None,))[0] is ref:
            del table[key]

    table[key] = (weakref.ref(obj, forget), value)


def recall(table: dict, obj):
    """The value :func:`remember` recorded for this very object (not one of a reused id), or None."""
    entry = table.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


def mark_taken(param, unit: str, fqn: str) -> None:
    """Record that unit ``unit`` took original parameter ``param`` (named ``fqn`` in it) and replaced it; the
    original is held weakly (nothing registers it on a module any more)."""
    remember(_TAKEN, param, (unit, fqn))


def taken(param) -> Optional[tuple[str, str]]:
    """``(unit name, name in the unit)`` of an original parameter a unit took and replaced, or None."""
    return recall(_TAKEN, param)


def size() -> int:
    """Entries held now (live units' parameters, and ones they replaced)."""
    return len(_SLOTS)
