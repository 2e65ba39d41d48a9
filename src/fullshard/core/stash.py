"""A unit's ``no_sync`` stash: the unsharded gradients of the micro-batches
since the last synchronizing backward, kept instead of reduce-scattered,
and the sentinel gradients that let ``zero_grad`` discard them.

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

[Note: no_sync under world_size_invariant]
The synchronizing backward folds a unit's stashed micro-batches one by one
(one all-to-all each, core/invariant.py), so every rank must fold as many.
The count is made equal by construction, with no host read (it cost one
all-reduce and one read per unit before): each unit counts the backwards that
ended in its accumulation window (``backwards``, the same on every rank, as
every rank runs the same backwards: the user's contract of
world_size_invariant, one micro-batch per backward); a backward's gradient is
stashed under its index, a backward that reached the unit twice gives one
micro-batch (the sum of both, as under DDP), and one that did not reach it
on this rank gives a zero micro-batch with no parameter used. The fold then
adds micro-batch ``j`` of every rank for ``j`` in ``range(backwards)``, in
the order of [Note: world-size invariance]. A rank that ran fewer backwards
in the window than the others (a user's mistake) would fold fewer times, and
its folds would pair with other units' (the same size for identical blocks:
silently wrong gradients). So every fold carries its sender's count
(``folding``, a few elements after each rank's piece, never added to the
gradient) and compares what arrived with its own on the device, with no host
read (invariant._check_count). Every rank receives every rank's count in the
window's first fold of the first unit folded, so all raise there, with one
line; before that fold no collective differs when the window's forwards and
backwards run none (NO_SHARD, units kept unsharded). Where they run
all-gathers (FULL_SHARD, SHARD_GRAD_OP) the extra forward's all-gathers meet
the other ranks' folds first: a collective mismatch the process group
reports (gloo aborts on the size check) or a hang, as under torch FSDP.

[Note: held sums and zero_grad]
Under HSDP with ``set_requires_all_reduce(False)`` a unit reduce-scatters each
micro-batch over its shard group but holds the sums back
(``Unit.partial_out``) instead of all-reducing them over the replicas, so
``.grad`` is written only by the window's last backward. Under DDP the same
micro-batches sit in ``param.grad``, where ``zero_grad()`` discards them
(torch FSDP2's ``zero_grad`` does not reach its partial reduce output). So the
held sums are watched as a stash is: when sums are first held, trainable
parameters whose ``.grad`` is None get a zero sentinel, and every ``.grad``
is recorded with its version counter. At the next root forward, and before
the next reduce adds into the sums, a parameter whose ``.grad`` was dropped,
replaced or written since has its part of the sums (its gradient elements
and its used flag) zeroed; when every trainable parameter's part is zeroed,
the sums are dropped. Until a synchronizing reduce writes ``.grad``, the
sums it took (and a stash it took) stay watched: a backward that raises
before then loses them, and the next root forward says so
(:func:`lost_windows`).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import collectives, flat, grads, invariant, offload, torch_private


class GradStash:
    """The ``no_sync`` stash of one unit, which owns it (``unit.stash``):
    the current accumulation :class:`Window` (None outside one) and the
    sentinel gradients a window installed, which the next reduce takes.

    Args:
        unit: the owning :class:`~fullshard.core.unit.Unit` (held weakly).
    """

    def __init__(self, unit):
        self.unit_ref = weakref.ref(unit)
        self.window: Optional[Window] = None
        # Zero gradients a window installed on sharded parameters (layout
        # index -> weakref); see [Note: no_sync and zero_grad].
        self.sentinels: dict[int, weakref.ref] = {}
        # world_size_invariant: backwards ended in this unit's accumulation window
        # (see [Note: no_sync under world_size_invariant]).
        self.backwards = 0
        # The backwards of the window the last pop folded: every fold of it carries this count.
        self.folding = 0
        # HSDP, set_requires_all_reduce(False): layout index -> (weakref to the .grad seen, its version) while
        # replica sums are held back, the sentinels installed for them, and the parameters whose part of the
        # sums was zeroed since sums last arrived; see [Note: held sums and zero_grad].
        self.held: dict[int, tuple[weakref.ref, int]] = {}
        self.held_sentinels: dict[int, weakref.ref] = {}
        self.held_zeroed: set[int] = set()
        # The watched .grad of the parameters whose stash or held sums a synchronizing reduce took, until that
        # reduce writes .grad: a backward that raises before then drops the reduce (lost_windows).
        self.taken: dict[int, Optional[tuple[weakref.ref, int]]] = {}

    @property
    def active(self) -> bool:
        """Whether gradients wait in the stash."""
        return self.window is not None

    def add(self, full_grad: torch.Tensor, used: list[bool]) -> None:
        """Keep a micro-batch's unsharded gradient (param-major, ``N·S``
        elements) and its used flags for a later reduce."""
        if self.window is None:
            self.window = Window(self.unit_ref(), full_grad, used, self.backwards)
        else:
            self.window.add(full_grad, used, self.backwards)

    def end_backward(self, stashing: bool) -> None:
        """A backward ended; ``stashing``: the unit stashed in it (no_sync, or
        its gradient sync off). Counted under world_size_invariant only."""
        unit = self.unit_ref()
        if stashing and unit.cfg.invariant_layout is not None and unit.needs_grad:
            self.backwards += 1

    def holds(self, full_grad: torch.Tensor) -> bool:
        """Whether the stash keeps ``full_grad``'s memory (it adopts the first
        micro-batch's gradient when no cast is needed)."""
        return self.window is not None and any(
            t.untyped_storage().data_ptr() == full_grad.untyped_storage().data_ptr() for t in self.window.tensors())

    def pop(self, full_grad: Optional[torch.Tensor], used: list[bool]) -> tuple[Optional[torch.Tensor], list[bool]]:
        """``full_grad`` plus whatever :meth:`add` kept, and the union of the
        used flags; the stash is emptied. Under world_size_invariant the
        window's micro-batches are folded here instead, one per backward of
        the window (on every rank as many: [Note: no_sync under
        world_size_invariant]), and ``full_grad`` is returned as it is."""
        unit = self.unit_ref()
        window, self.window = self.window, None
        if unit.cfg.invariant_layout is not None:
            count, self.backwards = self.backwards, 0
            self.folding = count
            _fold(unit, window, count)
            return full_grad, used
        if window is None:
            return full_grad, used
        out = window.pop(full_grad, used)
        self.taken.update((i, seen) for i, seen in window.watch.items() if window.used[i])
        return out

    def check(self) -> None:
        """Drop the parts of the stash, and of the held replica sums, whose gradients the user zeroed."""
        if self.window is not None and self.window.discard_zeroed():
            self.discard()
        if self.held:
            self.check_held()

    def hold(self, out: torch.Tensor) -> None:
        """HSDP under ``set_requires_all_reduce(False)``: keep ``out`` (this
        rank's reduced block: the gradient shard, then one used flag per layout
        parameter) as the replica sums held back, ``Unit.partial_out``, and
        watch the trainable parameters' ``.grad`` ([Note: held sums and zero_grad])."""
        unit = self.unit_ref()
        unit.partial_out = out
        self.held_zeroed = set()
        if self.held:  # watched since the window's first held sums
            return
        trainable = [i for i, slot in enumerate(unit.slots) if slot.layout.requires_grad]
        installed = _install_zeros(unit, [i for i in trainable if unit.slots[i].sharded.grad is None])
        self.held_sentinels = {i: weakref.ref(g) for i, g in installed.items()}
        self.held = {i: _seen(unit.slots[i].sharded.grad) for i in trainable}

    def check_held(self) -> None:
        """Zero the held replica sums of every parameter whose ``.grad`` the
        user dropped, replaced or wrote since they were recorded, and drop the
        sums once every trainable parameter's part is zeroed."""
        unit = self.unit_ref()
        changed = [i for i, seen in self.held.items() if _changed(unit, i, seen)]
        if not changed:
            return
        self.held_zeroed.update(changed)
        if self.held_zeroed.issuperset(self.held):
            self.drop_held()
            return
        out, n_grad = unit.partial_out, unit.layout.grad_shard_numel
        views = flat.grad_shard_views(out[:n_grad], unit.layout, unit.rank)
        for i in changed:
            views[i].zero_()
            out[n_grad + i].zero_()
            if unit.slots[i].sharded.grad is None:
                self.held_sentinels[i] = weakref.ref(_install_zero(unit, i))
            self.held[i] = _seen(unit.slots[i].sharded.grad)

    def release_held(self) -> None:
        """The held sums were taken into the window's all-reduce: stop watching (the sentinels stay for the
        reduce that writes the gradients, :meth:`take_sentinels`)."""
        self.taken.update((i, seen) for i, seen in self.held.items() if i not in self.held_zeroed)
        self.held, self.held_zeroed = {}, set()

    def drop_held(self) -> None:
        """Forget the held replica sums (zeroed by the user, an interrupted window, ``reset_iter_state``) and
        take back sentinel gradients still installed for them."""
        unit = self.unit_ref()
        unit.partial_out = None
        for i, ref in self.held_sentinels.items():
            unit.slots[i].drop_sentinel(ref)
        self.held, self.held_sentinels, self.held_zeroed = {}, {}, set()

    def abandon(self) -> None:
        """Forget the stash and the window's backwards (an interrupted iteration, reset_iter_state)."""
        self.discard()
        self.backwards = 0
        self.taken = {}

    def lost(self) -> bool:
        """After a backward that raised: whether gradients the user did not zero since are lost with it: a
        stash or held sums still waiting, or taken into a reduce that never wrote ``.grad``."""
        self.check()  # gradients zeroed since are dropped as usual
        return self.active or self.unit_ref().partial_out is not None or \
            not all(seen is None or _changed(self.unit_ref(), i, seen) for i, seen in self.taken.items())

    def discard(self) -> None:
        """Forget the stash and take back sentinel gradients still installed;
        the window's backwards are still counted (their micro-batches fold as zeros)."""
        self.window = None
        unit = self.unit_ref()
        for i, ref in self.sentinels.items():
            unit.slots[i].drop_sentinel(ref)
        self.sentinels = {}

    def take_sentinels(self) -> dict[int, weakref.ref]:
        """The sentinels installed so far (a window's and held sums'), for the
        reduce that writes the gradients (a sentinel no rank filled goes back to None there)."""
        sentinels = {**self.held_sentinels, **self.sentinels}
        self.sentinels, self.held_sentinels, self.taken = {}, {}, {}
        return sentinels

    def nbytes(self) -> int:
        """Bytes of the stash's storage (0 without a stash)."""
        return 0 if self.window is None else sum(t.untyped_storage().nbytes() for t in self.window.tensors())


