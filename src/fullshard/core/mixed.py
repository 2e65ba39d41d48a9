"""Units whose parameters have several dtypes (a bf16 frozen base beside
fp32 LoRA adapters).

[Note: units that mix dtypes]
A :class:`~fullshard.core.unit.Unit` keeps its parameters in one flat shard
of one dtype. A unit whose parameters differ in dtype is a
:class:`MixedUnit`: its own flat shard (``slots``, ``flat_shard``,
``layout``, ``flat_full``, everything gradients touch) holds the parameters
of its *main* dtype, the dtype of its trainable parameters (of its first
parameter when none trains); the parameters of each other dtype form a
frozen *part* (``side``), a plain ``Unit`` with its own flat shard,
all-gather and full views. The part moves with the main unit: every
sharded-state transition of the main unit (unshard, wait, reshard, partial
reshard, views shown or hidden) is applied to the parts too, so the
schedule (core/state.py) drives one unit per front-door module as before.
A part never has a gradient: no gradient buffer, no reduce-scatter, no
optimizer state. Without a ``param_dtype`` each part gathers and computes in
its own dtype (torch FSDP2's behaviour: an fp32 adapter is fp32 inside
forward beside a bf16 base); with one, every part is cast to it.

Code that walks a unit's parameters one slot at a time (state dicts,
``summon_full_params``, conversion, memory accounting) walks
:func:`parts`. Trainable parameters of two dtypes in one unit are refused
(their gradients would need two reduce-scatters; torch FSDP2 refuses them
too), and so is making a part's parameter trainable after sharding.
Frozen parameters of an all-gather-extension subclass (a QLoRA NF4 base)
form one more part, a :class:`~fullshard.core.packed.PackedPart` gathered in
their own packed format (core/packed.py [Note: packed parts]).
"""
from __future__ import annotations

from typing import Iterable

import torch

from . import collectives, packed
from .params import ParamSlot
from .settings import UnitSettings
from .unit import ShardedState, Unit, UnitConfig


def parts(unit: Unit) -> tuple[Unit, ...]:
    """``unit`` and its frozen parts of other dtypes (just ``unit`` unless mixed)."""
    return (unit, *unit.side)


def all_slots(unit: Unit) -> list[ParamSlot]:
    """Every parameter slot of ``unit`` and of its parts."""
    return [s for part in parts(unit) for s in part.slots]


def make_unit(name: str, slots: list[ParamSlot], cfg: UnitConfig, settings: UnitSettings) -> Unit:
    """A :class:`Unit` when ``slots`` share one dtype, else a :class:`MixedUnit`.

    Raises:
        ValueError: trainable parameters of different dtypes.
    """
    if len({s.param.dtype for s in slots}) <= 1 and not any(packed.is_packed(s) for s in slots):
        return Unit(name, slots, cfg, settings)
    return MixedUnit(name, slots, cfg, settings)


def check_dtypes(name: str, slots: list[ParamSlot]) -> None:
    """Refuse trainable parameters of different dtypes, before anything is taken.

    Raises:
        ValueError: two trainable parameters of the unit differ in dtype.
    """
    trainable = [s for s in slots if s.param.requires_grad]
    other = next((s for s in trainable if s.param.dtype != trainable[0].param.dtype), None)
    if other is not None:
        first = trainable[0]
        raise ValueError(
            f"[rank {collectives.rank()}] unit '{name}': trainable parameters '{first.fqn}' ({first.param.dtype}) "
            f"and '{other.fqn}' ({other.param.dtype}) differ in dtype; a unit reduces one gradient dtype: cast the "
            "trainable parameters to one dtype (frozen ones may keep theirs), or shard them in separate units")


