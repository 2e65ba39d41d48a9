"""Gradient bookkeeping of a unit beyond the reduce itself: which parameters
were used in a backward, and the ``no_sync`` stash that must vanish when the
user zeroes gradients.

[Note: no_sync and zero_grad]
Inside ``no_sync`` a unit keeps its unsharded gradient in a stash instead of
reduce-scattering it; under DDP the same gradients sit in ``param.grad``, so
``optimizer.zero_grad()`` discards them. ``torch.optim.Optimizer`` has no
zero-grad hook, so the stash watches the sharded parameters' ``.grad``
instead: where a trainable parameter's ``.grad`` is None when a stash starts,
the stash installs a zero *sentinel* gradient (one flat zero buffer of the
gradient-shard size, viewed per parameter) and records every ``.grad`` it
sees with its version counter. ``zero_grad(set_to_none=True)`` frees a
sentinel, whose ``weakref.finalize`` callback drops the stash at once when
nothing it holds is still wanted; ``zero_grad(set_to_none=False)`` bumps the
version counter, which the next root forward (or the synchronizing backward)
notices. Either way the zeroed parameters' part of the stash is discarded,
as DDP discards ``param.grad``. A sentinel still installed when the stash is
reduced receives the reduced gradient; one whose parameter no rank used is
reset to None, so an unused parameter keeps ``grad None``.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import flat as F


class MarkUsed:
    """Hook on a trainable full-parameter view: records that the parameter
    received a gradient in the current backward. Holds its unit weakly."""

    def __init__(self, unit_ref: weakref.ref, index: int):
        self.unit_ref, self.index = unit_ref, index

    def __call__(self, grad: torch.Tensor) -> None:
        unit = self.unit_ref()
        if unit is not None:
            unit.mark_used(self.index)


def _sentinel_freed(stash_ref: weakref.ref, index: int) -> None:
    stash = stash_ref()
    if stash is not None:
        stash.sentinel_freed(index)


class GradStash:
    """One unit's unsharded gradient summed over ``no_sync`` micro-batches, in
    ``reduce_dtype`` (bf16/fp16 compute must not mean bf16/fp16 accumulation).

    Args:
        unit: the owning :class:`~fullshard.core.unit.Unit` (held weakly).
        full_grad: the first micro-batch's unsharded gradient (param-major,
            ``N·S`` elements); taken from ``.grad``, so ours to keep.
        used: per layout parameter, whether it received a gradient.
    """

    def __init__(self, unit, full_grad: torch.Tensor, used: list[bool]):
        self.unit_ref = weakref.ref(unit)
        self.grad = full_grad.to(unit.reduce_dtype)
        self.used = list(used)
        # index -> (weakref to the .grad seen, its version); None once that
        # gradient was dropped.
        self.watch: dict[int, Optional[tuple[weakref.ref, int]]] = {}
        self._install_watch(unit)

    def _install_watch(self, unit) -> None:
        lay = unit.layout
        missing = [i for i, (sp, p) in enumerate(zip(unit.sharded_params, lay.params))
                   if p.requires_grad and sp.grad is None]
        if missing:
            # One allocation for all sentinels of the unit.
            zeros = torch.zeros(lay.grad_shard_numel, dtype=unit.flat_shard.dtype,
                                device=unit.flat_shard.device)
            views = F.grad_shard_views(zeros, lay, unit.rank)
            for i in missing:
                self._install_sentinel(unit, i, views[i])
        for i, p in enumerate(lay.params):
            if p.requires_grad:
                self._watch(unit, i)

    def _install_sentinel(self, unit, i: int, zeros: torch.Tensor) -> None:
        unit.sharded_params[i].grad = zeros
        unit.sentinels[i] = weakref.ref(zeros)
        weakref.finalize(zeros, _sentinel_freed, weakref.ref(self), i)

    def _watch(self, unit, i: int) -> None:
        sp = unit.sharded_params[i]
        if sp.grad is None:
            self._install_sentinel(unit, i, torch.zeros_like(sp))
        self.watch[i] = (weakref.ref(sp.grad), sp.grad._version)

    def add(self, full_grad: torch.Tensor, used: list[bool]) -> None:
        self.discard_zeroed()
        self.grad.add_(full_grad)
        self.used = [a or b for a, b in zip(self.used, used)]

    def sentinel_freed(self, index: int) -> None:
        """A sentinel gradient was dropped (``zero_grad(set_to_none=True)``):
        when every part of the stash is now unwanted, free it at once."""
        self.watch[index] = None
        if all(self.watch.get(i, (None,)) is None for i, u in enumerate(self.used) if u):
            unit = self.unit_ref()
            if unit is not None and unit._stash is self:
                unit.drop_stash()

    def discard_zeroed(self) -> bool:
        """Zero the stashed gradient of every parameter whose ``.grad`` the
        user zeroed or dropped, and watch its new ``.grad``. Returns True when
        nothing is left to reduce."""
        unit = self.unit_ref()
        lay = unit.layout
        for i, seen in list(self.watch.items()):
            cur = unit.sharded_params[i].grad
            if seen is not None and cur is not None and cur is seen[0]() and cur._version == seen[1]:
                continue
            if self.used[i]:
                p = lay.params[i]
                start = lay.world * p.shard_offset
                self.grad[start:start + lay.world * p.shard_numel].zero_()
                self.used[i] = False
            self._watch(unit, i)
        return not any(self.used)

    def pop(self, full_grad: Optional[torch.Tensor], used: list[bool]) -> tuple[torch.Tensor, list[bool]]:
        """The stash plus ``full_grad`` (None = nothing new), and the union
        of the used flags."""
        self.discard_zeroed()
        if full_grad is not None:
            self.grad.add_(full_grad.to(self.grad.dtype))
        return self.grad, [a or b for a, b in zip(self.used, used)]

    def nbytes(self) -> int:
        return self.grad.numel() * self.grad.element_size()
