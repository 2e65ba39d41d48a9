"""The training-state machine and every hook the engine installs.

One :class:`UnitRuntime` per FSDP unit; the outermost unit that runs forward
first becomes the root and owns a :class:`RootRuntime` shared by all units
below it (execution order, pending reduce-scatters, the end-of-backward
callback).

[Note: one iteration]
forward:  root pre_forward resets per-iteration state; each unit's
          pre_forward unshards (waits for a prefetched all-gather if any) and
          exposes full-parameter views; post_forward reshards (FULL_SHARD,
          non-root) and registers PreBackwardHook on outputs.
backward: PreBackwardHook unshards the unit again and prefetches the next
          unit in reverse forward order (BACKWARD_PRE); PostBackwardHook runs
          once the unit's full gradient is accumulated, issues its
          reduce-scatter and reshards; end_of_backward (queued on the
          autograd engine) waits for every reduce-scatter, writes gradient
          shards and returns all units to IDLE.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..api import BackwardPrefetch, ShardedState, TrainingState
from . import collectives as C
from .unit import PendingReduce, Unit

# Reduce-scatters allowed in flight before the oldest is waited on: each holds
# a unit-sized input buffer, so an unbounded queue would keep a full model's
# worth of gradients alive until the end of backward.
MAX_INFLIGHT_REDUCES = 2

_LEGAL = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.PRE_BACKWARD},
    TrainingState.FORWARD: {TrainingState.IDLE},
    TrainingState.PRE_BACKWARD: {TrainingState.POST_BACKWARD, TrainingState.IDLE},
    TrainingState.POST_BACKWARD: {TrainingState.IDLE},
}


class TrainingStateError(RuntimeError):
    """An illegal training-state transition of a unit."""


class RootRuntime:
    """Per-root, per-iteration bookkeeping shared by every unit under the root."""

    def __init__(self, units: list["UnitRuntime"]):
        self.units = units
        self.order: list[UnitRuntime] = []  # forward order of this iteration
        self.prev_order: list[UnitRuntime] = []
        self.pending: list[PendingReduce] = []
        self.callback_queued = False
        self.no_sync = False

    def position(self, rt: "UnitRuntime", order: list["UnitRuntime"]) -> int:
        for i, other in enumerate(order):
            if other is rt:
                return i
        return -1


class UnitRuntime:
    """Schedule of one unit: its training state and its hooks."""

    def __init__(self, unit: Unit, *, reshard_after_forward: bool,
                 backward_prefetch: Optional[BackwardPrefetch], forward_prefetch: bool,
                 forward_input_caster=None):
        self.unit = unit
        self.state = TrainingState.IDLE
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.forward_input_caster = forward_input_caster
        self.root: Optional[RootRuntime] = None
        self.is_root = False
        self.pre_backward_done = False
        self._grad_hook = None
        if unit.needs_grad:
            self._grad_hook = unit.flat_full.register_post_accumulate_grad_hook(PostBackwardHook(self))

    def transition(self, new: TrainingState) -> None:
        if new not in _LEGAL[self.state]:
            raise TrainingStateError(
                f"[rank {C.rank()}] unit '{self.unit.name}': illegal training-state transition "
                f"{self.state.value} -> {new.value}")
        self.state = new

    @property
    def in_backward(self) -> bool:
        return self.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)


def lazy_init_root(root: UnitRuntime, all_units: list[UnitRuntime]) -> None:
    """Make ``root`` the root of ``all_units`` (itself included)."""
    shared = RootRuntime(all_units)
    for rt in all_units:
        rt.root = shared
        rt.is_root = rt is root


def _start_iteration(root: RootRuntime) -> None:
    """Called by the root's pre_forward when no backward is in flight."""
    if root.pending or root.callback_queued or any(rt.state is not TrainingState.IDLE for rt in root.units):
        # The previous forward had no backward (e.g. its loss was discarded).
        end_of_backward(root)
    for rt in root.units:
        # A unit still gathered here (a forward with no backward, e.g. eval
        # under SHARD_GRAD_OP) may hold stale full parameters: gather afresh.
        if rt.unit.state is not ShardedState.SHARDED:
            rt.unit.reshard()
        rt.unit.reset_views()
        rt.pre_backward_done = False
    if root.order:
        root.prev_order = root.order
    root.order = []


