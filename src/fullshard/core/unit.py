"""One FSDP unit: its shards, its unsharded flat parameter, and the three operations the schedule calls:
unshard, reshard and reduce_grads (whose mechanics are in core/reduce.py).

See ``core/flat.py`` [Note: flat layouts] for how elements are placed, and ``core/params.py``
[Note: full-parameter views shadow sharded parameters] for how modules see full parameters.
"""
from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Optional

import torch
import torch.nn as nn

from . import collectives, comm, extensions, flat, grads, optim_guard, optim_hooks, placement, registry, torch_private
from .added_params import check as check_added
from .buffers import POOL
from .full_writes import check as check_full_writes, record as record_full, written as full_written
from .invariant import start_fold
from .overlap import all_gather as issue_all_gather
from .params import ParamSlot
from .reduce import PendingReduce, start_reduce
from .settings import UnitSettings
from .stash import GradStash

_STEPS = {"count": 0}  # optimizer steps since kept_fresh first needed them


def _count_step(optimizer, args, kwargs) -> None:
    """The optimizer pre- and post-step callback ([Note: optimizer step hooks])."""
    _STEPS["count"] += 1


class ShardedState(enum.Enum):
    """Whether a unit's full parameters exist on this rank."""

    SHARDED = "SHARDED"
    UNSHARDING = "UNSHARDING"  # all-gather issued, not yet waited on
    UNSHARDED = "UNSHARDED"


@dataclasses.dataclass(frozen=True)
class UnitConfig:
    """A unit's immutable facts, fixed at construction (what may change later lives on
    :class:`~fullshard.core.settings.UnitSettings`, see [Note: unit settings]).

    Attributes:
        shard_group: group the parameters are sharded over (N ranks).
        replicate_group: group holding replicas of each shard (HYBRID_SHARD,
            NO_SHARD); None when there is no replication.
        dp_world_size: data-parallel degree = shard size × replicate size;
            gradients are divided by it before being summed.
        compute_device: where all-gather, forward and backward run.
        param_dtype: dtype of full parameters (all-gather and compute).
        reduce_dtype: dtype gradients are reduced in.
        offload_params: keep shards and gradient shards on the host.
        keep_low_precision_grads: gradient shards in the compute dtype
            instead of the master dtype (see ``MixedPrecision``).
        pin_memory: with ``offload_params`` and an accelerator, keep the
            host shards in pinned memory.
        post_forward_group: ``reshard_after_forward=k``: the group of k
            consecutive shard-group ranks this rank belongs to. After forward
            each keeps 1/k of the full parameters (:meth:`Unit.reshard_partial`)
            and backward all-gathers within it (the hpZ scheme of ZeRO++,
            Wang et al. 2023, §3.2). None: reshard fully.
        invariant_layout: ``world_size_invariant=True``: (shard-group rank,
            replicate-group rank) of every world rank (core/invariant.py);
            None: gradients are reduce-scattered and averaged.
    """

    shard_group: object
    replicate_group: object
    dp_world_size: int
    compute_device: torch.device
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload_params: bool = False
    keep_low_precision_grads: bool = False
    pin_memory: bool = True
    post_forward_group: object = None
    invariant_layout: Optional[tuple] = None
    mp_policy: object = None  # fully_shard's MixedPrecisionPolicy, for all-gather extension hooks


class UnitStateError(RuntimeError):
    """An illegal sharded-state transition of a unit."""


