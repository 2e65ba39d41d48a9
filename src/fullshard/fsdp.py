"""``FullyShardedDataParallel``: validation, construction and the public methods.

The schedule lives in ``core/state.py``, the shards in ``core/unit.py``.
Algorithm: ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, §5) as organised by
PyTorch FSDP (Zhao et al., "PyTorch FSDP", VLDB 2023, §3).
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, TrainingState
from .core import collectives as C
from .core import state as S
from .core.unit import ParamSlot, Unit, UnitConfig
from .core import param as FU
from . import wrap as W

_PREFIX = "_fsdp_wrapped_module."
# Original parameters already taken by a unit, and modules already wrapped:
# id -> (weakref, unit name). Kept here, never as attributes on foreign objects.
_TAKEN: dict[int, tuple[weakref.ref, str]] = {}
_WRAPPED: dict[int, tuple[weakref.ref, str]] = {}
_HYBRID_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}


def _registered(reg: dict, obj) -> Optional[str]:
    entry = reg.get(id(obj))
    if entry is not None and entry[0]() is obj:
        return entry[1]
    return None


def _register(reg: dict, obj, name: str) -> None:
    key = id(obj)

    def forget(ref, reg=reg, key=key):
        if reg.get(key, (None,))[0] is ref:
            del reg[key]

    reg[key] = (weakref.ref(obj, forget), name)


class FullyShardedDataParallel(nn.Module):
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
        sync_module_states: broadcast rank 0's parameters and buffers before
            sharding. When False, ranks are checked to hold equal parameters.
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

    Raises:
        RuntimeError: no initialized process group.
        ValueError: module wrapped twice; parameters differ across ranks;
            a process group that does not fit the sharding strategy; a tied
            parameter split between units by manual wrapping.
    """

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
                 _unit_name: Optional[str] = None, _skip_param_ids: frozenset = frozenset(),
                 _full_precision: bool = False):
        super().__init__()
        if not C.is_initialized():
            raise RuntimeError(
                "FullyShardedDataParallel needs an initialized process group: launch with "
                "`torchrun --nproc-per-node N script.py` and call "
                "torch.distributed.init_process_group() before wrapping")
        name = _unit_name or type(module).__name__
        where = f"[rank {C.rank()}] unit '{name}'"
        _check_not_wrapped(module, name)
        strategy, mp, offload = _check_policies(name, sharding_strategy, mixed_precision, cpu_offload)
        process_group = _group_from_mesh(device_mesh, process_group, strategy, where)
        shard_group, replicate_group = _resolve_groups(strategy, process_group, where)
        device = _resolve_device(device_id, module)
        ignored_modules, ignored_params = _split_ignored(ignored_modules, ignored_states, where)
        ignored = _ignored_ids(module, ignored_modules)
        kwargs = dict(process_group=process_group, sharding_strategy=strategy,
                      backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                      device_id=device, sync_module_states=sync_module_states,
                      ignored_modules=ignored_modules, param_init_fn=param_init_fn,
                      mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                      ignored_states=ignored_params or None)

        def unit_fn(**over):
            return lambda child, name, skip_param_ids: FullyShardedDataParallel(
                child, _unit_name=name, _skip_param_ids=frozenset(skip_param_ids), **{**kwargs, **over})

        is_unit = lambda m: isinstance(m, FullyShardedDataParallel)  # noqa: E731
        if mp.param_dtype is not None and mp.full_precision_module_classes:
            # Norm layers with running statistics first, as full-precision units.
            full_mp = MixedPrecision(cast_forward_inputs=False, full_precision_module_classes=())
            W.recursive_wrap(module, W.ModuleWrapPolicy(mp.full_precision_module_classes),
                             unit_fn(mixed_precision=full_mp, _full_precision=True), ignored, is_unit)
        if isinstance(auto_wrap_policy, (set, frozenset)):
            auto_wrap_policy = W.ModuleWrapPolicy(auto_wrap_policy)
        if auto_wrap_policy is not None:
            W.recursive_wrap(module, auto_wrap_policy, unit_fn(), ignored, is_unit)
        own = list(W._unwrapped_modules(module, is_unit, ignored))
        _materialize(own, param_init_fn, device, mp.buffer_dtype)
        slots = _collect_slots(module, ignored, _skip_param_ids | {id(p) for p in ignored_params}, name)
        _prepare_values(slots, own, param_init_fn, device, sync_module_states, name)
        cfg = UnitConfig(
            shard_group=shard_group, replicate_group=replicate_group,
            dp_world_size=C.group_size(shard_group) * (
                C.group_size(replicate_group) if replicate_group is not None else 1),
            compute_device=device, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
            offload_params=offload.offload_params,
            reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD))
        for s in slots:
            _register(_TAKEN, s.param, name)
        with torch.no_grad():
            unit = Unit(name, slots, cfg)
        _register(_WRAPPED, module, name)
        self._fsdp_wrapped_module = module
        self._strategy = strategy
        self.use_orig_params = use_orig_params  # informational: original parameters are always exposed
        self._own_modules = own
        self._in_forward = False
        self._full_precision = FU.FullPrecisionRun(unit.flat_shard.dtype) if _full_precision else None
        self._runtime = S.UnitRuntime(unit, reshard_after_forward=cfg.reshard_after_forward,
                                      backward_prefetch=backward_prefetch,
                                      forward_prefetch=forward_prefetch,
                                      forward_input_caster=FU.input_caster(mp))
        _hook_direct_calls(self, module)

    # ------------------------------------------------------------ structure
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def unit(self) -> Unit:
        return self._runtime.unit

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._strategy

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_fsdp_wrapped_module"], name)

    def units(self) -> list["FullyShardedDataParallel"]:
        """This unit and every unit nested in it, in module order."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

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
            S.lazy_init_root(rt, [u._runtime for u in self.units()])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        rt = self._runtime
        args, kwargs = S.pre_forward(rt, args, kwargs)
        before = self._stored_tensor_ids()
        self._in_forward = True
        try:
            if self._full_precision is not None:
                out = self._full_precision(self._fsdp_wrapped_module, args, kwargs)
            else:
                out = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._in_forward = False
        return S.post_forward(rt, out, self._stored_tensors(before))

    def _stored_tensor_ids(self) -> set[int]:
        return {id(v) for m in self._own_modules for v in m.__dict__.values() if torch.is_tensor(v)}

    def _stored_tensors(self, before: set[int]) -> tuple:
        """Tensors this unit's forward stored on its modules instead of
        returning them (a loss kept as ``self.loss``): they get the same
        pre-backward hook as outputs, so a backward from them is correct."""
        if not torch.is_grad_enabled():
            return ()
        return tuple(v for m in self._own_modules for v in m.__dict__.values()
                     if torch.is_tensor(v) and v.grad_fn is not None and id(v) not in before)

    def _run_as_forward(self, fn, args: tuple, kwargs: dict) -> Any:
        self._lazy_init()
        args, kwargs = S.pre_forward(self._runtime, args, kwargs)
        self._in_forward = True
        try:
            out = fn(*args, **kwargs)
        finally:
            self._in_forward = False
        return S.post_forward(self._runtime, out)

    def _require_root_idle(self, what: str, root_only: bool = True) -> S.RootRuntime:
        self._lazy_init()
        root = self._runtime.root
        if root_only and not self._runtime.is_root:
            raise RuntimeError(f"{what} must be called on the root FullyShardedDataParallel instance")
        if not S.in_backward_pass() and S.backward_broken(root):
            S.start_iteration(root)  # the last backward raised: start clean here too
        busy = [rt.unit.name for rt in root.units if rt.state is not TrainingState.IDLE]
        if busy:
            raise RuntimeError(f"{what} cannot run during forward or backward (units busy: {busy})")
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

        Returns:
            The total norm before clipping (0-dim fp32 tensor), identical on
            all ranks and equal to ``torch.nn.utils.clip_grad_norm_`` on the
            unsharded model.
        """
        root = self._require_root_idle("clip_grad_norm_()")
        norm_type = float(norm_type)
        sharded, local = FU.grads_by_kind(root.units, self.parameters())
        group = self._runtime.unit.cfg.shard_group
        total = FU.global_norm(sharded, local, group, norm_type)
        grads = sharded + local
        coef = torch.clamp(torch.as_tensor(max_norm, dtype=torch.float32) / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))
        return total

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
            rank0_only: only rank 0 exposes full parameters; the others keep
                their shards (every rank still takes part in the all-gathers).
            offload_to_cpu: place the full parameters in host memory.
            with_grads: also expose full gradients as ``.grad`` (None where
                no rank holds one).
        Nested calls compose: a unit an enclosing call already summoned keeps
        the enclosing call's full parameters (and its writeback).

        Raises:
            ValueError: ``writeback`` with ``rank0_only``.
            RuntimeError: called during forward or backward; a forward run
                inside the context.
        """
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not recurse:
            units = [u for u in units if not any(u is not o and u in o.modules() for o in units)]
        for u in units:
            u._require_root_idle("summon_full_params()", root_only=False)
        with FU.full_params([u.unit for u in units], writeback, rank0_only, offload_to_cpu, with_grads):
            yield

    # ------------------------------------------------- torch FSDP1 helpers
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """Every unit in ``module`` (itself included), in module order; with
        ``root_only`` only those not nested in another unit."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            nested = {id(n) for u in units for n in u.modules() if n is not u}
            units = [u for u in units if id(u) not in nested]
        return units

    def check_is_root(self) -> bool:
        """Whether this unit is the root (runs lazy initialization if needed)."""
        self._lazy_init()
        return self._runtime.is_root

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; also discards every ``no_sync`` stash at once."""
        super().zero_grad(set_to_none)
        for u in self.units():
            u.unit.drop_stash()

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` / ``.half()`` / ``.double()`` / ``.cuda()`` after wrapping:
        allowed only when they change no parameter (the flat shard the
        collectives use would silently stop matching the parameters).

        Raises:
            RuntimeError: naming the first parameter that would change.
        """
        for name, p in self.named_parameters():
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.dtype != p.dtype or probe.device != p.device:
                raise RuntimeError(
                    f"[rank {C.rank()}] unit '{self.unit.name}': converting parameter '{name}' from "
                    f"{p.dtype}/{p.device} to {probe.dtype}/{probe.device} after wrapping is not supported; "
                    "convert the model before FullyShardedDataParallel, pass device_id, or use "
                    "MixedPrecision(param_dtype=...) for low-precision compute")
        return super()._apply(fn, recurse)


    # ----------------------------------------------------------- state dicts
    # [fullshard.checkpoint] Everything below delegates to fullshard/checkpoint/.
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Full tensors under the original names (default), or DTensor shards
        under ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``.
        On a nested unit: that unit's subtree, under names relative to it.
        See ``fullshard/checkpoint/state_dict.py``."""
        from .checkpoint import state_dict as SD

        if args:  # nn.Module's deprecated positional (destination, prefix, keep_vars)
            destination = args[0]
            prefix = args[1] if len(args) > 1 else prefix
        return SD.state_dict(self, destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a plain model's (full) or a sharded state dict into this rank's
        shards. Raises RuntimeError naming missing/unexpected keys (strict)
        and any shape mismatch."""
        from .checkpoint import state_dict as SD

        if assign:
            raise ValueError("FullyShardedDataParallel.load_state_dict: assign=True is not supported "
                             "(values are copied into the shards)")
        return SD.load_state_dict(self, state_dict, strict)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Context: every unit in ``module`` uses ``state_dict_type`` (a
        :class:`StateDictType`) and the configs, then the previous setting."""
        from .checkpoint import state_dict as SD

        prev = SD.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            SD.restore(module, prev)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None):
        """Set the state-dict type of every unit in ``module``; returns the previous settings."""
        from .checkpoint import state_dict as SD

        return SD.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
        """Optimizer state by original parameter name, full or sharded per the state-dict type."""
        from .checkpoint import optim as O  # noqa: N812

        return O.optim_state_dict(model, optim)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
        """A by-name optimizer state dict (any world size) as ``optim.load_state_dict`` input."""
        from .checkpoint import optim as O  # noqa: N812

        return O.optim_state_dict_to_load(model, optim, optim_state_dict)

def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.method_name(...)`` run like ``forward``: the unit's full
    parameters are gathered for the call and freed after it.

    Methods that call the wrapped module (Hugging Face ``generate()`` calls
    ``self(...)``) need no registration: a call of the wrapped module that
    does not come through the unit's ``forward`` is handled like one. This is
    for methods that use the parameters without calling the module.

    Raises:
        ValueError: ``module`` is not a unit, or has no such method.
    """
    if not isinstance(module, FullyShardedDataParallel):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} is not a "
                         "FullyShardedDataParallel unit")
    inner = getattr(module.module, method_name, None)
    if not callable(inner):
        raise ValueError(f"register_fsdp_forward_method: the wrapped {type(module.module).__name__} has "
                         f"no method {method_name!r}")
    unit_ref = weakref.ref(module)

    @functools.wraps(inner)
    def run(*args, **kwargs):
        unit = unit_ref()
        return unit._run_as_forward(getattr(unit.module, method_name), args, kwargs)

    object.__setattr__(module, method_name, run)


