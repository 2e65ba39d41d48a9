"""The gradient reduce of one unit: the reduce-scatter input (param-major
gradient copied rank-major, used flags, pre-division), the in-flight
:class:`PendingReduce`, and accumulation of the reduced block into the
sharded parameters' ``.grad``.

Each rank's block carries one extra element per parameter, 1 where this
rank used it: after the sum a parameter no rank used is told apart from one
whose gradients cancel, and keeps ``grad None`` as under DDP
(``find_unused_parameters=True``); the flags are read on the host at most
once per backward (core/used_flags.py [Note: used flags on the host]).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import collectives, comm, flat, grads, offload, overlap, post_accumulate, used_flags


def reduce_input(unit, full_grad: Optional[torch.Tensor], used: list[bool], alloc=None,
                 extra: int = 0) -> tuple[torch.Tensor, int]:
    """The reduce input of ``unit`` (from ``alloc``, core/comm.py; None: the
    pool): ``unit.world`` rank-major blocks, each this rank's gradient for
    that block's owner followed by one used flag per layout parameter, then
    ``extra`` elements left unwritten for the caller (world_size_invariant's
    window count, core/invariant.py); and the block's numel without them."""
    n_grad, n_flags = unit.layout.grad_shard_numel, len(unit.layout.params)
    block = n_grad + n_flags
    reduce_in = comm.take(alloc, unit.world * (block + extra), unit.reduce_dtype, unit.cfg.compute_device)
    # copy_in writes every gradient element (padding rows included), so
    # only a missing gradient needs the buffer zeroed.
    if full_grad is None:
        reduce_in.zero_()
    else:
        flat.copy_in(reduce_in, full_grad, unit.layout, block_numel=block + extra)
    used_flags.fill(reduce_in.view(unit.world, block + extra)[:, n_grad:block], used)
    return reduce_in, block


def start_reduce(unit, full_grad: Optional[torch.Tensor], used: list[bool]) -> "PendingReduce":
    """``Unit.reduce_grads``: issue the reduce-scatter of ``unit``'s
    ``full_grad`` (param-major, ``N·S`` elements; None = zeros) with the used
    flags ``used`` (one per layout parameter); the gradient reaches ``.grad``
    at :meth:`PendingReduce.finish`."""
    cfg, settings, tag = unit.cfg, unit.settings, f"unit '{unit.name}'"
    group = settings.reduce_scatter_group or cfg.shard_group
    pre, post = settings.divide_factors(settings.grad_divide_factor or cfg.dp_world_size, unit.reduce_dtype)
    if settings.custom_reduce_scatter is not None and collectives.group_size(group) > 1:
        out = comm.custom_reduce_scatter(unit, full_grad, used, group, pre, tag)
        return PendingReduce(unit, None, None, out, post, all_used=all(used))
    # Symmetric memory serves the reduce-scatter only with force_sum (torch FSDP2: NCCL's
    # symmetric reduce-scatter sums only).
    alloc = settings.allocator
    if isinstance(alloc, comm.SymmMemAllocator) and not settings.force_sum:
        alloc = None
    rep = cfg.replicate_group
    # One rank: the sum is the input itself, so the input (a buffer of its own) is the output and the
    # gradient shards are views of it, instead of a pooled input copied into a new output.
    one_rank = unit.world == 1 == collectives.group_size(group) and alloc is None and rep is None
    reduce_in, block = reduce_input(unit, full_grad, used, comm.FRESH if one_rank else alloc)
    if pre != 1:  # x / 1 == x: a kernel per unit saved at world size 1
        reduce_in.div_(pre)  # DDP pre-divides; see UnitSettings.divide_factors
    if one_rank:
        return PendingReduce(unit, None, None, reduce_in, post, all_used=all(used))
    out = comm.take(alloc, block, unit.reduce_dtype, cfg.compute_device) if alloc is not None and \
        not alloc.pooled else torch.empty(block, dtype=unit.reduce_dtype, device=cfg.compute_device)
    if alloc is not None:
        alloc.prepare(reduce_in, group)
        alloc.prepare(out, group)
    # On side streams the replicas' all-reduce follows at once, unless sums are held back
    # (set_requires_all_reduce(False)) or one is held already: then finish() runs it as before.
    eager = rep is not None and unit.partial_out is None and settings.requires_all_reduce
    work, all_reduced = overlap.reduce_scatter(out, reduce_in, group, tag, rep if eager else None)
    return PendingReduce(unit, work, reduce_in, out, post, alloc, all(used), all_reduced)


