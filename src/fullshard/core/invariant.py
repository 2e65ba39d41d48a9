"""World-size-invariant gradient reduction (``world_size_invariant=True``).

[Note: world-size invariance]
A reduce-scatter sums the ranks' gradients in an order that depends on the
number of ranks (a ring, or our all-to-all plus a sum of N blocks), and
gradient accumulation adds each rank's micro-batches locally first; both
make the summed gradient, and so the trained model, depend on the world
size in the last bits. Here the order is fixed by the data instead:

* In an update, rank ``r``'s ``j``-th micro-batch is global micro-batch
  ``j·W + r`` (W = world size); the caller schedules its data so.
* Each backward's gradient is sent, unreduced, to the ranks that keep each
  part of it (one all-to-all over the world). The receiver adds the W
  pieces, in world-rank order, one at a time onto its gradient: over an
  update the gradient is the left fold ``((g_0 + g_1) + g_2) + ...`` over
  global micro-batch indices, whichever rank computed each and whatever W.
* With replicas (HYBRID_SHARD, NO_SHARD) each replica folds ``1/R`` of the
  shard and the replicas all-gather the folded parts, so every element is
  still folded by one rank in the same order.
* Gradients are summed, not averaged (the caller divides its loss by the
  global count); ``set_gradient_divide_factor(f)`` divides each micro-batch
  by ``f`` before the fold.
* A unit sharded over a sub-group without replicas (a pipeline stage on its
  data-parallel group) folds over that group instead of the world, in its
  group-rank order: invariant in that group's size (:func:`fold_group`).

The bytes sent per backward equal a reduce-scatter's, plus an all-gather
of the shard with replicas (an all-reduce's second half). ``no_sync``
keeps each micro-batch's unsharded gradient apart (one full gradient per
micro-batch) and folds them in order at the synchronizing backward; each
fold carries the sender's count of its window's backwards, checked on the
device (core/stash.py [Note: no_sync under world_size_invariant]). The
gradient norm uses :func:`exact_sum` (see core/norms.py), whose result does
not depend on how elements are split over ranks.

Source of the order-independent summation: Demmel & Nguyen, "Parallel
Reproducible Summation", IEEE Trans. Computers 64(7), 2015, §3 (pre-rounding
each value to a grid fixed by a global maximum, so the additions are exact).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import collectives, flat, grads, post_accumulate, reduce, registry, used_flags
from .buffers import POOL

# Bits of each integer limb of exact_sum: n values of up to 2**LIMB_BITS each
# sum exactly in int64 while n < 2**(63 - LIMB_BITS).
LIMB_BITS = 31
LIMBS = 3
_LAYOUTS: dict = {}
_INDEX: dict = {}  # (layout, device) -> index tensors of start_fold's send order
# Base-256 digits of the window count each fold sends every rank: exact in
# bf16 and wider, for counts below 2**32.
COUNT_DIGITS = 4
_DIGITS: dict = {}  # (count, dtype, device) -> the count's digits on the device


def is_marked(param) -> bool:
    """Whether ``param`` is a sharded parameter of a live world_size_invariant unit."""
    found = registry.find(param)
    return found is not None and found[0].cfg.invariant_layout is not None


def check_layout(shard_group, replicate_group, where: str) -> tuple:
    """The (shard-group rank, replicate-group rank) of every rank of the
    unit's fold group (:func:`fold_group`), for a unit sharded over
    ``shard_group`` and replicated over ``replicate_group`` (None: no
    replicas). Groups that tile the world: one ``all_gather_object`` over
    the world per pair of groups, every rank must call it (construction
    is). A shard group that is a sub-group without replicas (a pipeline
    stage's data-parallel group) folds over itself, in its group-rank
    order: no collective.

    Raises:
        ValueError: replicas whose groups do not tile the world (the fold
            of a replicated unit runs over the world).
    """
    rep_size = collectives.group_size(replicate_group) if replicate_group is not None else 1
    if replicate_group is None and collectives.group_size(shard_group) != collectives.world_size():
        return tuple((y, 0) for y in range(collectives.group_size(shard_group)))
    if collectives.group_size(shard_group) * rep_size != collectives.world_size():
        raise ValueError(
            f"{where}: world_size_invariant=True with replicas needs the unit's ranks to be the whole world "
            f"(shard group {collectives.group_size(shard_group)} x replicas {rep_size} != world size "
            f"{collectives.world_size()}); shard over the world, HYBRID_SHARD / NO_SHARD groups that tile it, or "
            "a sub-group without replicas")
    key = (id(shard_group), id(replicate_group))
    known = _LAYOUTS.get(key)
    if known is None or known[0] is not shard_group or known[1] is not replicate_group:  # ids are reused
        mine = (collectives.group_rank(shard_group),
                collectives.group_rank(replicate_group) if replicate_group is not None else 0)
        layout = tuple(collectives.all_gather_object(mine, None, tag="world_size_invariant layout"))
        _LAYOUTS[key] = known = (shard_group, replicate_group, layout)
    return known[2]


def fold_group(unit):
    """The ranks whose micro-batches ``unit``'s fold adds, in their group-rank
    order: the world, or the shard group when it is a sub-group without
    replicas (the micro-batch of its group rank ``r`` at step ``j`` is then
    global micro-batch ``j·D + r``, D its size)."""
    cfg = unit.cfg
    if cfg.replicate_group is None and len(cfg.invariant_layout) != collectives.world_size():
        return cfg.shard_group
    return collectives.world_group()


def start_fold(unit, full_grad: Optional[torch.Tensor], used: list[bool]) -> "PendingFold":
    """Send this backward's unsharded gradient ``full_grad`` (param-major,
    ``N·S`` elements; None = zeros) and its used flags to the ranks that
    fold each part (see [Note: world-size invariance]); the fold happens at
    :meth:`PendingFold.finish`. Each rank's piece ends with the
    ``COUNT_DIGITS`` digits of ``unit.stash.folding`` (the backwards of the
    no_sync window being folded), never added to the gradient.

    Raises:
        RuntimeError: ``set_requires_all_reduce(False)`` on a replicated
            unit (replicas' partial sums cannot keep the fold order).
    """
    cfg = unit.cfg
    rep = cfg.replicate_group
    if rep is not None and not unit.settings.requires_all_reduce:
        raise RuntimeError(f"[rank {collectives.rank()}] unit '{unit.name}': set_requires_all_reduce(False) "
                           "cannot be used with world_size_invariant=True (the replicas' sum is part of the fixed "
                           "order); leave it True")
    layout = cfg.invariant_layout
    world = len(layout)
    reps = world // unit.world
    direct = reps == 1 and all(s == y for y, (s, _) in enumerate(layout))  # block y goes to rank y
    reduce_in, block = reduce.reduce_input(unit, full_grad, used, extra=COUNT_DIGITS if direct else 0)
    factor = unit.settings.grad_divide_factor
    if factor not in (None, 1):
        reduce_in.div_(factor)
    part = -(-block // reps)  # elements each replica folds
    if direct:
        send = reduce_in
    else:
        send = POOL.take(world * (part + COUNT_DIGITS), unit.reduce_dtype, cfg.compute_device)
        padded = torch.zeros(unit.world, reps * part, dtype=reduce_in.dtype, device=reduce_in.device)
        padded[:, :block] = reduce_in.view(unit.world, block)
        pieces = padded.view(unit.world, reps, part)
        # World rank y receives sub-part q(y) of block s(y).
        idx_s, idx_q = _send_index(layout, reduce_in.device)
        send.view(world, part + COUNT_DIGITS)[:, :part].copy_(pieces[idx_s, idx_q])
        POOL.give(reduce_in)
    count = _count_digits(unit.stash.folding, send.dtype, send.device)
    send.view(world, part + COUNT_DIGITS)[:, part:].copy_(count)  # after the division: the count as it is
    recv = POOL.take(world * (part + COUNT_DIGITS), unit.reduce_dtype, cfg.compute_device)
    work = collectives.all_to_all(recv, send, fold_group(unit), async_op=True,
                                  tag=f"unit '{unit.name}' (world_size_invariant)")
    return PendingFold(unit, work, send, recv, block, part, reps, all(used), count)


def _count_digits(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``count``'s ``COUNT_DIGITS`` base-256 digits (least significant first)
    as a tensor on ``device``: built once per count, so a fold copies no host
    memory to the device."""
    key = (count, dtype, str(device))
    found = _DIGITS.get(key)
    if found is None:
        if len(_DIGITS) > 64:
            _DIGITS.clear()
        digits = [(count >> (8 * i)) & 255 for i in range(COUNT_DIGITS)]
        found = _DIGITS[key] = torch.tensor(digits, dtype=dtype).to(device)
    return found


def _check_count(unit, received: torch.Tensor, count: torch.Tensor, folding: int) -> None:
    """Raise on every rank when the ranks folding together ran different
    numbers of backwards in the window being folded: their fold collectives
    no longer pair up (a hang, or another unit's micro-batch added). Every
    rank receives every rank's count, so all of them see a mismatch at the
    same fold. No host read: an asynchronous device-side assert on CUDA
    (fatal for the process), a RuntimeError at once on the CPU.

    Args:
        received: (fold-group size, COUNT_DIGITS) the counts that arrived.
        count: (COUNT_DIGITS,) this rank's count ``folding``.
    """
    torch._assert_async(
        (received == count).all(),
        f"[rank {collectives.rank()}] unit '{unit.name}': world_size_invariant=True with no_sync: ranks ran "
        f"different numbers of backwards since the last synchronizing backward (this rank: {folding}); run "
        "the same backwards on every rank (one micro-batch each) before the synchronizing one")


def _send_index(layout: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block and sub-part indices of every world rank's piece (built once per
    layout and device: no host-to-device copy per backward)."""
    key = (layout, str(device))
    found = _INDEX.get(key)
    if found is None:
        found = _INDEX[key] = (torch.tensor([s for s, _ in layout], device=device),
                               torch.tensor([q for _, q in layout], device=device))
    return found


class PendingFold:
    """An in-flight all-to-all of :func:`start_fold`; same interface as
    :class:`~fullshard.core.reduce.PendingReduce`."""

    def __init__(self, unit, work, send, recv, block: int, part: int, reps: int, all_used: bool,
                 count: torch.Tensor):
        self.unit, self.work, self.send, self.recv = unit, work, send, recv
        self.block, self.part, self.reps = block, part, reps
        self.all_used = all_used  # this rank used every parameter: every folded flag is positive
        self.count, self.folding = count, unit.stash.folding  # the window count this rank sent (its digits)

    def _wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        POOL.give(self.send)
        self.send = None

    def finish(self, later: Optional[used_flags.UsedFlags] = None, run_hooks: bool = True) -> None:
        """Fold the received pieces in world-rank order onto the gradient
        shard and write it to the parameters' ``.grad``; then run their
        post-accumulate-grad hooks, unless ``run_hooks`` is False (a stashed
        micro-batch: the synchronizing backward's fold runs them once).
        ``later``: as :meth:`~fullshard.core.reduce.PendingReduce.finish`."""
        self._wait()
        unit = self.unit
        rows = self.recv.view(-1, self.part + COUNT_DIGITS)  # one per rank: its piece, then its count
        try:
            _check_count(unit, rows[:, self.part:], self.count, self.folding)
        except RuntimeError:
            self.abandon()
            raise
        if later is not None and later.holds(unit):
            later.flush()  # the fold starts from the unit's current .grad
        n_grad = unit.layout.grad_shard_numel
        acc_dtype = unit.flat_shard.dtype
        device = self.recv.device
        acc = torch.zeros(self.reps * self.part, dtype=acc_dtype, device=device)
        acc[:n_grad] = _current_grad(unit).to(device)
        rep = unit.cfg.replicate_group
        q = collectives.group_rank(rep) if rep is not None else 0
        mine = acc[q * self.part:(q + 1) * self.part]
        for piece in rows[:, :self.part]:  # world-rank order = global micro-batch order
            mine.add_(piece)
        POOL.give(self.recv)
        self.recv = None
        if self.reps > 1:
            gathered = torch.empty_like(acc)
            collectives.all_gather(gathered, mine.clone(), rep, async_op=False,
                                   tag=f"unit '{unit.name}' (world_size_invariant replicas)")
            acc = gathered
        folded = acc[:self.block]

        def write(used):
            _write_grad(unit, folded, used)
            if run_hooks:
                post_accumulate.run(unit)
        used_flags.settle(later, unit, folded[n_grad:], self.all_used, write)

    def abandon(self) -> None:
        """Wait for the collective (its buffers must outlive it) and drop the result."""
        if self.send is not None:
            self._wait()
        POOL.give(self.recv)
        self.recv = None
        post_accumulate.forget(self.unit)


def _current_grad(unit) -> torch.Tensor:
    """The unit's gradient shard as one flat tensor in the master dtype
    (zeros where ``.grad`` is None)."""
    lay = unit.layout
    out = torch.zeros(lay.grad_shard_numel, dtype=unit.flat_shard.dtype, device=unit.flat_shard.device)
    for slot, view in zip(unit.slots, flat.grad_shard_views(out, lay, unit.rank)):
        if view is not None:
            g = slot.grad()
            if g is not None:
                view.copy_(g.reshape(view.shape))
    return out


def _write_grad(unit, folded: torch.Tensor, used: Optional[list[bool]]) -> None:
    """Install the folded block (gradient shard, then the used counts) as the
    sharded parameters' ``.grad``; ``used``: the counts as booleans (None:
    all positive). A parameter with no gradient that no rank used keeps
    ``grad None``, and a ``no_sync`` sentinel no rank filled goes."""
    lay = unit.layout
    n_grad = lay.grad_shard_numel
    if used is None:
        used = [True] * len(lay.params)
    values = folded[:n_grad].to(unit.flat_shard.device, unit.grad_dtype)
    sentinels = unit.stash.take_sentinels()
    for i, (slot, view) in enumerate(zip(unit.slots, flat.grad_shard_views(values, lay, unit.rank))):
        if view is None:
            continue
        cur = slot.grad()
        if not used[i]:
            slot.drop_sentinel(sentinels.get(i))
            continue
        post_accumulate.mark(unit, i)
        if cur is not None and cur.dtype == view.dtype:
            cur.copy_(view.reshape(cur.shape))  # keeps the .grad object (the optimizer may hold it)
        else:
            grads.set_grad(slot, view.clone())


def exact_sum(values: torch.Tensor, groups: list) -> float:
    """Sum of the non-negative ``values`` held by every rank of ``groups``,
    independent of how the elements are split over ranks and of the order
    of additions (Demmel & Nguyen 2015, §3: each value is cut at fixed
    binary places relative to the global maximum and the pieces are summed
    as integers, which is exact and associative).

    Each value is truncated below ``2**-(LIMBS·LIMB_BITS)`` (2**-93) of the
    global maximum M, so the result is within ``n · 2**-93 · M`` of the
    exact sum, then rounded once to float64.

    Args:
        values: 1-D float64 tensor of non-negative finite values, any length
            (also 0) on each rank; at most ``2**32`` elements over all ranks.
        groups: process groups whose ranks' values are summed (each element
            counted by one rank), reduced in this order.
    Returns:
        The sum as a Python float, the same on every rank; inf or nan when
        any value is.
    """
    # [largest value, 1 if any value is nan]: a MAX reduction may drop a nan.
    top = torch.zeros(2, dtype=torch.float64)
    if values.numel():
        top[0] = values.max().to(torch.float64).cpu()
        top[1] = float(bool(torch.isnan(values).any()))
    for group in groups:
        collectives.all_reduce(top, group, "max", tag="gradient norm (maximum)")
    peak, has_nan = top.tolist()
    if has_nan:
        return math.nan
    if peak == 0.0 or not math.isfinite(peak):
        return peak
    exponent = math.frexp(peak)[1]  # peak < 2**exponent
    rest = torch.ldexp(values.to(torch.float64), torch.tensor(-exponent, dtype=torch.float64)) \
        if values.numel() else values.to(torch.float64)
    limbs = torch.zeros(LIMBS, dtype=torch.int64)
    for k in range(LIMBS):
        rest = rest * float(2 ** LIMB_BITS)  # exact: a power of two
        digit = torch.floor(rest)
        rest = rest - digit  # exact: the fraction below the cut
        limbs[k] = digit.to(torch.int64).sum().cpu() if digit.numel() else 0
    for group in groups:
        collectives.all_reduce(limbs, group, "sum", tag="gradient norm (exact sum)")
    total = 0
    for value in limbs.tolist():
        total = (total << LIMB_BITS) + value
    return math.ldexp(float(total), exponent - LIMBS * LIMB_BITS)  # int -> float rounds once
