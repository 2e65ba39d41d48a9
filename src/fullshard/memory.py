"""Where a rank's memory is: per-unit bytes of shards (trainable and frozen, by
dtype), gradient shards, optimizer state, gathered parameters, unsharded
gradients and ``no_sync`` stashes, and the buffer pool.

:func:`memory_stats` reads the engine's state and never communicates, so it
may be called on any rank at any moment, from a hook in forward or backward
included. :func:`memory_totals` sums it over units (what ``fullshard train
--log-memory`` logs).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .construct import clean_name
from .core import collectives, mixed
from .core.buffers import POOL
from .core.module import UnitModule
from .core.packed import PackedPart
from .core.params import local_of

UNIT_FIELDS = ("sharded_bytes", "unsharded_bytes", "full_grad_bytes", "stashed_grad_bytes",
               "pending_reduce_scatters")
"""Keys of every unit's entry that :func:`memory_totals` sums, in order."""
PARAM_FIELDS = ("trainable_bytes", "frozen_bytes", "grad_bytes")
"""Keys of every unit's entry after :data:`UNIT_FIELDS`: its shard split by ``requires_grad``, and
its gradient shards; then ``optim_state_bytes`` (with an optimizer) and ``by_dtype``."""
POOL_FIELDS = ("in_use_bytes", "cached_bytes")
"""Keys of the ``"pool"`` entry, in order."""
POOL_KEY = "pool"
TOTAL_FIELDS = UNIT_FIELDS + tuple(f"{POOL_KEY}_{k}" for k in POOL_FIELDS)
"""Keys of :func:`memory_totals`, in order."""


def _nbytes(t: torch.Tensor) -> int:
    t = local_of(t)
    return t.numel() * t.element_size()


def _param_entry(unit, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """``trainable_bytes``, ``frozen_bytes``, ``grad_bytes``, [``optim_state_bytes``], ``by_dtype``."""
    out = dict.fromkeys(("trainable_bytes", "frozen_bytes", "grad_bytes"), 0)
    if optimizer is not None:
        out["optim_state_bytes"] = 0
    by_dtype: dict[str, dict[str, int]] = {}
    for part in mixed.parts(unit):  # a mixed unit's frozen parts of other dtypes too
        shard = part.flat_shard
        size = shard.element_size()
        trainable = 0
        for slot, lay in zip(part.slots, part.layout.params):
            if lay.owned and lay.placement.rank != part.rank:
                continue  # an Owned parameter has a slot on its owner only
            if slot.sharded is not None and slot.sharded.requires_grad:
                trainable += lay.shard_numel * size
            grad = None if slot.sharded is None else slot.grad()
            out["grad_bytes"] += 0 if grad is None else _nbytes(grad)
            if optimizer is not None and slot.sharded is not None:
                state = optimizer.state.get(slot.sharded, {})
                out["optim_state_bytes"] += sum(_nbytes(v) for v in state.values() if torch.is_tensor(v))
        if isinstance(part, PackedPart):  # frozen subclass shards (e.g. NF4): their own bytes, keyed by class
            frozen, key = part.shard_bytes(), type(part.slots[0].registered_local()).__name__
        else:  # padding past the slots counts as frozen
            frozen, key = shard.numel() * size - trainable, str(shard.dtype).removeprefix("torch.")
        entry = by_dtype.setdefault(key, {"trainable_bytes": 0, "frozen_bytes": 0})
        entry["trainable_bytes"] += trainable
        entry["frozen_bytes"] += frozen
        out["trainable_bytes"] += trainable
        out["frozen_bytes"] += frozen
    out["by_dtype"] = by_dtype
    return out


def _unit_entry(fsdp_unit: UnitModule, optimizer: Optional[torch.optim.Optimizer]) -> dict:
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
            "pending_reduce_scatters": pending,
            **_param_entry(unit, optimizer)}


def memory_stats(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, dict]:
    """This rank's memory held by each FSDP unit in ``model``, and by the buffer pool.

    Local to the rank: no collective, no synchronization, nothing changed.

    Args:
        model: a :class:`~fullshard.FullyShardedDataParallel` (root or nested)
            or any ``nn.Module`` holding units (a module with none gives only
            the ``"pool"`` entry, e.g. a torch DDP model).
        optimizer: the optimizer stepping ``model``'s parameters, to count
            its state per unit (``optim_state_bytes``); None: not counted.

    Returns:
        ``{unit_name: {field: int}, ..., "pool": {field: int}}``. A unit's name
        is its module path in ``model`` as ``named_parameters()`` shows it
        (wrapper segments ``_fsdp_wrapped_module`` and
        ``_checkpoint_wrapped_module`` removed; ``""`` for ``model`` itself;
        a unit of several modules, ``fully_shard([a, b])``: their paths
        joined by ``+``), in module order. All sizes are bytes of memory held now on this rank
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
        * ``trainable_bytes`` / ``frozen_bytes``: ``sharded_bytes`` split by
          the registered parameters' ``requires_grad`` now: each trainable
          parameter's slot (``ceil(R/N)`` rows, padding rows included) is
          trainable; frozen slots and any padding after the slots are frozen.
          A unit mixing a bf16 frozen base with fp32 adapters counts both
          parts (core/mixed.py).
        * ``grad_bytes``: the gradient shards held now as the registered
          parameters' ``.grad`` (this rank's real rows, their dtype); only
          trainable parameters ever have one.
        * ``optim_state_bytes`` (only when ``optimizer`` is given): every
          tensor of ``optimizer.state`` for the unit's registered parameters
          (AdamW: ``exp_avg``, ``exp_avg_sq`` and the 0-dim ``step``; a DTensor
          counts its local shard); frozen parameters given to the optimizer
          never get state.
        * ``by_dtype``: ``{dtype name: {"trainable_bytes", "frozen_bytes"}}``
          per flat-shard dtype (``"float32"``, ``"bfloat16"``, ...; a packed
          subclass such as ``NF4Tensor`` under its class name), summing to
          the two fields above.

        ``"pool"``: the process-wide buffer pool (core/buffers.py), shared by
        every model in the process. ``in_use_bytes``: pooled buffers handed
        out now; it overlaps the unit fields (gathered parameters, pooled
        full gradients and reduce-scatter inputs come from the pool; a stash
        does not). ``cached_bytes``: freed buffers kept for reuse.

    Raises:
        ValueError: a unit's name is ``"pool"`` (it would hide the pool entry).
    """
    units: dict[int, tuple[list[str], UnitModule]] = {}  # id(runtime) -> (its modules' paths, a module of it)
    for name, module in model.named_modules():
        if isinstance(module, UnitModule):
            key = clean_name(name)
            if key == POOL_KEY:
                raise ValueError(
                    f"[rank {collectives.rank()}] memory_stats: the unit at module path {POOL_KEY!r} would hide the "
                    "buffer pool's entry; "
                    "rename that submodule, or call memory_stats(model.pool) for that unit alone")
            # A unit of several modules (fully_shard([a, b])) is one entry: counted once per module, it was
            # summed twice by memory_totals.
            paths = units.setdefault(id(module._runtime), ([], module))[0]
            if key not in paths:
                paths.append(key)
    out = {"+".join(paths): _unit_entry(module, optimizer) for paths, module in units.values()}
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