def _hook_direct_calls(unit: FullyShardedDataParallel, module: nn.Module) -> None:
    """Treat a call of the wrapped module that bypasses the unit's forward
    (``generate()`` calling ``self(...)``) like a call of the unit."""
    ref = weakref.ref(unit)

    def pre(mod, args, kwargs):
        u = ref()
        if u is None or u._in_forward:
            return None
        u._lazy_init()
        if u._runtime.state is TrainingState.FORWARD:  # a nested call of the same module
            return None
        return S.pre_forward(u._runtime, args, kwargs)

    def post(mod, args, kwargs, output):
        u = ref()
        if u is None or u._in_forward or u._runtime.state is not TrainingState.FORWARD:
            return None
        return S.post_forward(u._runtime, output)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


def _check_policies(name: str, strategy, mp, offload):
    """Validate and default the policy arguments: (strategy, MixedPrecision, CPUOffload)."""
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if not isinstance(strategy, ShardingStrategy):
        raise ValueError(f"[rank {C.rank()}] unit '{name}': sharding_strategy must be a "
                         f"fullshard.ShardingStrategy, got {strategy!r}")
    mp = mp or MixedPrecision()
    offload = offload or CPUOffload()
    if not isinstance(mp, MixedPrecision) or not isinstance(offload, CPUOffload):
        raise ValueError(f"[rank {C.rank()}] unit '{name}': mixed_precision must be a fullshard.MixedPrecision "
                         f"and cpu_offload a fullshard.CPUOffload; got {type(mp).__name__}, "
                         f"{type(offload).__name__}")
    return strategy, mp, offload


