"""The settings each ``FullyShardedDataParallel`` unit exposes, as torch
FSDP1's instances do (``unit.cpu_offload``, ``unit.backward_prefetch``, ...).

Each reports what that unit runs with: a child made by ``wrap(child,
cpu_offload=...)`` inside ``enable_wrap`` reports its own policy, a
full-precision norm unit its full-precision ``MixedPrecision``. The two
prefetch settings are read by the schedule at every use, so assigning them
(as torch allows) changes the unit's behaviour; the others are fixed at
construction and refuse assignment (an ``AttributeError``) instead of
pretending to change.
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .core import collectives


def check_prefetch(backward_prefetch, forward_prefetch, where: str) -> None:
    """Raises ValueError: ``backward_prefetch`` not a :class:`BackwardPrefetch`
    or None, or ``forward_prefetch`` not a bool."""
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise ValueError(f"{where}: backward_prefetch must be a fullshard.BackwardPrefetch or None, "
                         f"got {backward_prefetch!r}")
    if not isinstance(forward_prefetch, bool):
        raise ValueError(f"{where}: forward_prefetch must be a bool, got {forward_prefetch!r}")


class FSDP1Attributes:
    """Mixin of ``FullyShardedDataParallel``: torch FSDP1's public per-instance
    attributes. Needs ``_runtime``, ``_strategy`` and ``_mixed_precision``;
    the prefetch knobs are the unit's ``core.settings.UnitSettings``."""

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The :class:`ShardingStrategy` this unit was built with."""
        return self._strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        """This unit's :class:`MixedPrecision` (``MixedPrecision()`` when none
        was given; the full-precision policy on a ``full_precision_module_classes`` unit)."""
        return self._mixed_precision

    @property
    def cpu_offload(self) -> CPUOffload:
        """This unit's :class:`CPUOffload` (``CPUOffload()`` when none was given)."""
        return CPUOffload(offload_params=self._runtime.unit.cfg.offload_params)

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        """When this unit's backward issues the next unit's all-gather; assignable."""
        return self._runtime.settings.backward_prefetch

    @backward_prefetch.setter
    def backward_prefetch(self, value: Optional[BackwardPrefetch]) -> None:
        check_prefetch(value, self._runtime.settings.forward_prefetch, f"unit '{self._runtime.unit.name}'")
        self._runtime.settings.backward_prefetch = value

    @property
    def forward_prefetch(self) -> bool:
        """Whether this unit's forward issues the next unit's all-gather first; assignable."""
        return self._runtime.settings.forward_prefetch

    @forward_prefetch.setter
    def forward_prefetch(self, value: bool) -> None:
        check_prefetch(self._runtime.settings.backward_prefetch, value, f"unit '{self._runtime.unit.name}'")
        self._runtime.settings.forward_prefetch = value

    @property
    def process_group(self):
        """The group passed to (or defaulted by) the constructor, as torch FSDP1
        reports it: the shard group (HYBRID_SHARD: within a node), or for
        NO_SHARD the group gradients are all-reduced over."""
        cfg = self._runtime.unit.cfg
        return cfg.replicate_group if self._strategy is ShardingStrategy.NO_SHARD else cfg.shard_group

    @property
    def rank(self) -> int:
        """This rank's index in :attr:`process_group`."""
        return collectives.group_rank(self.process_group)

    @property
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""
        return collectives.group_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        """The device forward and backward run on."""
        return self._runtime.unit.cfg.compute_device
