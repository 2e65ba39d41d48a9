"""Where a rank's memory is: per-unit bytes of shards, gathered parameters,
unsharded gradients and ``no_sync`` stashes, and the buffer pool.

:func:`memory_stats` reads the engine's state and never communicates, so it
may be called on any rank at any moment, from a hook in forward or backward
included. :func:`memory_totals` sums it over units (what ``fullshard train
--log-memory`` logs).
"""
from __future__ import annotations

import torch.nn as nn

from .construct import clean_name
from .core import collectives, mixed
from .core.buffers import POOL
from .core.module import UnitModule
from .core.packed import PackedPart

UNIT_FIELDS = ("sharded_bytes", "unsharded_bytes", "full_grad_bytes", "stashed_grad_bytes",
               "pending_reduce_scatters")
"""Keys of every unit's entry, in order."""
POOL_FIELDS = ("in_use_bytes", "cached_bytes")
"""Keys of the ``"pool"`` entry, in order."""
POOL_KEY = "pool"
TOTAL_FIELDS = UNIT_FIELDS + tuple(f"{POOL_KEY}_{k}" for k in POOL_FIELDS)
"""Keys of :func:`memory_totals`, in order."""


def _unit_entry(fsdp_unit: UnitModule) -> dict[str, int]:
    rt = fsdp_unit._runtime
    unit = rt.unit
    pending = 0 if rt.root is None else sum(1 for p in rt.root.pending if p.unit is unit)
    # Each dtype part of a mixed unit; a packed part (core/packed.py) holds its subclass shards' bytes.
    shards = [p.shard_bytes() if isinstance(p, PackedPart) else p.flat_shard.numel() * p.flat_shard.element_size()
              for p in mixed.parts(unit)]
    return {"sharded_bytes": sum(shards),
            "unsharded_bytes": unit.unsharded_bytes(),
            "full_grad_bytes": unit.full_grad_bytes(),
            "stashed_grad_bytes": unit.stash.nbytes(),
            "pending_reduce_scatters": pending}


def memory_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's memory held by each FSDP unit in ``model``, and by the buffer pool.

    Local to the rank: no collective, no synchronization, nothing changed.

    Args:
        model: a :class:`~fullshard.FullyShardedDataParallel` (root or nested)
            or any ``nn.Module`` holding units (a module with none gives only
            the ``"pool"`` entry, e.g. a torch DDP model).

    Returns:
        ``{unit_name: {field: int}, ..., "pool": {field: int}}``. A unit's name
        is its module path in ``model`` as ``named_parameters()`` shows it
        (wrapper segments ``_fsdp_wrapped_module`` and
        ``_checkpoint_wrapped_module`` removed; ``""`` for ``model`` itself),
        in module order. All sizes are bytes of memory held now on this rank
        (storage sizes: buffers of 1 MiB and more come from the pool rounded
        up to a multiple of 1 MiB). N is the unit's shard-group size and S
        the elements of its flat shard. Per unit:

        * ``sharded_bytes``: the flat shard (this rank's parameter chunks and
          padding, master dtype; in host memory under CPU offload).
        * ``unsharded_bytes``: full parameters gathered or being gathered
          (the unsharded flat parameter in the compute dtype, plus an
          all-gather output in flight); 0 when resharded. A unit whose shard
          group has one rank and that needs no cast or move (NO_SHARD
          without mixed precision or offload) computes on its shard: its
          full parameters are ``sharded_bytes`` and this stays 0. The
          full-precision copies ``summon_full_params`` makes are its own
          tensors, freed on exit, and not counted.
        * ``full_grad_bytes``: an unsharded gradient held now
          (``N·S`` elements, the compute dtype): the unit's ``.grad`` of
          its unsharded flat parameter, else the pooled buffer handed to
          autograd for it and not yet given back. It lives from the unit's
          backward until its reduce-scatter input is written, or, after a
          backward that raised, until the next root forward clears it (the
          pool counts that buffer as in use until then, even where autograd
          already dropped it).
        * ``stashed_grad_bytes``: the ``no_sync`` accumulation
          (``N·S`` elements, the reduce dtype) until the synchronizing
          backward reduces it or gradients are zeroed.
        * ``pending_reduce_scatters``: this unit's reduce-scatters in flight
          in its root's pending list (count, not bytes; each holds a
          unit-sized input buffer from the pool until waited on, at the
          latest at the end of backward).

        ``"pool"``: the process-wide buffer pool (core/buffers.py), shared by
        every model in the process. ``in_use_bytes``: pooled buffers handed
        out now; it overlaps the unit fields (gathered parameters, pooled
        full gradients and reduce-scatter inputs come from the pool; a stash
        does not). ``cached_bytes``: freed buffers kept for reuse.

    Raises:
        ValueError: a unit's name is ``"pool"`` (it would hide the pool entry).
    """
    out: dict[str, dict[str, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, UnitModule):
            key = clean_name(name)
            if key == POOL_KEY:
                raise ValueError(
                    f"[rank {collectives.rank()}] memory_stats: the unit at module path {POOL_KEY!r} would hide the "
                    "buffer pool's entry; "
                    "rename that submodule, or call memory_stats(model.pool) for that unit alone")
            out.setdefault(key, _unit_entry(module))
    stats = POOL.stats()
    out[POOL_KEY] = {k: int(stats[k]) for k in POOL_FIELDS}
    return out


def memory_totals(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """Each unit field summed over the units of :func:`memory_stats`' result,
    then the pool fields prefixed ``pool_`` (``pool_in_use_bytes``, ...)."""
    totals = dict.fromkeys(UNIT_FIELDS, 0)
    for name, entry in stats.items():
        if name != POOL_KEY:
            for k in UNIT_FIELDS:
                totals[k] += entry[k]
    totals.update({f"{POOL_KEY}_{k}": stats[POOL_KEY][k] for k in POOL_FIELDS})
    return totals