def _materialize(own: list[nn.Module], param_init_fn, device: torch.device, buffer_dtype) -> None:
    """Materialize this unit's meta tensors and place its buffers.

    Row-wise init (see ``param.rowwise_init``) leaves meta parameters to the
    unit, which creates only this rank's rows; modules with meta buffers are
    then still materialized whole.
    """
    rowwise = FU.rowwise_init(param_init_fn)
    FU.materialize([m for m in own if FU.has_meta_buffers(m)] if rowwise else own, param_init_fn, device)
    FU.move_buffers(own, device, buffer_dtype)


def _prepare_values(slots: list[ParamSlot], own: list[nn.Module], param_init_fn, device: torch.device,
                    sync_module_states: bool, name: str) -> None:
    """Attach row initializers to meta slots; make the other values agree
    across ranks (broadcast from rank 0, or check and name the first that differs)."""
    for s in slots:
        if s.param.is_meta:  # only reachable with row-wise init
            s.init_rows = functools.partial(param_init_fn.init_rows, s.param, device=device)
    real = [s for s in slots if not s.param.is_meta]  # deferred rows are identical by construction
    world = C.world_group()
    if sync_module_states:
        FU.broadcast_from_rank0([s.param for s in real] + FU.buffers_of(own), world)
    else:
        FU.check_same_across_ranks([(s.fqn, s.param) for s in real], world, name)


