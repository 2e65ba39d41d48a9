"""``FullyShardedDataParallel``: validation, construction and the public methods.

The schedule lives in ``core/state.py``, the shards in ``core/unit.py``.
Algorithm: ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, §5) as organised by
PyTorch FSDP (Zhao et al., "PyTorch FSDP", VLDB 2023, §3).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from . import construct, wrap
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .checkpoint import module_hooks
from .checkpoint.fsdp1_methods import StateDictMethods
from .construct import _PREFIX
from .core import casting, collectives, convert, deferred_init, extensions, gather, norms, state, stored
from .core.module import UnitModule, unit_modules
from .core.settings import UnitSettings
from .forward_methods import _hook_direct_calls, register_fsdp_forward_method  # noqa: F401 (public here too)
from .fsdp_settings import FSDP1Attributes, check_prefetch

_REGISTRIES = ("_parameters", "_buffers", "_modules")


class FullyShardedDataParallel(FSDP1Attributes, StateDictMethods, UnitModule):
    """Shard a module's parameters, gradients and optimizer state over ranks.

    Args:
        module: the module to shard. Its parameters may live on ``meta`` when
            ``param_init_fn`` is given (deferred initialization).
        process_group: the group to shard over (default: the whole world), or
            for HYBRID_SHARD a ``(shard_group, replicate_group)`` pair (default:
            shard within each node of ``LOCAL_WORLD_SIZE`` ranks).
        sharding_strategy: a :class:`ShardingStrategy` (default FULL_SHARD).
        auto_wrap_policy: a policy from :mod:`fullshard.wrap` choosing nested units.
        backward_prefetch: :class:`BackwardPrefetch` or None.
        forward_prefetch: issue the next unit's all-gather (by the previous
            iteration's order) before running the current unit's forward.
        device_id: compute device (int = CUDA index, or a ``torch.device``);
            default: the module's device, or the current accelerator for meta.
        sync_module_states: broadcast the parameters and buffers of the
            unit's first rank (group rank 0 of its process group(s): global
            rank 0 for the world, rank 2 for a group of ranks {2, 3}) to the
            other ranks of its group(s) before sharding. When False, those
            ranks are checked to hold equal parameters. Only the unit's ranks
            take part, so units on disjoint groups (one model per group, a
            per-rank expert on a one-rank group) keep their own values.
        ignored_modules: modules whose parameters are neither sharded nor
            synchronised.
        param_init_fn: ``fn(module)`` that materializes and initializes the
            module's own (``recurse=False``) meta parameters and buffers; called
            once per such module, one unit at a time, so no rank ever holds more
            than one unit's full parameters. If it also has
            ``init_rows(param, row_start, row_end, device) -> Tensor`` (rows of a
            meta parameter, initialized; e.g. ``fullshard.models.make_param_init_fn``),
            each rank creates only its own rows of each parameter instead and
            never materializes a full one.
        mixed_precision: a :class:`MixedPrecision` policy (None = full precision).
        cpu_offload: a :class:`CPUOffload` policy (None = off).
        world_size_invariant: (fullshard's) sum gradients over ranks in global
            micro-batch order so training gives the same bits at every world
            size: rank r's j-th micro-batch of an update must be global
            micro-batch ``j·W + r``, the loss divided by the global count
            (gradients are summed, not averaged), and the groups must tile
            the world (core/invariant.py, docs/invariance.md).
        shard_placement_fn: ``fn(param) -> placement | None`` per original
            parameter (torch FSDP2's name): ``RowShard()`` (default; also
            None or ``Shard(0)``), ``BlockShard(rows)``, or ``Owned(rank=None)``
            (the whole parameter on one rank, for optimizers that need whole
            matrices; core/placement.py [Note: placements]); ``Shard(d)``,
            d != 0, is ``fully_shard``'s only. Applies to every unit this
            call creates.

    Each unit exposes the settings it runs with as torch FSDP1's do
    (``sharding_strategy``, ``mixed_precision``, ``cpu_offload``,
    ``backward_prefetch``, ``forward_prefetch``, ``process_group``, ``rank``,
    ``world_size``, ``compute_device``; see ``fsdp_settings.py``).

    Raises:
        RuntimeError: no initialized process group.
        TypeError: ``ignored_modules`` holds something that is not a module.
        ValueError: module wrapped twice; ``auto_wrap_policy`` on a model
            already holding units; a unit in ``ignored_modules``; a
            ``param_init_fn`` that is not callable; parameters differ across
            ranks; a process group that does not fit the sharding strategy; a
            tied parameter split between units by manual wrapping.
    """

    _enclosed = False  # set on the units an enclosing unit's construction wraps or adopts

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: Optional[ShardingStrategy] = None,
                 auto_wrap_policy: Optional[Callable | set | frozenset] = None,
                 backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch: bool = False, device_id=None,
                 sync_module_states: bool = False, ignored_modules=None,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None,
                 mixed_precision: Optional[MixedPrecision] = None,
                 cpu_offload: Optional[CPUOffload] = None,
                 use_orig_params: bool = False, ignored_states=None, device_mesh=None,
                 world_size_invariant: bool = False, shard_placement_fn: Optional[Callable] = None):
        super().__init__()
        self._build(module, None, frozenset(), False, process_group=process_group,
                    sharding_strategy=sharding_strategy, auto_wrap_policy=auto_wrap_policy,
                    backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                    device_id=device_id, sync_module_states=sync_module_states,
                    ignored_modules=ignored_modules, param_init_fn=param_init_fn,
                    mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                    use_orig_params=use_orig_params, ignored_states=ignored_states,
                    device_mesh=device_mesh, world_size_invariant=world_size_invariant,
                    shard_placement_fn=shard_placement_fn)

    @classmethod
    def _nested(cls, module: nn.Module, name: str, skip_param_ids: frozenset, full_precision: bool,
                **options: Any) -> "FullyShardedDataParallel":
        """A unit made while wrapping an enclosing one (auto-wrap, full-precision
        norm layers): the constructor's path, plus the unit's name (its path
        from the root), the ids of parameters it leaves to an enclosing unit
        (tied with modules outside it) and whether it runs in full precision.
        These are not constructor keywords: torch FSDP1's has only public ones."""
        self = cls.__new__(cls)
        super(FullyShardedDataParallel, self).__init__()
        self._build(module, name, frozenset(skip_param_ids), full_precision, **options)
        return self

    def _build(self, module: nn.Module, name: Optional[str], skip_param_ids: frozenset, full_precision: bool,
               *, process_group, sharding_strategy, auto_wrap_policy, backward_prefetch, forward_prefetch,
               device_id, sync_module_states, ignored_modules, param_init_fn, mixed_precision, cpu_offload,
               use_orig_params, ignored_states, device_mesh, world_size_invariant, shard_placement_fn) -> None:
        """Validate, wrap the nested units, then shard what is left: the one
        path of the root and of every nested unit."""
        _require_process_group()
        name = name or type(module).__name__
        where = f"[rank {collectives.rank()}] unit '{name}'"
        construct.check_not_wrapped(module, name, _is_unit)
        if auto_wrap_policy is not None:
            construct.check_no_units(module, where)
        construct.check_param_init_fn(param_init_fn, where)
        check_prefetch(backward_prefetch, forward_prefetch, where)
        strategy, mp, offload = construct.check_policies(name, sharding_strategy, mixed_precision, cpu_offload)
        process_group = construct.group_from_mesh(device_mesh, process_group, strategy, where)
        groups = construct.resolve_groups(strategy, process_group, where)
        device = construct.resolve_device(device_id, module)
        ignored_modules, ignored_params = construct.split_ignored(ignored_modules, ignored_states, where)
        ignored = construct.ignored_ids(module, ignored_modules, where)
        ignored_params += construct.nested_ignored_params(module)
        nested = dict(process_group=process_group, sharding_strategy=strategy, auto_wrap_policy=None,
                      backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                      device_id=device, sync_module_states=sync_module_states,
                      ignored_modules=ignored_modules, param_init_fn=param_init_fn,
                      mixed_precision=mixed_precision, cpu_offload=cpu_offload, use_orig_params=use_orig_params,
                      ignored_states=ignored_params or None, device_mesh=None,
                      world_size_invariant=world_size_invariant, shard_placement_fn=shard_placement_fn)
        _wrap_nested(module, auto_wrap_policy, mp, ignored, nested)
        own = list(wrap._unwrapped_modules(module, _is_unit, ignored))
        self._orig_buffer_dtypes = construct.materialize(own, param_init_fn, device, mp.buffer_dtype)
        slots = construct.collect_slots(module, ignored, skip_param_ids | {id(p) for p in ignored_params},
                                        name, _is_unit)
        extensions.refuse([(s.fqn, s.param) for s in slots], where)
        construct.apply_placements(slots, shard_placement_fn, where)
        construct.prepare_values(slots, own, param_init_fn, device, sync_module_states, name, groups)
        settings = UnitSettings(
            reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD),
            backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch)
        self._runtime = construct.build_unit(name, slots, [s.param for s in slots], groups, device, mp=mp,
                                             offload=offload, settings=settings,
                                             invariant_where=where if world_size_invariant else None, modules=own)
        self._adopt(module, name, strategy, mp, ignored, ignored_params, own)
        self.use_orig_params = use_orig_params  # informational: original parameters are always exposed
        self._full_precision = (casting.FullPrecisionRun(self._runtime.unit.flat_shard.dtype)
                                if full_precision else None)
        _hook_direct_calls(self, module)
        self._sd_installed = False  # a state-dict save pre-hook registered values (see module_hooks)
        module_hooks.register(self)
        for inner in self.units()[1:]:  # known before any lazy init: root-only methods refuse them at once
            inner._enclosed = True
        self._built = True  # from here on, attributes of the wrapped module's own are set there (_forwards)

    def _adopt(self, module: nn.Module, name: str, strategy: ShardingStrategy, mp: MixedPrecision,
               ignored: set[int], ignored_params: list, own: list[nn.Module]) -> None:
        """Take ``module`` in as the wrapped module and record what the unit was built with."""
        construct.mark_wrapped(module, name)
        self._fsdp_wrapped_module = module
        self._strategy = strategy
        self._mixed_precision = mp
        self._ignored_modules = tuple(m for m in module.modules() if id(m) in ignored)  # for enclosing units
        self._ignored_params = tuple(ignored_params)
        self._own_modules = own
        self._buffer_dtype = mp.buffer_dtype

    # ------------------------------------------------------------ structure
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules["_fsdp_wrapped_module"]
        try:
            return getattr(inner, name)
        except AttributeError as e:
            if e.obj is not inner or e.name != name:  # raised inside a property of the module: its own error
                raise
            raise AttributeError(f"'{type(self).__name__}' object (wrapping {type(inner).__name__}) has no "
                                 f"attribute '{name}'", name=name, obj=self) from None

    def _forwards(self, name: str) -> Optional[nn.Module]:
        """The wrapped module when ``name`` is its attribute and not the wrapper's: ``unit.weight = t`` (what
        ``torch.func.functional_call`` does through the original names) must land where the wrapped
        module's forward reads it and the engine checks it, not on the wrapper, where it was silently
        ignored (and left an attribute that broke the next ``functional_call``)."""
        inner = self.__dict__.get("_modules", {}).get("_fsdp_wrapped_module") if "_built" in self.__dict__ else None
        if inner is None or name in self.__dict__ or any(name in getattr(self, d) for d in _REGISTRIES):
            return None
        return inner if name in inner.__dict__ or any(name in getattr(inner, d) for d in _REGISTRIES) else None

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self._forwards(name)
        if inner is not None and name in inner._parameters and not isinstance(value, nn.Parameter):
            raise RuntimeError(f"[rank {collectives.rank()}] parameter '{name}' of a {type(inner).__name__} "
                               "inside a FullyShardedDataParallel unit cannot be replaced by a plain tensor (what "
                               "torch.func.functional_call does): the unit computes from its own shard and would "
                               "ignore it; call it on the model before wrapping")
        (inner.__setattr__ if inner is not None else super().__setattr__)(name, value)

    def __delattr__(self, name: str) -> None:
        inner = self._forwards(name)
        (inner.__delattr__ if inner is not None else super().__delattr__)(name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (an ``nn.Sequential`` or ``nn.ModuleList``
        unit, e.g. under ``always_wrap_policy``); also makes ``for x in unit``
        iterate it, as in torch FSDP1."""
        return self._fsdp_wrapped_module[key]

    def units(self) -> list["FullyShardedDataParallel"]:
        """This unit and every unit nested in it, in module order."""
        return unit_modules(self)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under their original names (wrapper prefixes removed).

        Outside :meth:`summon_full_params` each is this rank's dim-0 shard,
        shape ``(local_rows, *shape[1:])``.
        """
        for n, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield n.replace(_PREFIX, ""), p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for n, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield n.replace(_PREFIX, ""), b

    # -------------------------------------------------------------- forward
    def _lazy_init(self) -> None:
        rt = self._runtime
        if rt.root is None:
            state.lazy_init_root(rt, [u._runtime for u in self.units()])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_as_forward(self._call_wrapped, args, kwargs)

    def _call_wrapped(self, *args: Any, **kwargs: Any) -> Any:
        if self._full_precision is not None:
            return self._full_precision(self._fsdp_wrapped_module, args, kwargs)
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _run_as_forward(self, fn, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` between the unit's pre- and post-forward."""
        self._lazy_init()
        rt = self._runtime
        args, kwargs = state.pre_forward(rt, args, kwargs)
        # Without grad no backward follows: nothing stored needs a hook.
        before = stored.snapshot(self._own_modules) if torch.is_grad_enabled() else None
        settings = rt.settings
        settings.forward_depth += 1  # calls of the wrapped module inside are this forward's (forward_methods.py)
        try:
            out = fn(*args, **kwargs)
        except BaseException:  # KeyboardInterrupt too
            state.post_forward(rt, None)  # leave FORWARD: no_sync() and friends see an idle unit
            raise
        finally:
            settings.forward_depth = max(0, settings.forward_depth - 1)
        return state.post_forward(rt, out, () if before is None else stored.stored_since(before))

    def _require_root_idle(self, what: str, root_only: bool = True) -> state.RootRuntime:
        enclosed = root_only and self._enclosed  # known before the root's first forward (its lazy init) too
        if not enclosed:
            self._lazy_init()
        if root_only and (enclosed or not self._runtime.is_root):
            raise RuntimeError(f"{what} must be called on the root FullyShardedDataParallel instance")
        root = self._runtime.root
        state.require_idle(root, what)
        return root

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally, without communication.

        Backward passes inside the context keep each unit's full gradient
        (Ψ elements per rank, in the reduce dtype); the first backward after
        it reduce-scatters the sum. Results equal one larger batch. The
        alternative, less memory and more communication, is to run every
        micro-batch's backward outside ``no_sync``: each reduce-scatters and
        adds into the gradient shards.
        """
        root = self._require_root_idle("no_sync()")
        prev, root.no_sync = root.no_sync, True
        try:
            yield
        finally:
            root.no_sync = prev

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm over every shard on every rank.

        The norm is that of every gradient of the distributed model, each
        element counted once: shards summed over the root unit's groups,
        replicas (NO_SHARD, HYBRID_SHARD) counted once, parameters no unit
        manages (replicated) once. A nested unit on a smaller process group
        than the root's holds different values per group (a per-rank expert
        on a one-rank group): each instance's gradient counts once, as in
        ``torch.nn.utils.clip_grad_norm_`` over the union of all ranks'
        parameters and as torch FSDP1 computes it, so every rank of the root's
        groups gets the same norm and coefficient. Call it on the root; a root
        on a process group covers its ranks only (two models on disjoint
        groups clip independently).

        Returns:
            The total norm before clipping (0-dim tensor), identical on all
            ranks of the root unit's groups and equal to
            ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. It is
            computed in fp32 and returned, as by torch FSDP1, in the promoted
            dtype of this rank's gradients (bf16 gradients: a bf16 norm), or
            fp32 with a warning when this rank holds no gradient.
        Raises:
            RuntimeError: not the root, or called during forward or backward.
        """
        self._require_root_idle("clip_grad_norm_()")
        total = norms.clip_root_(self._runtime, list(self.parameters()), max_norm, float(norm_type), foreach=True)
        dtypes = [p.grad.dtype for p in self.parameters() if p.grad is not None]
        if not dtypes:
            warnings.warn(f"[rank {collectives.rank()}] FSDP.clip_grad_norm_() called on rank {collectives.rank()} "
                          "with no gradients -- returning the total norm in the default dtype torch.float32 "
                          "(run a backward first)", stacklevel=2)
            return total
        return total.to(functools.reduce(torch.promote_types, dtypes))

    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """Expose full parameters (full precision) through ``named_parameters()``
        and module attributes. Works as ``model.summon_full_params(...)`` and as
        torch's ``FSDP.summon_full_params(model, ...)``; ``model`` may also be a
        plain module holding units.

        Args:
            recurse: also every unit nested below (False: only the units
                that are not inside another unit of ``module``).
            writeback: copy this rank's chunk of any modification back into
                its shard on exit.
            rank0_only: only the first rank of each unit's groups (group
                rank 0; global rank 0 for the world) exposes full parameters;
                the others keep their shards (every rank still takes part in
                the all-gathers).
            offload_to_cpu: place the full parameters in host memory.
            with_grads: also expose full gradients as ``.grad`` (None where
                no rank holds one).
        Nested calls compose: a unit an enclosing call already summoned keeps
        the enclosing call's full parameters (and its writeback).

        Raises:
            ValueError: ``writeback`` with ``rank0_only``.
            TypeError: ``module`` holds ``fully_shard`` modules.
            RuntimeError: called during forward or backward; a forward run
                inside the context.
        """
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not recurse:
            units = [u for u in units if not any(u is not o and u in o.modules() for o in units)]
        other = next((u for u in units if not isinstance(u, FullyShardedDataParallel)), None)
        if other is not None:
            raise TypeError(f"[rank {collectives.rank()}] summon_full_params: {type(other).__name__} is a "
                            "fully_shard module, not a FullyShardedDataParallel wrapper; gather it with its "
                            "unshard() (reshard() after), or take a full state dict")
        for u in units:
            u._require_root_idle("summon_full_params()", root_only=False)
        with gather.full_params([u.unit for u in units], writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``nn.Module.apply`` with full parameters, as torch FSDP1's: ``fn``
        runs on every module with this unit's full parameters registered
        (nested units gather theirs as the recursion reaches them) and what it
        writes is copied back into the shards, so ``model.apply(init_weights)``
        initializes the whole model as on the unsharded one.

        Raises:
            ValueError: called inside ``summon_full_params`` of this unit.
            RuntimeError: called during forward or backward.
        """
        if self.unit.summoned:
            raise ValueError(f"[rank {collectives.rank()}] apply() inside summon_full_params() of unit "
                             f"'{self.unit.name}': apply gathers full parameters itself; call it outside the context")
        with FullyShardedDataParallel.summon_full_params(self, recurse=False):
            return super().apply(fn)

    # ------------------------------------------------- torch FSDP1 helpers
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every unit in ``module`` (itself included), in module order; with
        ``root_only`` only those not nested in another unit."""
        return unit_modules(module, root_only)

    def check_is_root(self) -> bool:
        """Whether this unit is the root (runs lazy initialization if needed)."""
        self._lazy_init()
        return self._runtime.is_root

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; also discards every ``no_sync`` stash at once."""
        super().zero_grad(set_to_none)
        for u in self.units():
            u.unit.stash.discard()

    def _apply(self, fn, recurse: bool = True):
        """``.double()`` / ``.half()`` / ``.bfloat16()`` / ``.float()`` /
        ``.to(dtype)`` after wrapping: converts every unit's master shard and
        so its sharded parameters (the same ``nn.Parameter`` objects: an
        optimizer made before keeps them), their gradients, and the compute
        and reduce dtypes that default to the master dtype; buffers and
        unmanaged parameters convert as in ``nn.Module``. ``MixedPrecision``
        dtypes set explicitly stay (``.half()`` on a bf16-compute unit makes
        an fp16 master, bf16 compute). A device move that changes nothing
        (``.to("cpu")`` on CPU) is a no-op. See core/convert.py
        [Note: conversion after wrapping].

        Raises:
            RuntimeError: a move to another device; called during forward or
                backward, between a forward and its backward, inside
                ``summon_full_params`` or with a ``no_sync`` stash not reduced.
        """
        convert.check_convertible([u._runtime for u in (self.units() if recurse else [self])], fn)
        if convert.convert(self._runtime, fn) and self._full_precision is not None:
            self._full_precision = casting.FullPrecisionRun(self.unit.flat_shard.dtype)
        with convert.sharded_params_hidden(self._runtime):
            super()._apply(fn, recurse)  # nested units convert themselves in this recursion
        if self._buffer_dtype is not None:  # the state-dict dtypes follow the conversion
            dev = self.unit.cfg.compute_device
            self._orig_buffer_dtypes = {k: fn(torch.empty(0, dtype=d, device=dev)).dtype
                                        for k, d in self._orig_buffer_dtypes.items()}
            deferred_init.move_buffers(self._own_modules, dev, self._buffer_dtype)
        return self

FSDP = FullyShardedDataParallel


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FullyShardedDataParallel)


def _require_process_group() -> None:
    if not collectives.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs an initialized process group: launch with "
            "`torchrun --nproc-per-node N script.py` and call "
            "torch.distributed.init_process_group() before wrapping")


def _wrap_nested(module: nn.Module, auto_wrap_policy, mp: MixedPrecision, ignored: set[int],
                 options: dict[str, Any]) -> None:
    """Make ``module``'s nested units, each with the constructor ``options``:
    under a low-precision ``mp``, its norm layers with running statistics
    first, as full-precision units; then the modules ``auto_wrap_policy`` picks."""

    def unit_fn(full_precision: bool = False, **over: Any) -> Callable[..., nn.Module]:
        return lambda child, name, skip_param_ids, **chosen: FullyShardedDataParallel._nested(
            child, name, skip_param_ids, full_precision, **{**options, **over, **chosen})

    if mp.param_dtype is not None and mp.full_precision_module_classes:
        full_mp = MixedPrecision(cast_forward_inputs=False, full_precision_module_classes=())
        wrap.recursive_wrap(module, wrap.ModuleWrapPolicy(mp.full_precision_module_classes),
                            unit_fn(True, mixed_precision=full_mp), ignored, _is_unit)
    if isinstance(auto_wrap_policy, (set, frozenset)):
        auto_wrap_policy = wrap.ModuleWrapPolicy(auto_wrap_policy)
    if auto_wrap_policy is not None:
        wrap.recursive_wrap(module, auto_wrap_policy, unit_fn(), ignored, _is_unit)
