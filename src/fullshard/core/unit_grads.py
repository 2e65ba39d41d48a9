"""The gradient half of :class:`fullshard.core.unit.Unit`: taking the
unsharded gradient autograd accumulated, the pooled buffer behind it, the
``no_sync`` stash, ``requires_grad`` changes, and starting the reduce.

A mixin so ``core/unit.py`` stays about shards and full parameters; it uses
the unit's ``layout``, ``slots``, ``flat_full``, ``_stash``,
``_pooled_grad`` and ``sentinels``.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import collectives, flat, grads, invariant, reduce
from .buffers import POOL


class UnitGrads:
    """Gradient methods of a unit (see the module docstring)."""

    def _set_layout(self, layout: flat.FlatLayout) -> None:
        """Make ``layout`` the unit's, each slot keeping its entry."""
        self.layout = layout
        for slot, entry in zip(self.slots, layout.params):
            slot.layout = entry

    def refresh_requires_grad(self) -> bool:
        """Adopt ``requires_grad`` flags changed on the sharded parameters
        since the layout was made (``requires_grad_()`` after wrapping).

        Returns:
            True when the set of trainable parameters changed.
        Raises:
            RuntimeError: the change happened inside a ``no_sync``
                accumulation window (a stash in the old layout exists).
        """
        flags = [sp.requires_grad for sp in self.sharded_params]
        if flags == [p.requires_grad for p in self.layout.params]:
            return False
        if self._stash is not None:
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{self.name}': requires_grad changed inside a no_sync() "
                "accumulation window; change it before the window or after the synchronizing backward")
        self._set_layout(flat.make_layout([(p.fqn, p.shape, rg) for p, rg in zip(self.layout.params, flags)],
                                          self.world, [p.placement for p in self.layout.params]))
        self.needs_grad = any(flags)
        self.release_full_grad(self.take_full_grad()[0])
        self.flat_full.requires_grad_(self.needs_grad)
        self._views = None
        return True

    def take_full_grad(self) -> tuple[Optional[torch.Tensor], list[bool]]:
        """Detach and return the accumulated unsharded gradient (or None) and
        which parameters received a gradient since the last call. The caller
        passes the gradient to :meth:`release_full_grad` when done with it."""
        g = self.flat_full.grad
        self.flat_full.grad = None
        used = [s.used for s in self.slots]
        for s in self.slots:
            s.used = False
        return g, used

    def take_grad_buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A pooled ``N·S``-element buffer for this backward's full gradient."""
        self.release_full_grad(None)  # an earlier one autograd did not adopt
        buf = POOL.take(self.layout.unsharded_numel, dtype, device)
        self._pooled_grad = (buf.data_ptr(), buf.untyped_storage().nbytes())
        return buf

    def release_full_grad(self, grad: Optional[torch.Tensor], keep: bool = False) -> None:
        """Settle the pooled full gradient once ``grad`` (from
        :meth:`take_full_grad`, or None) is no longer needed. When ``grad``
        is the pooled buffer it goes back to the pool, or with ``keep`` (a
        ``no_sync`` stash holds it) it leaves the pool's accounting and is
        freed like any tensor; when autograd copied or summed instead of
        adopting the buffer, the buffer is already gone and only the
        accounting is settled."""
        if self._pooled_grad is None:
            return
        ptr, nbytes = self._pooled_grad
        self._pooled_grad = None
        if grad is not None and grad.data_ptr() == ptr and grad.untyped_storage().nbytes() == nbytes:
            if not keep:
                POOL.give(grad)
                return
        POOL.forget(nbytes)

    def stash_grad(self, full_grad: torch.Tensor, used: list[bool]) -> None:
        """Keep a micro-batch's unsharded gradient for a later reduce
        (``no_sync``); see :class:`fullshard.core.grads.GradStash`."""
        if self._stash is None:
            self._stash = grads.GradStash(self, full_grad, used)
        else:
            self._stash.add(full_grad, used)

    def stash_holds(self, full_grad: torch.Tensor) -> bool:
        """Whether the ``no_sync`` stash keeps ``full_grad``'s memory (it
        adopts the first micro-batch's gradient when no cast is needed)."""
        return self._stash is not None and any(
            t.untyped_storage().data_ptr() == full_grad.untyped_storage().data_ptr() for t in self._stash.tensors())

    def pop_stashed(self, full_grad: Optional[torch.Tensor], used: list[bool],
                    agreed: bool = False) -> tuple[Optional[torch.Tensor], list[bool]]:
        """``full_grad`` plus whatever :meth:`stash_grad` kept, and the union
        of the used flags; the stash is emptied. Under world_size_invariant
        the stashed micro-batches are folded here instead, one by one, and
        ``full_grad`` is returned as it is; ``agreed``: every rank calls this
        for the unit now (a no_sync window is closing), so the ranks' stash
        counts are compared even where this rank has none."""
        stash, self._stash = self._stash, None
        if self.cfg.invariant_layout is not None and (stash is not None or agreed):
            self._fold_stashed(stash)
            return full_grad, used
        if stash is None:
            return full_grad, used
        return stash.pop(full_grad, used)

    def _fold_stashed(self, stash: Optional[grads.GradStash]) -> None:
        """world_size_invariant: fold each stashed micro-batch in order (one
        all-to-all each); every rank must hold as many.

        Raises:
            RuntimeError: ranks stashed different numbers of micro-batches
                for this unit (a backward reached it on some ranks only).
        """
        parts = stash.micro_batches() if stash is not None else []
        counts = torch.tensor([len(parts), -len(parts)], dtype=torch.int64)
        collectives.all_reduce(counts, collectives.world_group(), "max", tag=f"unit '{self.name}' no_sync count")
        if counts[0] != -counts[1]:
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{self.name}': under world_size_invariant=True every rank's "
                f"no_sync backwards must reach the unit equally often (ranks stashed {-int(counts[1])} to "
                f"{int(counts[0])} micro-batches); reach it on every rank or do not use no_sync")
        for grad, used in parts:
            invariant.start_fold(self, grad, used).finish(run_hooks=False)

    def check_stash(self) -> None:
        """Drop the parts of the stash whose gradients the user zeroed."""
        if self._stash is not None and self._stash.discard_zeroed():
            self.drop_stash()

    def drop_stash(self) -> None:
        """Forget the stash and take back sentinel gradients still installed."""
        self._stash = None
        for i, ref in self.sentinels.items():
            if ref() is not None and self.sharded_params[i].grad is ref():
                self.sharded_params[i].grad = None
        self.sentinels = {}

    @property
    def has_stash(self) -> bool:
        return self._stash is not None

    def stashed_grad_bytes(self) -> int:
        """Bytes of the ``no_sync`` stash's storage (0 without a stash)."""
        return 0 if self._stash is None else sum(t.untyped_storage().nbytes() for t in self._stash.tensors())

    def reduce_grads(self, full_grad: Optional[torch.Tensor], used: list[bool]) -> reduce.PendingReduce:
        """Reduce-scatter ``full_grad`` (param-major, ``N·S`` elements; None =
        zeros) into a gradient shard, averaged over the data-parallel world.
        Asynchronous: the gradient reaches ``.grad`` when the returned
        :class:`~fullshard.core.reduce.PendingReduce` is finished.

        ``used[i]``: whether this rank's backward gave layout parameter i a
        gradient; a parameter no rank used keeps ``grad None`` (see core/reduce.py).
        """
        if self.cfg.invariant_layout is not None:
            return invariant.start_fold(self, full_grad, used)
        return reduce.start_reduce(self, full_grad, used)