def _check_not_wrapped(module: nn.Module, name: str) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError(f"[rank {C.rank()}] module '{name}' is already a FullyShardedDataParallel "
                         "unit; wrap each module once")
    prior = _registered(_WRAPPED, module)
    if prior is not None:
        raise ValueError(f"[rank {C.rank()}] module '{name}' was already wrapped as unit '{prior}'; "
                         "wrap each module once")


def _collect_slots(module: nn.Module, ignored: set[int], skip: frozenset, unit: str) -> list[ParamSlot]:
    """This unit's parameters: every not-yet-sharded parameter below ``module``
    (including tied ones that nested units left to it), with all their owners."""
    sharded = {id(p) for m in module.modules() if isinstance(m, FullyShardedDataParallel)
               for p in m.unit.sharded_params}
    by_id: dict[int, ParamSlot] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        if id(m) in ignored:
            continue
        for attr, p in m._parameters.items():
            if p is None or id(p) in sharded or id(p) in skip:
                continue
            fqn = f"{mname}.{attr}".replace(_PREFIX, "") if mname else attr
            prior = _registered(_TAKEN, p)
            if prior is not None:
                raise ValueError(
                    f"[rank {C.rank()}] parameter '{fqn}' of unit '{unit}' is already sharded by unit "
                    f"'{prior}' (a tied weight split between units); wrap so that every module "
                    "using it sits in one unit, or let auto_wrap_policy place it")
            slot = by_id.get(id(p))
            if slot is None:
                slot = by_id[id(p)] = ParamSlot(fqn, p, [])
            if (m, attr) not in [(o, a) for o, a in slot.owners]:
                slot.owners.append((m, attr))
    return list(by_id.values())


