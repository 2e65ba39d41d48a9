"""Gathering a unit's full values outside the training schedule: the one
"gather one unit" of the library (:func:`gather_full`, used by
``summon_full_params``, the full model state dict and the full optimizer
state dict) and ``summon_full_params`` itself (:func:`full_params`).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from . import collectives, flat, mixed


def gather_full(unit, flat_shard: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """All-gather ``flat_shard`` (default: the unit's master flat shard; any
    tensor laid out like it, e.g. an optimizer-state flat) over the unit's
    shard group. The one "gather one unit" of the library: keep it so.

    Returns:
        Full-shape views, one per parameter in layout order, of one new
        param-major buffer (``N·S`` elements, ``flat_shard``'s dtype, on the
        compute device). Empty for a unit without parameters (no collective).
    """
    if not unit.layout.params:
        return []
    if getattr(unit, "packed", False):  # core/packed.py: no plain values to gather
        unit.refuse("gathering full parameters (summon_full_params, a full state dict)")
    lay, dev = unit.layout, unit.cfg.compute_device
    src = unit.flat_shard if flat_shard is None else flat_shard
    buf = torch.empty(lay.unsharded_numel, dtype=src.dtype, device=dev)
    collectives.all_gather(buf, src.to(dev), unit.cfg.shard_group, async_op=False,
                           tag=f"unit '{unit.name}' full gather")
    if lay.world == 1:  # the two layouts coincide (core/flat.py [Note: flat layouts])
        return flat.unsharded_views(buf, lay)
    full = torch.empty_like(buf)
    flat.copy_out(full, buf, lay)
    return flat.unsharded_views(full, lay)


def _gather_grads(unit) -> list[Optional[torch.Tensor]]:
    """Full gradients of the unit's parameters (None where no rank has one)."""
    lay = unit.layout
    grads = torch.zeros_like(unit.flat_shard)
    has = torch.tensor([float(slot.sharded.grad is not None) for slot in unit.slots])
    for view, slot in zip(flat.shard_views(grads, lay, unit.rank), unit.slots):
        if slot.sharded.grad is not None:
            view.copy_(slot.grad())
    collectives.all_reduce(has, unit.cfg.shard_group, "max", tag=f"unit '{unit.name}' summon grads")
    full = gather_full(unit, grads)
    return [g if h else None for g, h in zip(full, has.tolist())]


def _written(unit, full: list[nn.Parameter]) -> list[torch.Tensor]:
    """The values to write back: each summoned parameter's tensor now.

    Raises:
        ValueError: a ``p.data = t`` of another shape (nothing is written back then).
    """
    for p, lay in zip(full, unit.layout.params):
        if tuple(p.shape) != tuple(lay.shape):
            raise ValueError(f"[rank {collectives.rank()}] summon_full_params(writeback=True): '{lay.fqn}' of unit "
                             f"'{unit.name}' was given shape {tuple(p.shape)} (p.data = ...), not its "
                             f"{tuple(lay.shape)}; nothing was written back")
    return [p.detach() for p in full]


@contextlib.contextmanager
def full_params(units: list, writeback: bool = True, rank0_only: bool = False,
                offload_to_cpu: bool = False, with_grads: bool = False):
    """Gather every unit's full-precision parameters and register them on
    their modules for the duration of the context (see
    ``FullyShardedDataParallel.summon_full_params`` and core/unit.py [Note:
    full-parameter views shadow sharded parameters]). Units an enclosing
    call already summoned are left to it, so nested calls compose.

    Raises:
        ValueError: ``writeback`` with ``rank0_only``.
    """
    if writeback and rank0_only:
        raise ValueError("summon_full_params: writeback=True with rank0_only=True is not supported (the "
                         "other ranks hold no full parameters to write back); pass writeback=False")
    todo = [p for u in units for p in mixed.parts(u) if not p.summoned]  # each dtype part of a mixed unit
    gathered = []
    try:
        with torch.no_grad():
            for unit in todo:
                unit.summoned = True
                if not unit.slots:
                    continue
                views = gather_full(unit)
                grads = _gather_grads(unit) if with_grads else [None] * len(unit.slots)
                if rank0_only and not collectives.is_first_rank(unit.cfg.shard_group, unit.cfg.replicate_group):
                    continue
                if offload_to_cpu:
                    views = [v.cpu() for v in views]
                    grads = [None if g is None else g.cpu() for g in grads]
                unit.hide_full_params()
                full = []
                for view, grad, lay in zip(views, grads, unit.layout.params):
                    full.append(nn.Parameter(view, requires_grad=lay.requires_grad))
                    full[-1].grad = grad
                unit.install_params(full)
                gathered.append((unit, full))
        yield
    finally:
        problem = None
        with torch.no_grad():
            try:  # from each parameter's tensor now: `p.data = t` inside the context counts too
                values = [_written(unit, full) if writeback else None for unit, full in gathered]
            except ValueError as e:
                problem, values = e, [None] * len(gathered)
            for (unit, _), written in zip(gathered, values):
                if written is not None:
                    flat.shard_into(unit.flat_shard, unit.layout, written, unit.rank)
                unit.restore_params()
        for unit in todo:
            unit.summoned = False
        if problem is not None:
            raise problem