def lost_windows(units: list) -> list[str]:
    """After a backward that raised: the units whose accumulation window (a ``no_sync`` stash, or replica
    sums held back by ``set_requires_all_reduce(False)``) holds gradients the user did not zero since, or
    was taken into a synchronizing reduce that never wrote ``.grad``. The failed micro-batch reached some
    units' windows and not others', so what they hold is no sum of whole micro-batches."""
    return [unit.name for unit in units if unit.stash.lost()]


def refuse_lost(names: list[str], units: list) -> None:
    """Raise once for :func:`lost_windows`' units, whose stashes the caller has discarded, after setting
    every trainable parameter's ``.grad`` of ``units`` to None (a synchronizing reduce that landed before the
    backward raised wrote the window's sums into some of them), as ``zero_grad()`` does.

    Raises:
        RuntimeError: ``names`` is not empty.
    """
    if not names:
        return
    for unit in units:
        for slot in unit.slots:
            if slot.layout.requires_grad:
                slot.sharded.grad = None
    raise RuntimeError(
        f"[rank {collectives.rank()}] a backward raised inside a gradient accumulation window (no_sync(), "
        f"set_requires_gradient_sync(False) or set_requires_all_reduce(False)): the window's micro-batches "
        f"were discarded (units {names}) and every gradient set to None, as zero_grad() does; run the window "
        "again from its first micro-batch")


