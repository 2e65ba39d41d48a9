"""Public enums and frozen config dataclasses. No logic lives here."""
from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are split.

    FULL_SHARD: parameters, gradients and optimizer state sharded; full
        parameters are freed after each unit's forward and gathered again for
        its backward (ZeRO-3; Rajbhandari et al. 2020, §5.3). 3Ψ elements of
        communication per step.
    SHARD_GRAD_OP: gradients and optimizer state sharded; full parameters are
        kept from forward until the unit's backward ends (ZeRO-2-like). 2Ψ.
    NO_SHARD: every rank keeps everything; gradients are all-reduced (DDP).
    HYBRID_SHARD: FULL_SHARD inside a shard group, replicated across groups;
        gradients are reduce-scattered in the shard group, then all-reduced
        across the replicate group.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    BACKWARD_PRE: as soon as the current unit's backward starts (more overlap,
        one extra unit of full parameters alive).
    BACKWARD_POST: after the current unit's gradients were handed to
        reduce-scatter (less memory, less overlap).
    Pass ``None`` to the wrapper for no prefetch.
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


class TrainingState(enum.Enum):
    """Where a unit is in the forward/backward of one iteration."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"
    POST_BACKWARD = "POST_BACKWARD"


class ShardedState(enum.Enum):
    """Whether a unit's full parameters exist on this rank."""

    SHARDED = "SHARDED"
    UNSHARDING = "UNSHARDING"  # all-gather issued, not yet waited on
    UNSHARDED = "UNSHARDED"