class Unit:
    """Shards of one unit's parameters and their unsharded counterpart.

    The sharded ``nn.Parameter`` objects (what the optimizer sees and ``named_parameters()`` returns) are views of
    ``flat_shard`` (fp32 master, 1-D, ``layout.shard_numel`` elements); their ``.grad`` is in ``grad_dtype``. While
    unsharded, each owning module attribute resolves to a view of ``flat_full`` (param-major, ``N · S`` elements,
    ``compute_dtype``), which is an autograd leaf whose ``.grad`` collects the unit's full gradient. Per-parameter
    work is the slots' (:class:`~fullshard.core.params.ParamSlot`); the ``no_sync`` stash is ``stash``
    (core/stash.py); value replacement after wrapping is in core/convert.py.
    """

    side: tuple = ()  # frozen parts of other dtypes (core/mixed.py [Note: units that mix dtypes])

    def __init__(self, name: str, slots: list[ParamSlot], cfg: UnitConfig, settings: UnitSettings):
        optim_guard.install()  # optimizers that need whole tensors fail loudly on shards
        self.name = name
        self.cfg = cfg
        self.settings = settings  # every mutable knob (core/settings.py [Note: unit settings])
        self.slots = slots
        self.world = collectives.group_size(cfg.shard_group)
        self.rank = collectives.group_rank(cfg.shard_group)
        placed = placement.assign_owners(name, [s.placement for s in slots], [s.param.numel() for s in slots],
                                         self.world, placement.group_tally(cfg.shard_group, self.world))
        self._set_layout(flat.make_layout([(s.fqn, s.param.shape, s.param.requires_grad) for s in slots],
                                          self.world, placed))
        self.state = ShardedState.SHARDED
        self.needs_grad = any(p.requires_grad for p in self.layout.params)
        self._views: Optional[list[torch.Tensor]] = None  # grad-mode views, one set per iteration
        self._gather_buf: Optional[torch.Tensor] = None
        self._partial: Optional[torch.Tensor] = None  # see reshard_partial
        self._gather_work = None
        self._gather_alloc = None  # where _gather_buf came from (core/comm.py)
        self.summoned = False  # inside summon_full_params
        # Shard versions when the unit was deliberately left unsharded
        # (FSDPModule.unshard, reshard_after_backward=False); see kept_fresh.
        self._kept_version: Optional[tuple[int, ...]] = None
        self._gather_version: Optional[tuple[int, ...]] = None  # shard_versions() when the last all-gather began
        self.full_version: Optional[int] = None  # core/full_writes.py [Note: writes to gathered parameters]
        # Reduce-scatter outputs summed while requires_all_reduce is False (HSDP), until the replicas' all-reduce.
        self.partial_out: Optional[torch.Tensor] = None
        # Stack of install_params records: (module, attr, previous value).
        self._installed: list[list[tuple[nn.Module, str, object]]] = []
        self.stash = GradStash(self)  # no_sync accumulation; core/stash.py [Note: no_sync and zero_grad]
        self.pooled_grad = grads.PooledGrad()  # core/grads.py [Note: pooled full gradient]
        self.ext: dict = {}  # layout index -> gather state; core/extensions.py [Note: all-gather extensions]
        # Layout indices whose reduced gradient awaits its post-accumulate-grad hooks (core/post_accumulate.py).
        self.hooks_due: set[int] = set()
        self._shard()
        registry.register(self)

    # ------------------------------------------------------------------ setup
    def _shard(self) -> None:
        """Keep only this rank's chunks; swap the modules' parameters for them."""
        master_dtype = self.slots[0].param.dtype if self.slots else torch.float32
        # Meta parameters with no row initializer (fully_shard on a meta
        # module) keep a meta shard until ``to_empty`` (see core/convert.py ``adopt``).
        meta = [s.param.is_meta and s.init_rows is None for s in self.slots]
        if any(meta) and not all(meta):
            raise ValueError(f"[rank {collectives.rank()}] unit '{self.name}': some parameters are on the meta "
                             "device and others are not; materialize all of them or none before sharding")
        self.flat_shard = self.new_shard(master_dtype, torch.device("meta") if any(meta) else None)
        if not any(meta):
            flat.shard_into(self.flat_shard, self.layout,
                            [s.init_rows if s.param.is_meta else s.param for s in self.slots], self.rank)
        for slot, view in zip(self.slots, flat.shard_views(self.flat_shard, self.layout, self.rank)):
            slot.take_shard(view, self.world, self.rank)
        self._make_full()

    def new_shard(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
        """A zeroed flat shard (``layout.shard_numel`` elements) where shards live."""
        cfg = self.cfg
        if device is None:
            device = torch.device("cpu") if cfg.offload_params else cfg.compute_device
        # Pinned host memory makes the per-unit host<->device copies
        # asynchronous; only meaningful (and only allowed) with an accelerator.
        pin = cfg.offload_params and cfg.pin_memory and cfg.compute_device.type != "cpu" and device.type == "cpu"
        return torch.zeros(self.layout.shard_numel, dtype=dtype, device=device, pin_memory=pin)

    @property
    def sharded_params(self) -> list[nn.Parameter]:
        """The registered sharded parameters, in layout order."""
        return [s.sharded for s in self.slots]

    def _make_full(self) -> None:
        """Derive the dtypes from the master dtype and make a (freed) unsharded flat."""
        cfg, master = self.cfg, self.flat_shard
        self.compute_dtype = cfg.param_dtype or master.dtype
        self.reduce_dtype = cfg.reduce_dtype or self.compute_dtype
        self.grad_dtype = self.compute_dtype if cfg.keep_low_precision_grads else master.dtype
        for slot in self.slots:
            slot.record_view_ptr()  # where its memory must stay (see check_views)
        # With one rank per shard and nothing to cast or move, the unsharded
        # flat is the shard itself: no copy, never freed.
        on_compute = not cfg.offload_params or cfg.compute_device == torch.device("cpu")
        self.aliased = self.world == 1 and self.compute_dtype == master.dtype and on_compute
        if self.aliased:
            self.flat_full = master.detach()
        else:
            self.flat_full = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype,
                                         device=cfg.compute_device)
            self.flat_full.untyped_storage().resize_(0)  # memory comes from the pool when unsharded
        self.flat_full.requires_grad_(self.needs_grad)

    def set_shard(self, new: torch.Tensor) -> None:
        """Make ``new`` the flat shard: every registered parameter (the same
        object, so an optimizer holding it keeps working) views it."""
        self.flat_shard = new
        for slot, view in zip(self.slots, flat.shard_views(new, self.layout, self.rank)):
            slot.follow_shard(view)
        self._make_full()
        self._views = None

    def _set_layout(self, layout: flat.FlatLayout) -> None:
        """Make ``layout`` the unit's, each slot keeping its entry."""
        self.layout = layout
        for slot, entry in zip(self.slots, layout.params):
            slot.layout = entry

    def check_views(self) -> None:
        """Raise if a sharded parameter's memory is no longer its view of ``flat_shard`` (``.half()`` / ``.to()`` on
        a module inside the unit instead of the wrapper, or ``p.data = ...``), a module's registered parameter is no
        longer the sharded one (replaced), or a parameter was added (core/added_params.py): the all-gather would
        read values the optimizer no longer updates, or no rank's gradient would be averaged."""
        if self.flat_shard.is_meta:
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{self.name}': its parameters are still on the meta device; "
                "call model.to_empty(device=...) and initialize them before running the model")
        for slot in self.slots:
            problem = slot.view_problem(self.flat_shard.dtype, registered=not self._installed)
            if problem:
                raise RuntimeError(f"[rank {collectives.rank()}] unit '{self.name}': {problem}")
        check_added(self)

    def _full_nbytes(self) -> int:
        return self.layout.unsharded_numel * self.flat_full.element_size()

    def _lend_full(self, oldest: bool = False):  # the unsharded flat's memory (unless held): POOL.lend's event
        if self.flat_full.untyped_storage().nbytes() == 0:
            return POOL.lend(self.flat_full.untyped_storage(), self._full_nbytes(), oldest)
        return None

    def _free_full(self) -> None:
        POOL.reclaim(self.flat_full.untyped_storage())  # see core/buffers.py [Note: buffer reuse]

    def unsharded_bytes(self) -> int:
        """Bytes held now for full parameters: the unsharded flat's storage and an all-gather output in flight (0
        when resharded; 0 for an aliased unit, which computes on its shard)."""
        if self.aliased:
            return 0
        held = self.flat_full.untyped_storage().nbytes()
        held += 0 if self._partial is None else self._partial.untyped_storage().nbytes()
        return held + (0 if self._gather_buf is None else self._gather_buf.untyped_storage().nbytes())

    def full_grad_bytes(self) -> int:
        """Bytes of an unsharded gradient held now: ``flat_full.grad``, or the
        pooled buffer handed to autograd and not yet adopted or returned."""
        grad = self.flat_full.grad
        if grad is not None:
            return grad.untyped_storage().nbytes()
        return self.pooled_grad.nbytes()

    def check_sharded(self, op: str) -> None:
        self._check((ShardedState.SHARDED,), op)

    def _check(self, allowed: tuple[ShardedState, ...], op: str) -> None:
        if self.state not in allowed:
            raise UnitStateError(
                f"[rank {collectives.rank()}] unit '{self.name}': cannot {op} in sharded state "
                f"{self.state.value}; expected one of {[s.value for s in allowed]}")

    # ---------------------------------------------------------------- unshard
    def unshard(self, after=None) -> None:
        """Issue the all-gather of this unit (asynchronous). SHARDED → UNSHARDING. ``after``: a root's forward's
        ``overlap.ShardsReady`` (its event marks the writes to the shards before the forward), or None."""
        self._check((ShardedState.SHARDED,), "unshard")
        self.state = ShardedState.UNSHARDING
        extensions.start(self)
        if self.aliased or not self.slots:
            return
        self._gather_version = self.shard_versions()
        numel, dtype, device, tag = self.layout.unsharded_numel, self.compute_dtype, self.cfg.compute_device, \
            f"unit '{self.name}'"
        send, group, cast = self.flat_shard, self.cfg.shard_group, None
        if self._partial is not None:  # kept after forward: gather within the post-forward group
            send, group = self._partial, self.cfg.post_forward_group
        elif send.dtype != dtype or send.device != device:
            cast = (device, dtype)
        settings = self.settings
        custom = settings.custom_all_gather if collectives.group_size(group) > 1 else None
        if custom is not None:
            send = send if cast is None else send.to(device, dtype, non_blocking=True)
            self._gather_buf = comm.custom_all_gather(custom, send, group, numel, dtype, device,
                                                      collectives.group_rank(group), tag)
            self._gather_alloc = comm.FOREIGN
            return
        self._gather_alloc = settings.allocator
        # Side streams (core/streams.py [Note: streams and events]) may start once the shards' writers
        # (``after``) and the buffer's last users are done, if both are known.
        after = after.event_for(self, send) if after and not self.ext and settings.allocator is None else None
        if cast is not None and self.world == 1 and settings.allocator is None:
            # One rank: both layouts are the same (core/flat.py [Note: flat layouts]), so the cast
            # shard is written straight into the unsharded flat, with no copy-out.
            freed = self._lend_full(oldest=after is not None)
            out = self.flat_full.data
        elif settings.allocator is None:
            self._gather_buf, freed = POOL.take_with_event(numel, dtype, device, oldest=after is not None)
            out = self._gather_buf
        else:
            out = self._gather_buf = comm.take(self._gather_alloc, numel, dtype, device)
            settings.allocator.prepare(out, group)
            freed = None
        self._gather_work = issue_all_gather(out, send, group, tag, cast,
                                             (after, freed) if after is not None and freed is not None else None)

    def wait_unshard(self) -> None:
        """Finish the all-gather and lay out full parameters. UNSHARDING → UNSHARDED."""
        self._check((ShardedState.UNSHARDING,), "wait for unshard")
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        if self._gather_buf is not None:
            self._lend_full()
            # .data: a write with its own version counter, so tensors autograd
            # saved in forward (views of this storage) stay valid for backward.
            flat.copy_out(self.flat_full.data, self._gather_buf, self.layout)
            comm.give(self._gather_alloc, self._gather_buf)
            self._gather_buf = None
        extensions.finish(self)
        self.drop_partial()
        self.full_version = record_full(self)
        self.state = ShardedState.UNSHARDED

    def ensure_unsharded(self, after=None) -> None:
        if self.state is ShardedState.SHARDED:
            self.unshard(after)
        if self.state is ShardedState.UNSHARDING:
            self.wait_unshard()

    def use_full_params(self, grad: Optional[bool] = None) -> None:
        """Point every owning module attribute at its full-parameter view
        (see [Note: full-parameter views shadow sharded parameters]).

        Under grad, views are made once per iteration (see ``reset_views``) and reused when the unit runs again,
        so all uses feed one autograd node (:class:`~fullshard.core.grads.UnflattenFull`), which marks the
        parameters that received a gradient in the current backward. Without grad (``no_grad``,
        ``inference_mode``) detached views are made afresh for that call and never cached: a later call with
        grad in the same iteration must not see them.
        """
        self._check((ShardedState.UNSHARDED,), "expose full parameters")
        if torch.is_grad_enabled() if grad is None else grad:
            if self._views is None:
                self._views = self._grad_views()
            views = self._views
        else:
            views = extensions.module_views(self, flat.unsharded_views(self.flat_full.detach(), self.layout), False)
        for slot, view in zip(self.slots, views):
            slot.show_full(view)

    def _grad_views(self) -> list[torch.Tensor]:
        if not self.needs_grad:
            return extensions.module_views(self, flat.unsharded_views(self.flat_full.detach(), self.layout), False)
        with torch.enable_grad():  # also when called from a backward hook
            live = grads.UnflattenFull.apply(self.flat_full, weakref.ref(self), self.layout)
            if self.layout.all_trainable:
                return extensions.module_views(self, list(live), True)
            frozen = flat.unsharded_views(self.flat_full.detach(), self.layout)
            views = [v if p.requires_grad else fz for v, fz, p in zip(live, frozen, self.layout.params)]
            return extensions.module_views(self, views, True)

    def mark_used(self, index: int) -> None:
        """Layout parameter ``index``'s full view received a gradient in the
        current backward (called by ``grads.UnflattenFull``'s backward)."""
        self.slots[index].used = True

    def hide_full_params(self) -> None:
        """Make owning modules resolve attributes to the sharded parameters again."""
        for slot in self.slots:
            slot.hide_full()

    def install_params(self, values: list[Optional[torch.Tensor]]) -> None:
        """Register ``values[i]`` as parameter ``i`` on every owning module until :meth:`restore_params`
        (full parameters of ``summon_full_params``, state-dict values and load targets; None hides a
        parameter from ``nn.Module.state_dict``). Installs nest: each restore undoes the latest one."""
        self._installed.append([prev for slot, value in zip(self.slots, values) for prev in slot.install(value)])

    def restore_params(self) -> None:
        """Undo the latest :meth:`install_params` (no-op when none is active)."""
        if self._installed:
            for module, attr, value in reversed(self._installed.pop()):
                module._parameters[attr] = value

    def restore_all_params(self) -> None:
        """Undo every active install, so the sharded parameters are registered again (what a state-dict call
        that raised left behind). A no-op inside ``summon_full_params``, which owns its install and undoes it."""
        while self._installed and not self.summoned:
            self.restore_params()

    def reset_views(self) -> None:
        self._views = None

    def keep_unsharded(self) -> None:
        """Leave the unit gathered past the end of this iteration; the next iteration reuses the full parameters
        only if no shard changed since. A record made earlier since the gather stays: a shard stepped in the meantime
        (an optimizer stepped from a post-accumulate-grad hook before the end of backward keeps the unit again) made
        the full parameters stale."""
        if self._kept_version is None:
            self._kept_version = self.shard_versions()

    def kept_fresh(self) -> bool:
        """Whether the unit was kept gathered and its shards are unchanged since (an optimizer step, ``copy_``
        or any other in-place write bumps one of the version counters of :meth:`shard_versions`)."""
        return self._kept_version is not None and self._kept_version == self.shard_versions()

    def kept_stale(self) -> bool:
        """Whether the unit holds full parameters gathered before a shard changed: they must not be reused."""
        return self.state is not ShardedState.SHARDED and self._gather_version not in (None, self.shard_versions())

    def shard_versions(self) -> tuple[int, ...]:
        """Version counters of the flat shard, each registered parameter and its local tensor. All are needed:
        an in-place op on a DTensor parameter (every optimizer step under ``fully_shard``) bumps only the DTensor's
        own counter, one on its local tensor only the local's. Foreach ops on DTensors (a ``foreach`` optimizer,
        the default on GPUs) bump none, so every optimizer step counts too. Writes through ``p.data`` or other
        foreach ops go unseen (autograd misses them too)."""
        optim_hooks.add_step_hooks("step count", _count_step)
        versions = [_STEPS["count"], torch_private.version_counter(self.flat_shard)]
        for slot in self.slots:
            versions.extend(slot.versions())
        return tuple(versions)

    def reshard_partial(self) -> None:
        """Reshard after forward to the post-forward group: keep the rows of the all-gather output that this
        rank's place in the group stands for (``N/k`` flat shards, compute dtype), so the backward's all-gather runs
        within the group. UNSHARDED → SHARDED."""
        group = self.cfg.post_forward_group
        if group is None or self.aliased or not self.slots or self.state is not ShardedState.UNSHARDED:
            return self.reshard()
        k = collectives.group_size(group)
        count = self.world // k
        part = POOL.take(count * self.layout.shard_numel, self.compute_dtype, self.cfg.compute_device)
        flat.copy_rank_rows(part, self.flat_full.detach(), self.layout, collectives.group_rank(group) * count, count)
        self.reshard()
        self._partial = part

    def drop_partial(self) -> None:
        """Forget what :meth:`reshard_partial` kept (used, or stale: a new iteration)."""
        if self._partial is not None:
            POOL.give(self._partial)
            self._partial = None

    def reshard(self) -> None:
        """Free full parameters. UNSHARDED/UNSHARDING → SHARDED."""
        self._check((ShardedState.UNSHARDED, ShardedState.UNSHARDING), "reshard")
        self._kept_version = None
        if self.state is ShardedState.UNSHARDING:  # prefetched but never used
            self.wait_unshard()
        written = full_written(self)
        self.hide_full_params()
        extensions.free(self)
        if not self.aliased:
            self._free_full()
        self.state = ShardedState.SHARDED
        check_full_writes(self, written)

    # -------------------------------------------------------------- gradients
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
        if self.stash.active:
            raise RuntimeError(
                f"[rank {collectives.rank()}] unit '{self.name}': requires_grad changed inside a no_sync() "
                "accumulation window; change it before the window or after the synchronizing backward")
        self._set_layout(flat.make_layout([(p.fqn, p.shape, rg) for p, rg in zip(self.layout.params, flags)],
                                          self.world, [p.placement for p in self.layout.params]))
        self.needs_grad = any(flags)
        self.pooled_grad.release(self.take_full_grad()[0])
        self.flat_full.requires_grad_(self.needs_grad)
        self._views = None
        return True

    def take_full_grad(self) -> tuple[Optional[torch.Tensor], list[bool]]:
        """Detach and return the accumulated unsharded gradient (or None) and which parameters received a gradient
        since the last call. The caller passes the gradient to ``pooled_grad.release`` when done with it."""
        g = self.flat_full.grad
        self.flat_full.grad = None
        used = [s.used for s in self.slots]
        for s in self.slots:
            s.used = False
        return g, used

    def reduce_grads(self, full_grad: Optional[torch.Tensor], used: list[bool]) -> PendingReduce:
        """Reduce-scatter ``full_grad`` (param-major, ``N·S`` elements; None = zeros) into a gradient shard, averaged
        over the data-parallel world. Asynchronous: the gradient reaches ``.grad`` when the returned
        :class:`~fullshard.core.reduce.PendingReduce` is finished.

        ``used[i]``: whether this rank's backward gave layout parameter i a gradient; a parameter no rank used
        keeps ``grad None`` (see core/reduce.py).
        """
        if self.cfg.invariant_layout is not None:
            return start_fold(self, full_grad, used)
        return start_reduce(self, full_grad, used)
