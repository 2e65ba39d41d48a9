"""The training-state machine and every hook the engine installs.

One :class:`UnitRuntime` per FSDP unit; the outermost unit that runs forward first becomes the root and owns a
:class:`RootRuntime` shared by all units below it (execution order, pending reduce-scatters, the end-of-backward
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
          shards and returns all units to IDLE. A unit whose parameters are
          all frozen has no gradient to wait for: an identity autograd
          function on its inputs reshards it once their gradients exist.
next:     the root's pre_forward is the one place where leftovers of an
          interrupted iteration are cleared (a backward that raised, a forward
          that raised, a forward with no backward): pending reduce-scatters
          are waited on and dropped, partial unsharded gradients and (after a
          broken backward) no_sync stashes discarded, units resharded, states
          IDLE. It also adopts requires_grad changes and notices gradients
          the user zeroed after no_sync (core/grads.py).
Hooks hold runtime objects through weak references: a hook on a tensor the
autograd graph or the user keeps must not keep a deleted model alive.
"""
from __future__ import annotations

import enum
import weakref
from typing import Any, Optional

import torch

from ..api import BackwardPrefetch
from . import collectives, offload, overlap, stale_graph, stash, torch_private, used_flags
from .buffers import POOL
from .reduce import PendingReduce
from .settings import UnitSettings
from .torch_private import in_backward_pass
from .tree import map_tensors, tensors_in
from .unit import ShardedState, Unit


class TrainingState(enum.Enum):
    """Where a unit is in the forward/backward of one iteration."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    PRE_BACKWARD = "PRE_BACKWARD"
    POST_BACKWARD = "POST_BACKWARD"


_BACKWARD = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
_LEGAL = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.PRE_BACKWARD,
                         # no pre-backward hook fired: the loss came from a
                         # tensor the unit did not return (the root keeps its
                         # full parameters, so its gradient is still right)
                         TrainingState.POST_BACKWARD},
    TrainingState.FORWARD: {TrainingState.IDLE},
    TrainingState.PRE_BACKWARD: {TrainingState.POST_BACKWARD, TrainingState.IDLE},
    # a unit used again after its post-backward (reentrant checkpointing runs
    # one backward per use; a frozen unit called twice) is gathered again
    TrainingState.POST_BACKWARD: {TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD,
                                  TrainingState.IDLE},
}


class TrainingStateError(RuntimeError):
    """An illegal training-state transition of a unit."""


class RootRuntime:
    """Per-root, per-iteration bookkeeping shared by every unit under the root."""

    def __init__(self, runtimes: list["UnitRuntime"]):
        self.runtimes = runtimes  # every unit's runtime under this root, the root's included
        self.order: list[UnitRuntime] = []  # forward order of this iteration
        self.prev_order: list[UnitRuntime] = []
        self.pending: list[PendingReduce] = []
        self.flags = used_flags.UsedFlags()  # reduces waiting for the one read of used flags per backward
        self.callback_queued = False
        self.no_sync = False
        # A backward ran inside no_sync since the last synchronizing one.
        # Symmetric across ranks, so it can gate a collective.
        self.stash_window = False
        # FSDPModule.set_post_optim_event: waited on by the next root pre-forward, then dropped.
        self.post_optim_event = None
        # During the root's forward: a CUDA event after every write to the shards (core/streams.py).
        self.shards_ready = None

    def position(self, rt: "UnitRuntime", order: list["UnitRuntime"]) -> int:
        return next((i for i, other in enumerate(order) if other is rt), -1)


class UnitRuntime:
    """Schedule of one unit: its training state and its hooks. Its knobs
    are the unit's :class:`~fullshard.core.settings.UnitSettings`
    (``settings``), read at each use."""

    def __init__(self, unit: Unit, forward_input_caster=None, root_input_caster=None):
        self.unit = unit
        self.state = TrainingState.IDLE
        self.forward_input_caster, self.root_input_caster = forward_input_caster, root_input_caster
        self.root: Optional[RootRuntime] = None
        self.is_root = False
        self.pre_backward_done = False
        self._grad_hook = None
        self.arm_grad_hook()

    @property
    def settings(self) -> UnitSettings:
        """The unit's mutable knobs (core/settings.py [Note: unit settings])."""
        return self.unit.settings

    def arm_grad_hook(self) -> None:
        """Register the post-accumulate-grad hook once the unit has trainable parameters."""
        if self.unit.needs_grad and self._grad_hook is None:
            self._grad_hook = self.unit.flat_full.register_post_accumulate_grad_hook(
                PostBackwardHook(weakref.ref(self)))

    def rearm_grad_hook(self) -> None:
        """Move the post-accumulate-grad hook to a new ``unit.flat_full``
        (made by a dtype conversion, see core/convert.py)."""
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None
        self.arm_grad_hook()

    def transition(self, new: TrainingState) -> None:
        if new not in _LEGAL[self.state]:
            raise TrainingStateError(
                f"[rank {collectives.rank()}] unit '{self.unit.name}': illegal training-state transition "
                f"{self.state.value} -> {new.value}")
        self.state = new

    @property
    def in_backward(self) -> bool:
        return self.state in _BACKWARD


