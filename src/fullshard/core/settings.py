"""Every per-unit knob that may change after construction, in one object.

[Note: unit settings]
A unit has two records of how it runs. :class:`~fullshard.core.unit.UnitConfig`
(frozen) holds the facts fixed at construction: groups, devices, dtypes,
offload. :class:`UnitSettings` (this module, one mutable instance per unit,
``unit.settings``; ``UnitRuntime.settings`` is the same object) holds every
knob a front door may change later, and the schedule (core/state.py), the
reduce (core/reduce.py, core/invariant.py) and the collectives (core/comm.py,
``Unit.unshard``) read them from here at each use, so a change takes effect at
the next use and nothing keeps a stale copy. The front doors only write them:
``FullyShardedDataParallel``'s constructor arguments and its assignable
``backward_prefetch`` / ``forward_prefetch`` (fsdp_settings.py), and the
``FSDPModule.set_*`` methods (fsdp2.py, fsdp2_comm.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ..api import BackwardPrefetch

# Reduce-scatters allowed in flight before the oldest is waited on (per root,
# counted when a unit issues its own): each holds a unit-sized input buffer.
DEFAULT_MAX_INPUT_BUFFERS = 2


@dataclasses.dataclass(eq=False)
class UnitSettings:
    """The mutable knobs of one unit (see [Note: unit settings]).

    Attributes:
        reshard_after_forward: free full parameters after forward (FULL_SHARD,
            ``fully_shard``'s default for non-root units); the root keeps them.
        reshard_after_backward: free full parameters after backward; False
            keeps them for the next forward while the shards are unchanged.
        requires_gradient_sync: reduce gradients in this backward; False sums
            unsharded gradients locally (``no_sync`` for one unit).
        requires_all_reduce: HSDP: all-reduce over replicas in this backward;
            False sums reduce-scatter outputs in ``Unit.partial_out``.
        unshard_in_backward: gather the unit for its backward (False: its
            backward reads no parameter; core/backward_guard.py).
        forward_prefetch: issue the next unit's all-gather (previous
            iteration's forward order) before this unit's forward runs.
        backward_prefetch: when this unit's backward issues the previous
            unit's all-gather (:class:`BackwardPrefetch` or None).
        forward_prefetch_units: ``set_modules_to_forward_prefetch``: the
            runtimes gathered right after this unit's all-gather in forward.
        backward_prefetch_units: ``set_modules_to_backward_prefetch``: the
            runtimes gathered in backward instead of ``backward_prefetch``'s.
        grad_divide_factor: gradients are divided by it instead of the
            data-parallel world size (None: that size, DDP's mean).
        is_last_backward: ``set_is_last_backward`` (on the root unit):
            recorded; every backward still finishes its reduce-scatters.
        forward_depth: calls of the unit's forward in progress (both doors;
            above 1: a module of the unit called inside its own forward);
            reset to 0 at the start of each iteration.
        custom_all_gather: a custom all-gather object (core/comm.py [Note:
            custom collectives]); None: fullshard's own.
        custom_reduce_scatter: a custom reduce-scatter object; None: ours.
        all_reduce_hook: called on each reduced gradient shard, in place.
        force_sum: reduce by sum only and divide after the all-reduce hook.
        reduce_scatter_group: the separate reduce-scatter group; None: the
            shard group.
        reduce_scatter_unused_params: a parameter no rank used gets a zero
            gradient (torch's) instead of keeping ``grad None`` (DDP's).
        max_input_buffers: reduce-scatters (each holding a unit-sized input
            buffer) allowed in flight once this unit's is issued.
        allocator: a memory strategy for our own collectives' buffers
            (core/comm.py); None: the buffer pool.
    """

    reshard_after_forward: bool = True
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    unshard_in_backward: bool = True
    forward_prefetch: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch_units: Optional[list] = None
    backward_prefetch_units: Optional[list] = None
    grad_divide_factor: Optional[float] = None
    is_last_backward: bool = True
    forward_depth: int = 0
    custom_all_gather: Any = None
    custom_reduce_scatter: Any = None
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
    force_sum: bool = False
    reduce_scatter_group: Any = None
    reduce_scatter_unused_params: bool = False
    max_input_buffers: int = DEFAULT_MAX_INPUT_BUFFERS
    allocator: Any = None

    def divide_factors(self, factor: float, dtype: torch.dtype) -> tuple[float, float]:
        """(pre, post): gradients are divided by ``pre`` before the sum over
        ranks and by ``post`` after it (and after the all-reduce hook).
        Default: all before, DDP's order. ``force_sum``: torch FSDP2's split
        (all after for fp32/bf16; about sqrt before and the rest after for
        dtypes that could overflow)."""
        if not self.force_sum:
            return factor, 1.0
        if dtype in (torch.float32, torch.bfloat16):
            return 1.0, factor
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre
