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

from . import flat, torch_private


class UnflattenFull(torch.autograd.Function):
    """Full-parameter views of a unit's unsharded flat parameter whose
    backward writes the unit's full gradient into a pooled buffer.

    [Note: pooled full gradient]
    ``split_with_sizes`` views would do, but their backward concatenates the
    parameters' gradients into a fresh ``N·S``-element tensor every backward
    (``SplitWithSizesBackward``): on the host that is one unit-sized malloc
    and free per unit per iteration, the allocations that keep glibc's heap
    large (see core/buffers.py [Note: buffer reuse]). Here the backward copies
    each gradient into a buffer from the pool (zeros where a parameter got no
    gradient, and in the padding) and returns it; ``AccumulateGrad`` adopts
    it as ``flat_full.grad`` without a copy when the unit has no gradient yet,
    and the unit hands it back after the reduce-scatter's input is written
    (``Unit.release_full_grad``). All views still meet in this one node, so
    the post-accumulate-grad hook runs once per backward, as before. The node
    also records which parameters received a gradient (``Unit.mark_used``).

    Inputs: ``flat_full`` (1-D, param-major, ``N·S`` elements), a weak
    reference to the unit, the layout. Outputs: one view per layout
    parameter, in its full shape.
    """

    @staticmethod
    def forward(ctx, flat_full, unit_ref, layout):
        ctx.unit_ref, ctx.layout = unit_ref, layout
        ctx.set_materialize_grads(False)
        return tuple(flat.unsharded_views(flat_full, layout))

    @staticmethod
    def backward(ctx, *grads):
        layout, unit = ctx.layout, ctx.unit_ref()
        like = next((g for g in grads if g is not None), None)
        if like is None:
            return None, None, None
        if unit is None:  # the model is gone; any correct gradient will do
            out = torch.zeros(layout.unsharded_numel, dtype=like.dtype, device=like.device)
        else:
            out = unit.take_grad_buffer(like.dtype, like.device)
        with torch.no_grad():  # the reduce path is not differentiable either
            zero, dst, src = [], [], []
            end = max((p.full_offset + p.full_span for p in layout.params), default=0)
            if end < out.numel():  # past the owned parameters (flat.py [Note: flat layouts])
                zero.append(out[end:])
            for i, (p, g) in enumerate(zip(layout.params, grads)):
                seg = out[p.full_offset:p.full_offset + p.full_span]
                if g is None:
                    zero.append(seg)
                else:
                    if unit is not None:
                        unit.mark_used(i)
                    dst.append(seg[:p.numel].view(p.shape))
                    src.append(g)
                    if p.full_span > p.numel:
                        zero.append(seg[p.numel:])
            if dst:
                torch_private.foreach_copy_(dst, src)
            if zero:
                torch_private.foreach_zero_(zero)
        return out, None, None


def set_grad(slot, grad: torch.Tensor) -> torch.Tensor:
    """Install ``grad`` (plain, this rank's shard) as the registered
    parameter's ``.grad`` of ``slot`` (a :class:`~fullshard.core.params.ParamSlot`;
    wrapped as a DTensor like the parameter under ``fully_shard``), also when
    its dtype differs from the parameter's
    (``MixedPrecision.keep_low_precision_grads``: fp32 master, bf16
    gradient). Autograd refuses such an assignment, so a placeholder of the
    parameter's dtype and shape (one element, expanded) is installed and its
    ``.data`` swapped for ``grad``, as torch FSDP1 does.

    Returns:
        The tensor now at ``.grad`` (the placeholder when the dtypes differ;
        it shares ``grad``'s memory).
    """
    param = slot.sharded
    if grad.dtype == param.dtype:
        param.grad = slot.grad_like(grad)
        return param.grad
    holder = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
    param.grad = holder
    holder.data = grad
    return holder


def add_to_grad(slot, grad: torch.Tensor, dtype: torch.dtype) -> None:
    """``.grad += grad`` for ``slot``'s registered parameter, with the result
    in ``dtype``. ``grad`` (plain) is in the accumulation dtype (the master
    dtype), so a low-precision ``.grad`` is summed in it and rounded once; an
    existing ``.grad`` keeps its identity when it already has ``dtype``."""
    cur = slot.grad()
    if cur is None:
        set_grad(slot, grad.to(dtype))
    elif cur.dtype == dtype:
        cur.add_(grad)  # computed in the wider dtype, rounded once on store
    else:
        slot.sharded.grad.data = grad.add(cur).to(dtype)


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
        # world_size_invariant: later micro-batches kept apart as [grad, used]
        # (their fold order interleaves other ranks' micro-batches); None: summed.
        self.later: Optional[list[list]] = [] if unit.cfg.invariant_layout is not None else None
        self.first_used = list(used)
        # index -> (weakref to the .grad seen, its version); None once that
        # gradient was dropped.
        self.watch: dict[int, Optional[tuple[weakref.ref, int]]] = {}
        self._install_watch(unit)

    def _install_watch(self, unit) -> None:
        lay = unit.layout
        missing = [i for i, (slot, p) in enumerate(zip(unit.slots, lay.params))
                   if p.requires_grad and slot.sharded.grad is None]
        if missing:
            # One allocation for all sentinels of the unit.
            zeros = torch.zeros(lay.grad_shard_numel, dtype=unit.grad_dtype, device=unit.flat_shard.device)
            views = flat.grad_shard_views(zeros, lay, unit.rank)
            for i in missing:
                self._install_sentinel(unit, i, views[i])
        for i, p in enumerate(lay.params):
            if p.requires_grad:
                self._watch(unit, i)

    def _install_sentinel(self, unit, i: int, zeros: torch.Tensor) -> None:
        installed = set_grad(unit.slots[i], zeros)
        unit.sentinels[i] = weakref.ref(installed)
        weakref.finalize(installed, _sentinel_freed, weakref.ref(self), i)

    def _watch(self, unit, i: int) -> None:
        slot = unit.slots[i]
        if slot.sharded.grad is None:
            self._install_sentinel(unit, i, torch.zeros_like(slot.local, dtype=unit.grad_dtype))
        grad = slot.sharded.grad
        self.watch[i] = (weakref.ref(grad), torch_private.version_counter(grad))

    def add(self, full_grad: torch.Tensor, used: list[bool]) -> None:
        self.discard_zeroed()
        if self.later is not None:
            self.later.append([full_grad.to(self.grad.dtype), list(used)])
        else:
            self.grad.add_(full_grad)
        self.used = [a or b for a, b in zip(self.used, used)]

    def tensors(self) -> list[torch.Tensor]:
        """Every stashed gradient tensor (one, or one per micro-batch)."""
        return [self.grad] + [g for g, _ in self.later or ()]

    def micro_batches(self) -> list[tuple[torch.Tensor, list[bool]]]:
        """world_size_invariant: each stashed micro-batch's (gradient, used
        flags), in order, after discarding what the user zeroed."""
        self.discard_zeroed()
        return [(self.grad, self.first_used)] + [(g, u) for g, u in self.later]

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
            if seen is not None and cur is not None and cur is seen[0]() and \
                    torch_private.version_counter(cur) == seen[1]:
                continue
            if self.used[i]:
                p = lay.params[i]
                for t in self.tensors():
                    t[p.full_offset:p.full_offset + p.full_span].zero_()
                self.used[i] = self.first_used[i] = False
                for part in self.later or ():
                    part[1][i] = False
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
        return sum(t.numel() * t.element_size() for t in self.tensors())