def _ignored_ids(module: nn.Module, ignored_modules) -> set[int]:
    out: set[int] = set()
    for m in ignored_modules or ():
        if not isinstance(m, nn.Module):
            raise ValueError(f"ignored_modules must hold nn.Module objects, got {type(m).__name__}")
        out.update(id(s) for s in m.modules())
    return out


def _split_ignored(ignored_modules, ignored_states, where: str) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """``ignored_states`` (torch FSDP1): modules or parameters, not both kinds."""
    modules = list(ignored_modules or ())
    states = list(ignored_states or ())
    if states and not (all(isinstance(s, nn.Parameter) for s in states)
                       or all(isinstance(s, nn.Module) for s in states)):
        raise ValueError(f"{where}: ignored_states must hold only nn.Parameter or only nn.Module objects")
    params = [s for s in states if isinstance(s, nn.Parameter)]
    modules += [s for s in states if isinstance(s, nn.Module)]
    return modules, params


def _group_from_mesh(device_mesh, process_group, strategy: ShardingStrategy, where: str):
    """The process group(s) a ``DeviceMesh`` stands for: a 1-D mesh is the
    shard group; a 2-D mesh (replicate, shard) gives HYBRID_SHARD's pair."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError(f"{where}: pass either process_group or device_mesh, not both")
    if device_mesh.ndim == 1 and strategy is not ShardingStrategy.HYBRID_SHARD:
        return device_mesh.get_group(0)
    if device_mesh.ndim == 2 and strategy is ShardingStrategy.HYBRID_SHARD:
        return device_mesh.get_group(1), device_mesh.get_group(0)
    raise ValueError(f"{where}: {strategy.value} takes a {'2' if strategy is ShardingStrategy.HYBRID_SHARD else '1'}-D "
                     f"device_mesh (HYBRID_SHARD: (replicate, shard)), got {device_mesh.ndim}-D")


def _resolve_device(device_id, module: nn.Module) -> torch.device:
    if device_id is not None:
        if isinstance(device_id, int):
            return torch.device("cuda", device_id)
        return torch.device(device_id)
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_groups(strategy: ShardingStrategy, process_group, where: str):
    """(shard_group, replicate_group) for the strategy; None means the world."""
    pair = isinstance(process_group, (tuple, list))
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if process_group is None:
            return _default_hybrid_groups(where)
        if not pair or len(process_group) != 2:
            raise ValueError(f"{where}: HYBRID_SHARD takes process_group as a (shard_group, replicate_group) "
                             f"pair, or None to group by LOCAL_WORLD_SIZE; got {type(process_group).__name__}")
        shard, rep = process_group
        if C.group_size(shard) * C.group_size(rep) != C.world_size():
            raise ValueError(
                f"{where}: HYBRID_SHARD shard group size {C.group_size(shard)} x replicate group size "
                f"{C.group_size(rep)} != world size {C.world_size()}; pass groups that tile the world")
        return shard, rep
    if pair:
        raise ValueError(f"{where}: {strategy.value} takes a single process group; a (shard, replicate) "
                         "pair is only for HYBRID_SHARD")
    group = process_group if process_group is not None else C.world_group()
    if strategy is ShardingStrategy.NO_SHARD:
        # Hybrid sharding with shards of one rank: gradients are all-reduced.
        return C.SELF_GROUP, group
    return group, None


def _default_hybrid_groups(where: str):
    world = C.world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"{where}: HYBRID_SHARD world size {world} is not a multiple of LOCAL_WORLD_SIZE "
                         f"{local}; pass process_group=(shard_group, replicate_group)")
    key = (local, world)
    if key not in _HYBRID_GROUPS:
        me = C.rank()
        shard = rep = None
        for start in range(0, world, local):
            g = C.new_group(list(range(start, start + local)))
            if start <= me < start + local:
                shard = g
        for i in range(local):
            g = C.new_group(list(range(i, world, local)))
            if me % local == i:
                rep = g
        _HYBRID_GROUPS[key] = (shard, rep)
    return _HYBRID_GROUPS[key]


FSDP = FullyShardedDataParallel