def lazy_init_root(root: UnitRuntime, all_units: list[UnitRuntime]) -> None:
    """Make ``root`` the root of ``all_units`` (itself included).

    Raises:
        ValueError: a unit held by ranks outside the root's: the root's
            per-iteration agreements (gradient norm, leftover ``no_sync``
            stashes) run over the root's groups, which must cover every unit's.
    """
    cfg = root.unit.cfg
    mine = set(collectives.group_ranks(collectives.holding_group(cfg.shard_group, cfg.replicate_group)))
    for rt in all_units:
        their_cfg = rt.unit.cfg
        theirs = collectives.group_ranks(collectives.holding_group(their_cfg.shard_group, their_cfg.replicate_group))
        if not mine.issuperset(theirs):
            raise ValueError(
                f"[rank {collectives.rank()}] unit '{rt.unit.name}' is held by ranks {theirs}, outside its root "
                f"'{root.unit.name}' on ranks {sorted(mine)}; wrap the root on a process group that contains "
                "every nested unit's (pass the same process_group to both)")
    shared = RootRuntime(all_units)
    for rt in all_units:
        rt.root = shared
        rt.is_root = rt is root


def backward_broken(root: RootRuntime) -> bool:
    return bool(root.pending) or root.callback_queued or \
        any(rt.state in _BACKWARD for rt in root.runtimes)


