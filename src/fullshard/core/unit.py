"""One FSDP unit: its shards, its unsharded flat parameter, and the three
operations the schedule calls: unshard, reshard and reduce_grads.

See ``core/flat.py`` [Note: flat layouts] for how elements are placed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..api import ShardedState
from . import collectives as C
from . import flat as F


@dataclasses.dataclass
class ParamSlot:
    """One original parameter and every ``(module, attribute)`` that holds it
    (more than one when weights are tied). ``param`` is dropped once the unit
    has taken its shard, so the full tensor can be freed."""

    fqn: str
    param: Optional[nn.Parameter]
    owners: list[tuple[nn.Module, str]]
    init_rows: Optional[Callable[[int, int], torch.Tensor]] = None
    """For a meta ``param``: ``fn(row_start, row_end)`` returning those rows
    initialized, so the unit materializes only this rank's chunk."""


@dataclasses.dataclass(frozen=True)
class UnitConfig:
    """Per-unit runtime settings.

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
        reshard_after_forward: free full parameters after forward (FULL_SHARD).
    """

    shard_group: object
    replicate_group: object
    dp_world_size: int
    compute_device: torch.device
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    offload_params: bool = False
    reshard_after_forward: bool = True


class UnitStateError(RuntimeError):
    """An illegal sharded-state transition of a unit."""