def _fold(unit, window: Optional[Window], count: int) -> None:
    """world_size_invariant: fold the micro-batches of the window's ``count``
    backwards of ``unit`` in order (one all-to-all each; zeros for a backward
    that did not reach the unit on this rank)."""
    if window is not None:
        parts = window.micro_batches(count)
    else:
        parts = [(None, [False] * len(unit.layout.params))] * count
    for grad, used in parts:
        invariant.start_fold(unit, grad, used).finish(run_hooks=False)


def _install_zeros(unit, indices: list[int]) -> dict[int, torch.Tensor]:
    """Install zero sentinel gradients (``unit.grad_dtype``, this rank's shard shapes) on the parameters
    ``indices`` (layout order, trainable, ``.grad`` None): views of one allocation, on the host buffer the unit
    reuses when offloaded (core/offload.py [Note: offloaded gradient buffers]). Returns index -> installed .grad."""
    if not indices:
        return {}
    lay = unit.layout
    zeros = offload.zeros(unit, lay.grad_shard_numel, unit.grad_dtype) if unit.cfg.offload_params else \
        torch.zeros(lay.grad_shard_numel, dtype=unit.grad_dtype, device=unit.flat_shard.device)
    views = flat.grad_shard_views(zeros, lay, unit.rank)
    return {i: grads.set_grad(unit.slots[i], views[i]) for i in indices}


def _seen(grad: torch.Tensor) -> tuple[weakref.ref, int]:
    return weakref.ref(grad), torch_private.version_counter(grad)


def _changed(unit, i: int, seen: tuple[weakref.ref, int]) -> bool:
    """Whether parameter ``i``'s ``.grad`` was dropped, replaced or written in place since ``seen``."""
    cur = unit.slots[i].sharded.grad
    return cur is None or cur is not seen[0]() or torch_private.version_counter(cur) != seen[1]


def _install_zero(unit, i: int) -> torch.Tensor:
    """Install a zero sentinel gradient of its own on trainable parameter ``i``; returns the installed .grad."""
    slot = unit.slots[i]
    return grads.set_grad(slot, torch.zeros_like(slot.local, dtype=unit.grad_dtype))


def _sentinel_freed(stash_ref: weakref.ref, index: int) -> None:
    stash = stash_ref()
    if stash is not None:
        stash.sentinel_freed(index)