def pre_forward(rt: UnitRuntime, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before the unit's forward: unshard and expose full parameters."""
    if rt.in_backward:
        # Recomputation under activation checkpointing: the unit is already
        # gathered for its backward; expose it and cast inputs as forward did.
        rt.unit.ensure_unsharded()
        rt.unit.use_full_params()
        return _cast_inputs(rt, args, kwargs)
    if rt.is_root:
        _start_iteration(rt.root)
    rt.transition(TrainingState.FORWARD)
    root = rt.root
    if root.position(rt, root.order) < 0:
        root.order.append(rt)
    rt.unit.ensure_unsharded()
    rt.unit.use_full_params()
    if rt.forward_prefetch:
        i = root.position(rt, root.prev_order)
        if 0 <= i < len(root.prev_order) - 1:
            nxt = root.prev_order[i + 1].unit
            if nxt.state is ShardedState.SHARDED:
                nxt.unshard()
    return _cast_inputs(rt, args, kwargs)


def _cast_inputs(rt: UnitRuntime, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if rt.forward_input_caster is None:
        return args, kwargs
    return rt.forward_input_caster(args, kwargs)


def post_forward(rt: UnitRuntime, output: Any) -> Any:
    """After the unit's forward: reshard (FULL_SHARD) and arm backward hooks."""
    if rt.in_backward:
        return output
    grad_on = torch.is_grad_enabled()
    # Without grad no backward follows, so nothing is worth keeping gathered.
    if not grad_on or (rt.reshard_after_forward and not rt.is_root):
        rt.unit.reshard()
    rt.transition(TrainingState.IDLE)
    if grad_on:
        hook = PreBackwardHook(rt)
        for t in tree_flatten(output)[0]:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(hook)
    return output


def _prefetch_backward(rt: UnitRuntime) -> None:
    root = rt.root
    i = root.position(rt, root.order)
    if i <= 0:
        return
    target = root.order[i - 1]
    if target.state is TrainingState.IDLE and target.unit.state is ShardedState.SHARDED:
        target.unit.unshard()


class PreBackwardHook:
    """Tensor hook on a unit's forward outputs: gathers the unit before its
    backward runs. Fires once per output; only the first firing acts."""

    def __init__(self, rt: UnitRuntime):
        self.rt = rt

    def __call__(self, grad: torch.Tensor) -> None:
        rt = self.rt
        root = rt.root
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(EndOfBackward(root))
        if rt.pre_backward_done:
            return None
        rt.pre_backward_done = True
        rt.transition(TrainingState.PRE_BACKWARD)
        rt.unit.ensure_unsharded()
        rt.unit.use_full_params()
        if rt.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_backward(rt)
        return None


class PostBackwardHook:
    """Post-accumulate-grad hook on the unit's unsharded flat parameter: runs
    once the unit's whole full gradient exists."""

    def __init__(self, rt: UnitRuntime):
        self.rt = rt

    def __call__(self, flat_full: torch.Tensor) -> None:
        rt = self.rt
        if rt.state is TrainingState.POST_BACKWARD:
            return  # already reduced this iteration (reentrant use)
        rt.transition(TrainingState.POST_BACKWARD)
        unit, root = rt.unit, rt.root
        grad = unit.take_full_grad()
        if grad is not None:
            if root.no_sync:
                unit.stash_grad(grad)
            else:
                root.pending.append(unit.reduce_grads(unit.pop_stashed(grad)))
                while len(root.pending) > MAX_INFLIGHT_REDUCES:
                    root.pending.pop(0).finish()
        unit.reshard()
        if rt.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(rt)


class EndOfBackward:
    """Autograd-engine callback at the end of backward: waits for every
    reduce-scatter, writes gradient shards, returns units to IDLE."""

    def __init__(self, root: RootRuntime):
        self.root = root

    def __call__(self) -> None:
        end_of_backward(self.root)


def end_of_backward(root: RootRuntime) -> None:
    for pending in root.pending:
        pending.finish()
    root.pending = []
    for rt in root.units:
        if rt.unit.state is not ShardedState.SHARDED:
            rt.unit.reshard()
        rt.state = TrainingState.IDLE
        rt.pre_backward_done = False
    root.callback_queued = False