def _accumulate(unit, out: torch.Tensor, used: Optional[list[bool]]) -> None:
    """Add a reduced block (gradient shard, then one used flag per
    parameter) into the sharded parameters' ``.grad``. ``used``: the summed
    flags as booleans (None: all positive). Parameters no rank used are left
    alone (``grad None`` stays None) unless
    ``set_reduce_scatter_unused_params(True)`` asks for their zero gradient
    (torch FSDP2's result)."""
    n_grad = unit.layout.grad_shard_numel
    if used is None or unit.settings.reduce_scatter_unused_params:
        used = [True] * len(unit.layout.params)  # frozen parameters have no view below
    master, reduced = unit.flat_shard, out[:n_grad]
    # Stored in grad_dtype; added to an existing gradient in the master
    # dtype (keep_low_precision_grads: rounded once per backward).
    if unit.cfg.offload_params:  # into a host buffer the unit reuses (core/offload.py)
        adds = any(u and s.sharded.grad is not None for s, u in zip(unit.slots, used))
        stored = offload.to_host(unit, reduced, unit.grad_dtype, blocking=adds)
    else:
        stored = reduced.to(master.device, unit.grad_dtype)
    store = flat.grad_shard_views(stored, unit.layout, unit.rank)
    wide = store if unit.grad_dtype == master.dtype else None
    sentinels = unit.stash.take_sentinels()
    for i, (slot, view, u) in enumerate(zip(unit.slots, store, used)):
        if view is None:
            continue
        if not u:
            slot.drop_sentinel(sentinels.get(i))
            continue
        post_accumulate.mark(unit, i)
        if slot.sharded.grad is None:
            grads.set_grad(slot, view)
            continue
        if wide is None:
            wide = flat.grad_shard_views(reduced.to(master.device, master.dtype), unit.layout, unit.rank)
        grads.add_to_grad(slot, wide[i], unit.grad_dtype)


class PendingReduce:
    """An in-flight reduce-scatter (and, with replicas, its all-reduce)."""

    def __init__(self, unit, work, reduce_in: Optional[torch.Tensor], out: torch.Tensor, post: float = 1.0,
                 alloc=None, all_used: bool = False, all_reduced: bool = False):
        self.unit, self.work, self.reduce_in, self.out = unit, work, reduce_in, out
        self.post, self.alloc = post, alloc  # division after the sum (force_sum); reduce_in's allocator
        self.all_used = all_used  # this rank used every parameter: every summed flag is positive
        self.all_reduced = all_reduced  # out was all-reduced over the replicas already (core/overlap.py)

    def finish(self, later: Optional[used_flags.UsedFlags] = None) -> None:
        """Wait, sum over replicas, run the all-reduce hook, divide what is
        left to divide, accumulate into the gradient shards and run the
        parameters' post-accumulate-grad hooks (core/post_accumulate.py).
        With ``later`` (the root's), the accumulation may wait for the end
        of backward's one read of the used flags (core/used_flags.py)."""
        if self.work is not None:
            self.work.wait()  # side streams: the compute stream waits on the collective's event
        comm.give(self.alloc, self.reduce_in)
        self.reduce_in = None
        unit, rep = self.unit, self.unit.cfg.replicate_group
        if rep is not None and not self.all_reduced:
            if unit.stash.held:  # what the user zeroed is dropped ([Note: held sums and zero_grad])
                unit.stash.check_held()
            if unit.partial_out is not None:  # sums kept by set_requires_all_reduce(False)
                self.out.add_(unit.partial_out)
                unit.partial_out = None
                unit.stash.release_held()
            if not unit.settings.requires_all_reduce:
                unit.stash.hold(self.out)
                return
            collectives.all_reduce(self.out, rep, "sum", tag=f"unit '{unit.name}' replicas")
        grad = self.out[:unit.layout.grad_shard_numel]
        comm.run_hook(unit, grad)
        if self.post != 1:
            grad.div_(self.post)
        out, n_grad = self.out, unit.layout.grad_shard_numel

        def write(used):
            _accumulate(unit, out, used)
            post_accumulate.run(unit)
        used_flags.settle(later, unit, out[n_grad:], self.all_used or unit.settings.reduce_scatter_unused_params,
                          write)

    def abandon(self) -> None:
        """Wait for the collective (its buffers must outlive it) and drop the result."""
        if self.work is not None:
            self.work.wait()
        comm.give(self.alloc, self.reduce_in)
        self.reduce_in = self.out = None
        post_accumulate.forget(self.unit)