class Window:
    """One ``no_sync`` window's unsharded gradient summed over its
    micro-batches, in ``reduce_dtype`` (bf16/fp16 compute must not mean
    bf16/fp16 accumulation).

    Args:
        unit: the owning :class:`~fullshard.core.unit.Unit` (held weakly).
        full_grad: the first micro-batch's unsharded gradient (param-major,
            ``N·S`` elements); taken from ``.grad``, so ours to keep.
        used: per layout parameter, whether it received a gradient.
        index: world_size_invariant: the window's backward that gave it.
    """

    def __init__(self, unit, full_grad: torch.Tensor, used: list[bool], index: int = 0):
        self.unit_ref = weakref.ref(unit)
        self.grad = full_grad.to(unit.reduce_dtype)
        self.used = list(used)
        # world_size_invariant: each backward's gradient kept apart as [grad, used, backward index]
        # (their fold order interleaves other ranks' micro-batches); None: summed.
        self.parts: Optional[list[list]] = \
            [[self.grad, list(used), index]] if unit.cfg.invariant_layout is not None else None
        # index -> (weakref to the .grad seen, its version); None once that
        # gradient was dropped.
        self.watch: dict[int, Optional[tuple[weakref.ref, int]]] = {}
        self._install_watch(unit)

    def _install_watch(self, unit) -> None:
        missing = [i for i, slot in enumerate(unit.slots) if slot.layout.requires_grad and slot.sharded.grad is None]
        for i, installed in _install_zeros(unit, missing).items():  # one allocation for all of them
            self._register_sentinel(unit, i, installed)
        for i, slot in enumerate(unit.slots):
            if slot.layout.requires_grad:
                self._watch(unit, i)

    def _register_sentinel(self, unit, i: int, installed: torch.Tensor) -> None:
        unit.stash.sentinels[i] = weakref.ref(installed)
        weakref.finalize(installed, _sentinel_freed, weakref.ref(self), i)

    def _watch(self, unit, i: int) -> None:
        if unit.slots[i].sharded.grad is None:
            self._register_sentinel(unit, i, _install_zero(unit, i))
        self.watch[i] = _seen(unit.slots[i].sharded.grad)

    def add(self, full_grad: torch.Tensor, used: list[bool], index: int = 0) -> None:
        self.discard_zeroed()
        if self.parts is not None and self.parts[-1][2] == index:  # reached again in the same backward
            last = self.parts[-1]
            last[0].add_(full_grad)
            last[1] = [a or b for a, b in zip(last[1], used)]
        elif self.parts is not None:
            self.parts.append([full_grad.to(self.grad.dtype), list(used), index])
        else:
            self.grad.add_(full_grad)
        self.used = [a or b for a, b in zip(self.used, used)]

    def tensors(self) -> list[torch.Tensor]:
        """Every stashed gradient tensor (one, or one per micro-batch)."""
        return [self.grad] + [g for g, _, _ in (self.parts or [None])[1:]]

    def micro_batches(self, count: int) -> list[tuple[Optional[torch.Tensor], list[bool]]]:
        """world_size_invariant: the (gradient, used flags) of each of the
        window's ``count`` backwards, in order, after discarding what the
        user zeroed; (None, all False) for a backward that did not reach the unit."""
        self.discard_zeroed()
        if self.parts[-1][2] >= count:  # a stash the window's count missed: never fold it silently wrong
            raise RuntimeError(f"unit '{self.unit_ref().name}': a no_sync gradient of backward {self.parts[-1][2]} "
                               f"was stashed, but the window counted {count} backwards; report this as a bug")
        by_index = {j: (g, u) for g, u, j in self.parts}
        return [by_index.get(j, (None, [False] * len(self.used))) for j in range(count)]

    def sentinel_freed(self, index: int) -> None:
        """A sentinel gradient was dropped (``zero_grad(set_to_none=True)``):
        when every part of the stash is now unwanted, free it at once."""
        self.watch[index] = None
        if all(self.watch.get(i, (None,)) is None for i, u in enumerate(self.used) if u):
            unit = self.unit_ref()
            if unit is not None and unit.stash.window is self:
                unit.stash.discard()

    def discard_zeroed(self) -> bool:
        """Zero the stashed gradient of every parameter whose ``.grad`` the
        user zeroed or dropped, and watch its new ``.grad``. Returns True when
        nothing is left to reduce."""
        unit = self.unit_ref()
        lay = unit.layout
        for i, seen in list(self.watch.items()):
            if seen is not None and not _changed(unit, i, seen):
                continue
            if self.used[i]:
                p = lay.params[i]
                for t in self.tensors():
                    t[p.full_offset:p.full_offset + p.full_span].zero_()
                self.used[i] = False
                for part in self.parts or ():
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
