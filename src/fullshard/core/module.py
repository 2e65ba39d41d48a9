"""The base class of every module that fronts a unit, and the one way to
find units in a model.

``FullyShardedDataParallel`` (the FSDP1-style wrapper) derives from
:class:`UnitModule`; layers above the engine (state dicts, checkpoints,
``memory_stats``) find units through :func:`unit_modules` and never import a
front door, so the package graph stays one-way (``docs/design.md``).
"""
from __future__ import annotations

import torch.nn as nn


class UnitModule(nn.Module):
    """A module that owns one unit of the engine.

    Subclasses set ``_runtime`` (a :class:`fullshard.core.state.UnitRuntime`)
    before use; :attr:`unit` is its :class:`fullshard.core.unit.Unit`.
    """

    dtensor_params: bool = False
    """True for ``fully_shard`` modules: parameters are DTensors and state
    dicts are ``nn.Module``'s (torch FSDP2's contract), so the FSDP1
    state-dict helpers (``checkpoint/``) do not apply to them."""

    @property
    def unit(self):
        """The :class:`fullshard.core.unit.Unit` this module fronts."""
        return self._runtime.unit

    def _lazy_init(self) -> None:
        """Make this unit the root of the units below it unless it already
        belongs to a root (each front door defines it)."""
        raise NotImplementedError


def unit_modules(model: nn.Module, root_only: bool = False) -> list[UnitModule]:
    """Every :class:`UnitModule` in ``model`` (itself included), in module
    order; with ``root_only`` only those not nested in another one."""
    # One per unit: the modules of one fully_shard([a, b]) call share a runtime.
    seen: set[int] = set()
    units = [m for m in model.modules() if isinstance(m, UnitModule)
             and not (id(m._runtime) in seen or seen.add(id(m._runtime)))]
    if root_only:
        nested = {id(n) for u in units for n in u.modules() if n is not u}
        units = [u for u in units if id(u) not in nested]
    return units