def require_idle(root: RootRuntime, what: str) -> None:
    """The one idle check of the public methods that must run between
    iterations (``no_sync``, ``clip_grad_norm_``, ``summon_full_params``,
    state dicts, optimizer state dicts). Leftovers of a backward that raised
    are cleared first (as the next forward would), so such a call right after
    a caught exception works.

    Raises:
        RuntimeError: a forward or backward is in flight (the busy units named).
    """
    if not in_backward_pass() and backward_broken(root):
        start_iteration(root)
    busy = [rt.unit.name for rt in root.runtimes if rt.state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(f"[rank {collectives.rank()}] {what} cannot run during forward or backward "
                           f"(units busy: {busy}); call it between iterations")


def start_iteration(root: RootRuntime, discard: bool = False) -> None:
    """Begin a clean iteration: clear whatever an interrupted one left behind
    (see [Note: one iteration]) and adopt changes the user made between
    iterations (``requires_grad_()``, gradients zeroed after ``no_sync``).
    ``discard`` (``FSDPModule.reset_iter_state``): also drop every
    accumulation in progress (``no_sync`` stashes, HSDP partial sums)."""
    for rt in root.runtimes:  # before anything is cleared: the user must fix this first
        rt.unit.check_views()
    broken = discard or backward_broken(root)
    lost = stash.lost_windows([rt.unit for rt in root.runtimes]) if broken and not discard else []
    root.flags.reset()  # a broken backward's reduces that wait for their flags are dropped, as pending ones
    for pending in root.pending:
        pending.abandon()
    root.pending = []
    root.callback_queued = False
    if broken:
        root.stash_window = False
    for rt in root.runtimes:
        rt.state = TrainingState.IDLE
        rt.pre_backward_done = False
        rt.settings.forward_depth = 0
        unit = rt.unit
        unit.pooled_grad.release(unit.take_full_grad()[0])  # a partial gradient of a backward that raised
        if broken:  # reset_iter_state, or sums of a window a backward broke (reported: stash.lost_windows)
            unit.stash.abandon()
            unit.stash.drop_held()
        unit.restore_all_params()  # a state-dict call that raised between install and restore
        if unit.state is not ShardedState.SHARDED and (broken or not unit.kept_fresh()):
            # Gathered by a forward with no backward, or kept gathered
            # (unshard(), reshard_after_backward=False) while an optimizer
            # step changed the shards: the full parameters are stale.
            unit.reshard()
        unit.reset_views()
        unit.drop_partial()
        unit.stash.check()
        if unit.refresh_requires_grad():
            rt.arm_grad_hook()
    if root.order:
        root.prev_order = root.order
    root.order = []
    stash.refuse_lost(lost, [rt.unit for rt in root.runtimes])  # once everything above is clean


def pre_forward(rt: UnitRuntime, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before the unit's forward: unshard and expose full parameters.

    Raises:
        RuntimeError: called inside ``summon_full_params``.
    """
    in_bwd = in_backward_pass()
    if rt.in_backward and in_bwd:
        # Recomputation under activation checkpointing: the unit is already
        # gathered for its backward; expose it and cast inputs as forward did.
        rt.unit.ensure_unsharded()
        rt.unit.use_full_params()
        return _cast_inputs(rt, args, kwargs)
    if rt.unit.summoned:
        raise RuntimeError(f"[rank {collectives.rank()}] unit '{rt.unit.name}': forward inside summon_full_params(); "
                           "leave the context before running the model")
    root = rt.root
    if rt.is_root or (not in_bwd and backward_broken(root)):
        start_iteration(root)
    if rt.is_root and root.post_optim_event is not None:
        # The all-gathers run on the current stream: it waits on the event before they are issued.
        event, root.post_optim_event = root.post_optim_event, None
        event.wait()
    # At the root the optimizer step and any load are behind us: the forward's all-gathers may run ahead.
    ready = overlap.ShardsReady.record(rt.unit.cfg.compute_device, root.runtimes) if rt.is_root else root.shards_ready
    after = None if in_bwd else ready
    rt.transition(TrainingState.FORWARD)
    if root.position(rt, root.order) < 0:
        root.order.append(rt)
    if not in_bwd and rt.unit.kept_stale():  # gathered before a shard change (kept, or a forward without backward)
        rt.unit.reshard()
        rt.unit.reset_views()
    rt.unit.ensure_unsharded(after)
    rt.unit.use_full_params()
    for other in rt.settings.forward_prefetch_units or ():
        if other.unit.state is ShardedState.SHARDED:
            other.unit.unshard(after)
    if rt.settings.forward_prefetch:
        i = root.position(rt, root.prev_order)
        if 0 <= i < len(root.prev_order) - 1:
            nxt = root.prev_order[i + 1].unit
            if nxt.state is ShardedState.SHARDED:
                nxt.unshard(after)
    args, kwargs = _cast_inputs(rt, args, kwargs)
    if torch.is_grad_enabled() and not rt.unit.needs_grad and rt.unit.slots:
        args, kwargs = _reshard_after_input_grads(rt, args, kwargs)
    root.shards_ready = ready  # published only now: a failed root pre-forward leaves no stale event
    return args, kwargs


def _cast_inputs(rt: UnitRuntime, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    caster = rt.root_input_caster if rt.is_root else rt.forward_input_caster
    return (args, kwargs) if caster is None else caster(args, kwargs)


class _FrozenPostBackward(torch.autograd.Function):
    """Identity on a frozen unit's inputs; its backward runs once the unit's
    backward has produced the inputs' gradients, the last moment the unit's
    full parameters are needed."""

    @staticmethod
    def forward(ctx, rt_ref, *tensors):
        ctx.rt_ref = rt_ref
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        rt = ctx.rt_ref()
        if rt is not None and rt.state is TrainingState.PRE_BACKWARD:
            rt.transition(TrainingState.POST_BACKWARD)
            _reshard_after_backward(rt)
        return (None, *grads)


def _reshard_after_input_grads(rt: UnitRuntime, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    needing = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not needing:
        return args, kwargs
    out = _FrozenPostBackward.apply(weakref.ref(rt), *needing)
    swap = {id(t): o for t, o in zip(needing, out)}
    return map_tensors(lambda t: swap.get(id(t), t), (args, kwargs))


def post_forward(rt: UnitRuntime, output: Any, extra: tuple = ()) -> Any:
    """After the unit's forward: reshard (FULL_SHARD) and arm backward hooks
    on every tensor of ``output`` and of ``extra`` (tensors the unit stored
    on its modules instead of returning them)."""
    if rt.in_backward and in_backward_pass():
        return output
    grad_on = torch.is_grad_enabled()
    # Without grad no backward follows, so nothing is worth keeping gathered.
    if not grad_on:
        rt.unit.reshard()
    elif rt.settings.reshard_after_forward and not rt.is_root:
        rt.unit.reshard_partial()
    rt.transition(TrainingState.IDLE)
    if rt.is_root:
        rt.root.shards_ready = None  # outside the root's forward, writes to the shards are not ours to know
    if grad_on and rt.is_root:  # activations peak next: cache nothing beside them (buffers.py [Note: buffer reuse])
        POOL.clear()
    if grad_on:
        hook = PreBackwardHook(weakref.ref(rt), stale_graph.snapshot(rt.unit))
        for t in tensors_in((output, extra)):
            if t.requires_grad:
                t.register_hook(hook)
    return output


def _prefetch_backward(rt: UnitRuntime) -> None:
    root = rt.root
    i = root.position(rt, root.order)
    if i <= 0:
        return
    target = root.order[i - 1]
    if target.state is TrainingState.IDLE and target.unit.state is ShardedState.SHARDED and \
            target.settings.unshard_in_backward:
        target.unit.unshard()


def _queue_end_of_backward(root: RootRuntime) -> None:
    if not root.callback_queued:
        root.callback_queued = True
        torch_private.queue_end_of_backward(EndOfBackward(weakref.ref(root)))


class PreBackwardHook:
    """Tensor hook on a unit's forward outputs: gathers the unit before its
    backward runs. Fires once per output; the first firing prefetches."""

    def __init__(self, rt_ref: weakref.ref, seen: int):
        self.rt_ref, self.seen = rt_ref, seen  # seen: what the forward ran on ([Note: stale graphs])

    def __call__(self, grad: torch.Tensor) -> None:
        rt = self.rt_ref()
        if rt is None:
            return None
        stale_graph.check(rt.unit, self.seen)
        _queue_end_of_backward(rt.root)
        if rt.state is not TrainingState.PRE_BACKWARD:
            rt.transition(TrainingState.PRE_BACKWARD)
        if not rt.settings.unshard_in_backward:  # set_unshard_in_backward(False): backward needs no parameters
            return None
        rt.unit.ensure_unsharded()
        # Grad-mode views: a recomputation that bypasses our pre_forward (a
        # checkpointed module inside the unit) must build a graph to them.
        rt.unit.use_full_params(grad=True)
        if not rt.pre_backward_done:
            rt.pre_backward_done = True
            if rt.settings.backward_prefetch_units is not None:
                for other in rt.settings.backward_prefetch_units:
                    if other.state is TrainingState.IDLE and other.unit.state is ShardedState.SHARDED and \
                            other.settings.unshard_in_backward:
                        other.unit.unshard()
            elif rt.settings.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                _prefetch_backward(rt)
        return None


class PostBackwardHook:
    """Post-accumulate-grad hook on the unit's unsharded flat parameter: runs
    once the unit's whole full gradient exists."""

    def __init__(self, rt_ref: weakref.ref):
        self.rt_ref = rt_ref

    def __call__(self, flat_full: torch.Tensor) -> None:
        rt = self.rt_ref()
        if rt is None:
            return
        unit, root = rt.unit, rt.root
        _queue_end_of_backward(root)
        rt.transition(TrainingState.POST_BACKWARD)
        grad, used = unit.take_full_grad()
        if grad is not None:
            if root.no_sync or not rt.settings.requires_gradient_sync:
                unit.stash.add(grad, used)
                unit.pooled_grad.release(grad, keep=unit.stash.holds(grad))
                root.stash_window = True
            else:
                root.pending.append(unit.reduce_grads(*unit.stash.pop(grad, used)))
                root.flags.synced.add(id(unit))
                unit.pooled_grad.release(grad)  # reduce_grads copied it into the reduce-scatter input
                # Each in flight holds a unit-sized input buffer: bounded
                # (set_reduce_scatter_max_input_buffers), else a full model's
                # worth of gradients would stay alive until the end of backward.
                while len(root.pending) > unit.settings.max_input_buffers:
                    root.pending.pop(0).finish(root.flags)
        else:
            unit.pooled_grad.release(None)
        _reshard_after_backward(rt)


def _reshard_after_backward(rt: UnitRuntime) -> None:
    _reshard_or_keep(rt)
    if rt.settings.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch_backward(rt)


def _reshard_or_keep(rt: UnitRuntime) -> None:
    if rt.unit.state is not ShardedState.SHARDED:
        # Grad mode is on in a backward with create_graph=True, whose graph may save the full parameters.
        if rt.settings.reshard_after_backward and not torch.is_grad_enabled():
            rt.unit.reshard()
        else:
            rt.unit.keep_unsharded()


class EndOfBackward:
    """Autograd-engine callback at the end of backward: waits for every reduce-scatter, writes gradient shards."""

    def __init__(self, root_ref: weakref.ref):
        self.root_ref = root_ref

    def __call__(self) -> None:
        root = self.root_ref()
        if root is not None:
            end_of_backward(root)


def _reduce_leftover_stashes(root: RootRuntime) -> None:
    """Reduce the no_sync stash of every unit the synchronizing backward did
    not reach on some rank (DDP with ``find_unused_parameters=True`` reduces
    such gradients too). One small all-reduce makes every rank agree on
    which units those are, unless this backward reduced every unit (then
    no rank has a stash left: core/used_flags.py ``all_synced``)."""
    for rt in root.runtimes:
        rt.unit.stash.check()
    if root.flags.all_synced(root.runtimes):
        return
    cfg = root.runtimes[0].unit.cfg
    flags = torch.tensor([1.0 if rt.unit.stash.active and rt.settings.requires_gradient_sync else 0.0
                          for rt in root.runtimes], device=cfg.compute_device)  # NCCL reduces device tensors
    for group in (cfg.shard_group, cfg.replicate_group):
        if group is not None:
            collectives.all_reduce(flags, group, "max", tag="no_sync stashes")
    for rt, flag in zip(root.runtimes, flags.tolist()):
        if flag:
            unit = rt.unit
            unit.reduce_grads(*unit.stash.pop(None, [False] * len(unit.layout.params))).finish(root.flags)
        elif rt.settings.requires_gradient_sync:
            rt.unit.stash.backwards = 0  # no rank stashed: nothing to fold (core/stash.py)


def end_of_backward(root: RootRuntime) -> None:
    # Every backward finishes its reduce-scatters, also under
    # set_is_last_backward(False): a gradient read before the next forward
    # (clipping, logging) must never be a partial sum.
    for pending in root.pending:
        pending.finish(root.flags)
    root.pending = []
    for rt in root.runtimes:  # world_size_invariant: the backwards of each window (core/stash.py)
        rt.unit.stash.end_backward(stashing=root.no_sync or not rt.settings.requires_gradient_sync)
    if root.stash_window and not root.no_sync:
        _reduce_leftover_stashes(root)
        # Units under set_requires_gradient_sync(False) keep accumulating.
        root.stash_window = not all(rt.settings.requires_gradient_sync for rt in root.runtimes)
    root.flags.flush()  # the one batched read of this backward, if any unit needs it
    offload.wait_all(rt.unit for rt in root.runtimes)  # .grad final on the host (core/offload.py)
    root.flags.reset()
    for rt in root.runtimes:
        rt.unit.drop_partial()  # a unit the backward did not reach
        _reshard_or_keep(rt)
        rt.state = TrainingState.IDLE
        rt.pre_backward_done = False
    root.callback_queued = False