def _split(name: str, slots: list[ParamSlot]) -> tuple[list[ParamSlot], list[list[ParamSlot]], list[ParamSlot]]:
    """The main dtype's slots, one list per other dtype (in first-seen order)
    and the packed slots (core/packed.py [Note: packed parts])."""
    check_dtypes(name, slots)
    packs = [s for s in slots if packed.is_packed(s)]
    slots = [s for s in slots if not packed.is_packed(s)]
    trainable = [s for s in slots if s.param.requires_grad]
    main = (trainable or slots)[0].param.dtype if slots else None
    groups: dict[torch.dtype, list[ParamSlot]] = {main: []}
    for s in slots:
        groups.setdefault(s.param.dtype, []).append(s)
    return groups.pop(main), list(groups.values()), packs


class MixedUnit(Unit):
    """A unit whose frozen parameters of other dtypes live in frozen parts
    (see [Note: units that mix dtypes]); the main unit's API is
    :class:`Unit`'s, each state transition applied to every part."""

    def __init__(self, name: str, slots: list[ParamSlot], cfg: UnitConfig, settings: UnitSettings):
        main, others, packs = _split(name, slots)
        self.side = tuple(Unit(name, group, cfg, settings) for group in others)
        if packs:
            self.side += (packed.PackedPart(name, packs, cfg, settings),)
        super().__init__(name, main, cfg, settings)

    def _each(self, states: Iterable[ShardedState]) -> list[Unit]:
        return [p for p in self.side if p.state in states]

    def unshard(self, after=None) -> None:
        super().unshard(after)
        for p in self._each((ShardedState.SHARDED,)):
            p.unshard(after)

    def wait_unshard(self) -> None:
        super().wait_unshard()
        for p in self._each((ShardedState.SHARDED, ShardedState.UNSHARDING)):
            p.ensure_unsharded()

    def use_full_params(self, grad=None) -> None:
        super().use_full_params(grad)
        for p in self.side:
            p.use_full_params(grad)

    def hide_full_params(self) -> None:
        super().hide_full_params()
        for p in self.side:
            p.hide_full_params()

    def reshard(self) -> None:
        super().reshard()
        for p in self._each((ShardedState.UNSHARDED, ShardedState.UNSHARDING)):
            p.reshard()

    def reshard_partial(self) -> None:
        super().reshard_partial()
        for p in self._each((ShardedState.UNSHARDED,)):
            p.reshard_partial()

    def drop_partial(self) -> None:
        super().drop_partial()
        for p in self.side:
            p.drop_partial()

    def keep_unsharded(self) -> None:
        super().keep_unsharded()
        for p in self.side:
            p.keep_unsharded()

    def kept_fresh(self) -> bool:
        return super().kept_fresh() and all(p.kept_fresh() for p in self.side)

    def kept_stale(self) -> bool:
        return super().kept_stale() or any(p.kept_stale() for p in self.side)

    def check_views(self) -> None:
        super().check_views()
        for p in self.side:
            p.check_views()

    def reset_views(self) -> None:
        super().reset_views()
        for p in self.side:
            p.reset_views()

    def restore_all_params(self) -> None:
        super().restore_all_params()
        for p in self.side:
            p.restore_all_params()

    def unsharded_bytes(self) -> int:
        return super().unsharded_bytes() + sum(p.unsharded_bytes() for p in self.side)

    def refresh_requires_grad(self) -> bool:
        """:meth:`Unit.refresh_requires_grad`; a part's parameter made trainable is refused.

        Raises:
            RuntimeError: a parameter of another dtype than the unit's
                trainable ones now requires grad.
        """
        for p in self.side:
            turned = next((s for s in p.slots if s.sharded.requires_grad), None)
            if turned is not None:
                raise RuntimeError(
                    f"[rank {collectives.rank()}] unit '{self.name}': parameter '{turned.fqn}' "
                    f"({turned.sharded.dtype}) was made trainable after sharding, but the unit trains "
                    f"{self.flat_shard.dtype} parameters only; set requires_grad before sharding, or cast it to "
                    f"{self.flat_shard.dtype} before sharding")
        return super().refresh_requires_grad()