class Unit:
    """Shards of one unit's parameters and their unsharded counterpart.

    The sharded ``nn.Parameter`` objects (what the optimizer sees and
    ``named_parameters()`` returns) are views of ``flat_shard`` (fp32 master,
    1-D, ``layout.shard_numel`` elements). While unsharded, each owning module
    attribute resolves to a view of ``flat_full`` (param-major, ``N · S``
    elements, ``param_dtype``), which is an autograd leaf whose ``.grad``
    collects the unit's full gradient.
    """

    def __init__(self, name: str, slots: list[ParamSlot], cfg: UnitConfig):
        self.name = name
        self.cfg = cfg
        self.slots = slots
        self.world = C.group_size(cfg.shard_group)
        self.rank = C.group_rank(cfg.shard_group)
        self.layout = F.make_layout([(s.fqn, s.param.shape, s.param.requires_grad) for s in slots], self.world)
        self.state = ShardedState.SHARDED
        self.needs_grad = any(p.requires_grad for p in self.layout.params)
        self._views: Optional[list[torch.Tensor]] = None
        self._gather_buf: Optional[torch.Tensor] = None
        self._gather_work = None
        self._stashed_grad: Optional[torch.Tensor] = None
        self._shard()

    # ------------------------------------------------------------------ setup
    def _shard(self) -> None:
        """Keep only this rank's chunks; swap the modules' parameters for them."""
        cfg = self.cfg
        master_dtype = self.slots[0].param.dtype if self.slots else torch.float32
        shard_device = torch.device("cpu") if cfg.offload_params else cfg.compute_device
        # Pinned host memory makes the per-unit host<->device copies
        # asynchronous; only meaningful (and only allowed) with an accelerator.
        pin = cfg.offload_params and cfg.compute_device.type != "cpu"
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=master_dtype, device=shard_device,
                                      pin_memory=pin)
        F.shard_into(self.flat_shard, self.layout,
                     [s.init_rows if s.param.is_meta else s.param for s in self.slots], self.rank)
        self.sharded_params: list[nn.Parameter] = []
        for slot, view in zip(self.slots, F.shard_views(self.flat_shard, self.layout, self.rank)):
            sp = nn.Parameter(view, requires_grad=slot.param.requires_grad)
            self.sharded_params.append(sp)
            for module, attr in slot.owners:
                module._parameters[attr] = sp
            slot.param = None  # the full tensor is no longer ours to keep
        self.compute_dtype = cfg.param_dtype or master_dtype
        self.reduce_dtype = cfg.reduce_dtype or self.compute_dtype
        # With one rank per shard and nothing to cast or move, the unsharded
        # flat is the shard itself: no copy, never freed.
        self.aliased = (self.world == 1 and self.compute_dtype == master_dtype
                        and shard_device == cfg.compute_device)
        if self.aliased:
            self.flat_full = self.flat_shard.detach()
        else:
            self.flat_full = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype,
                                         device=cfg.compute_device)
            self._free_full()
        self.flat_full.requires_grad_(self.needs_grad)

    def _full_nbytes(self) -> int:
        return self.layout.unsharded_numel * self.flat_full.element_size()

    def _free_full(self) -> None:
        self.flat_full.untyped_storage().resize_(0)

    def full_storage_bytes(self) -> int:
        """Bytes currently allocated for full parameters (0 when resharded)."""
        return 0 if self.aliased else self.flat_full.untyped_storage().nbytes()

    def _check(self, allowed: tuple[ShardedState, ...], op: str) -> None:
        if self.state not in allowed:
            raise UnitStateError(
                f"[rank {C.rank()}] unit '{self.name}': cannot {op} in sharded state "
                f"{self.state.value}; expected one of {[s.value for s in allowed]}")

    # ---------------------------------------------------------------- unshard
    def unshard(self) -> None:
        """Issue the all-gather of this unit (asynchronous). SHARDED → UNSHARDING."""
        self._check((ShardedState.SHARDED,), "unshard")
        self.state = ShardedState.UNSHARDING
        if self.aliased or not self.slots:
            return
        send = self.flat_shard
        if send.dtype != self.compute_dtype or send.device != self.cfg.compute_device:
            send = send.to(self.cfg.compute_device, self.compute_dtype, non_blocking=True)
        self._gather_buf = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype,
                                       device=self.cfg.compute_device)
        self._gather_work = C.all_gather(self._gather_buf, send, self.cfg.shard_group, async_op=True)

    def wait_unshard(self) -> None:
        """Finish the all-gather and lay out full parameters. UNSHARDING → UNSHARDED."""
        self._check((ShardedState.UNSHARDING,), "wait for unshard")
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        if self._gather_buf is not None:
            self.flat_full.untyped_storage().resize_(self._full_nbytes())
            # .data: a write with its own version counter, so tensors autograd
            # saved in forward (views of this storage) stay valid for backward.
            F.copy_out(self.flat_full.data, self._gather_buf, self.layout)
            self._gather_buf = None
        self.state = ShardedState.UNSHARDED

    def ensure_unsharded(self) -> None:
        if self.state is ShardedState.SHARDED:
            self.unshard()
        if self.state is ShardedState.UNSHARDING:
            self.wait_unshard()

    def use_full_params(self) -> None:
        """Point every owning module attribute at its full-parameter view.

        Views are made once per iteration (see ``reset_views``) and reused when
        the unit runs again, so all uses feed one autograd node.
        """
        self._check((ShardedState.UNSHARDED,), "expose full parameters")
        if self._views is None:
            src = self.flat_full if torch.is_grad_enabled() else self.flat_full.detach()
            full = F.unsharded_views(src, self.layout)
            if self.needs_grad:
                frozen = F.unsharded_views(self.flat_full.detach(), self.layout)
                full = [v if p.requires_grad else fz for v, fz, p in zip(full, frozen, self.layout.params)]
            self._views = full
        for slot, view in zip(self.slots, self._views):
            for module, attr in slot.owners:
                module.__dict__[attr] = view

    def hide_full_params(self) -> None:
        """Make owning modules resolve attributes to the sharded parameters again."""
        for slot in self.slots:
            for module, attr in slot.owners:
                module.__dict__.pop(attr, None)

    def reset_views(self) -> None:
        self._views = None

    def reshard(self) -> None:
        """Free full parameters. UNSHARDED/UNSHARDING → SHARDED."""
        self._check((ShardedState.UNSHARDED, ShardedState.UNSHARDING), "reshard")
        if self.state is ShardedState.UNSHARDING:  # prefetched but never used
            self.wait_unshard()
        self.hide_full_params()
        if not self.aliased:
            self._free_full()
        self.state = ShardedState.SHARDED

    # ------------------------------------------------------------- gradients
    def take_full_grad(self) -> Optional[torch.Tensor]:
        """Detach and return the accumulated unsharded gradient (or None)."""
        g = self.flat_full.grad
        self.flat_full.grad = None
        return g

    def stash_grad(self, full_grad: torch.Tensor) -> None:
        """Keep a micro-batch's unsharded gradient for a later reduce
        (``no_sync``), summed in ``reduce_dtype`` so bf16/fp16 compute does
        not also mean bf16/fp16 accumulation."""
        if self._stashed_grad is None:
            self._stashed_grad = full_grad.to(self.reduce_dtype)  # taken from .grad: ours to keep
        else:
            self._stashed_grad.add_(full_grad)

    def pop_stashed(self, full_grad: torch.Tensor) -> torch.Tensor:
        """``full_grad`` plus whatever :meth:`stash_grad` collected."""
        if self._stashed_grad is None:
            return full_grad
        total, self._stashed_grad = self._stashed_grad, None
        return total.add_(full_grad.to(total.dtype))

    def stashed_grad_bytes(self) -> int:
        g = self._stashed_grad
        return 0 if g is None else g.numel() * g.element_size()

    def reduce_grads(self, full_grad: torch.Tensor) -> "PendingReduce":
        """Reduce-scatter ``full_grad`` (param-major, ``N·S`` elements) into a
        gradient shard, averaged over the data-parallel world. Asynchronous.
        """
        cfg = self.cfg
        n_grad = self.layout.grad_shard_numel
        reduce_in = torch.empty(self.world * n_grad, dtype=self.reduce_dtype, device=cfg.compute_device)
        F.copy_in(reduce_in, full_grad, self.layout)
        reduce_in.div_(cfg.dp_world_size)  # pre-divide, as DDP does
        out = torch.empty(n_grad, dtype=self.reduce_dtype, device=cfg.compute_device)
        work = C.reduce_scatter(out, reduce_in, cfg.shard_group, async_op=True)
        return PendingReduce(self, work, reduce_in, out)

    def accumulate_grad_shard(self, grad_shard: torch.Tensor) -> None:
        """Add a reduced 1-D gradient shard into the sharded parameters' ``.grad``."""
        master = self.flat_shard
        grad_shard = grad_shard.to(master.device, master.dtype)
        views = F.grad_shard_views(grad_shard, self.layout, self.rank)
        for sp, view in zip(self.sharded_params, views):
            if view is None:
                continue
            if sp.grad is None:
                sp.grad = view
            else:
                sp.grad.add_(view)


class PendingReduce:
    """An in-flight reduce-scatter (and, with replicas, its all-reduce)."""

    def __init__(self, unit: Unit, work, reduce_in: torch.Tensor, out: torch.Tensor):
        self.unit, self.work, self.reduce_in, self.out = unit, work, reduce_in, out

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.reduce_in = None
        rep = self.unit.cfg.replicate_group
        if rep is not None:
            C.all_reduce(self.out, rep, "sum")
        self.unit.accumulate_grad_shard(self.out)
