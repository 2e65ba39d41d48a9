"""``fully_shard``: torch FSDP2's API (``torch.distributed.fsdp.fully_shard``)
as a second front door over the same engine as ``FullyShardedDataParallel``.

Each call makes one unit of the module (or list of modules) it is given,
taking every parameter below it that no earlier call took; the module's
class becomes a subclass of :class:`FSDPModule` and keeps its name, so
parameter names do not change. Parameters become ``DTensor``s whose local
tensors are views of the unit's flat shard (see core/params.py [Note:
parameter records]); forward hooks run the same schedule (core/state.py) as
the wrapper's ``forward``. Where torch FSDP2 and DDP differ, DDP's result is
the one given (docs/migration.md lists the differences).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import construct, dtensor_specs, fsdp2_state, wrap
from .api import BackwardPrefetch, MixedPrecisionPolicy, OffloadPolicy
from .core import backward_guard, collectives, consistency, deferred_init, extensions, stale_graph, state, stored
from .core.convert import adopt
from .core.module import UnitModule, unit_modules
from .core.settings import UnitSettings
from .core.tree import map_tensors
from .core.unit import ShardedState, Unit
from .fsdp2_comm import CommMethods

_CLASSES: dict[type, type] = {}
_NO_MP, _NO_OFFLOAD = MixedPrecisionPolicy(), OffloadPolicy()  # frozen: safe to share as defaults


class FSDPModule(CommMethods, UnitModule):
    """Base added to the class of every module :func:`fully_shard` was
    applied to (``isinstance(model, FSDPModule)``), with torch FSDP2's
    methods (the communication ones in fsdp2_comm.py). ``type(model)``
    becomes ``FSDP<Original>``, a subclass of both.
    """

    dtensor_params = True
    __deepcopy__ = fsdp2_state.refuse_deepcopy

    def __new__(cls, *args, **kwargs):
        # Only a container's ``type(self)(...)`` (a slice) constructs this class.
        return fsdp2_state.new_original(cls, args, kwargs)

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except BaseException as e:
            if not isinstance(e, Exception):  # KeyboardInterrupt: torch runs always_call hooks for Exception only
                _post_forward(self, args, kwargs, None)
            raise

    # ------------------------------------------------------------ schedule
    def _lazy_init(self) -> None:
        rt = self._runtime
        if rt.root is None:
            runtimes = list({id(m._runtime): m._runtime for m in unit_modules(self)}.values())
            for other in runtimes:  # parameters replaced since fully_shard (torch: reset_sharded_param)
                if other.root is None:
                    fsdp2_state.adopt_replaced(other)
            fsdp2_state.name_units(self, runtimes)  # before any collective's tag names a unit
            state.lazy_init_root(rt, runtimes)

    def _run_as_forward(self, fn, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` between the unit's pre- and post-forward."""
        args, kwargs = _pre_forward(self, args, kwargs)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            _post_forward(self, args, kwargs, None)  # as the forward hook does (always_call; also KeyboardInterrupt)
            raise
        return _post_forward(self, args, kwargs, out)

    def _require_idle(self, what: str) -> None:
        self._lazy_init()
        state.require_idle(self._runtime.root, what)

    def _targets(self, recurse: bool) -> list["FSDPModule"]:
        return [m for m in unit_modules(self) if recurse or m is self]

    # ---------------------------------------------------- unshard / reshard
    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """All-gather this unit's full parameters now (ahead of its forward);
        they stay gathered until its forward/backward reshards them, or, if
        the shards change first (an optimizer step, an in-place write; not a
        write through ``p.data``), until the next forward.

        Returns:
            With ``async_op``, an :class:`UnshardHandle` whose ``wait()``
            finishes the all-gather; otherwise None (already finished).
        Raises:
            RuntimeError: during forward or backward.
        """
        self._require_idle("unshard()")
        unit = self._runtime.unit
        if unit.state is ShardedState.SHARDED:
            unit.unshard()
        unit.keep_unsharded()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's full parameters (no-op when sharded).

        Raises:
            RuntimeError: during forward or backward.
        """
        self._require_idle("reshard()")
        unit = self._runtime.unit
        if unit.state is not ShardedState.SHARDED:
            unit.reshard()

    # ------------------------------------------------------------ settings
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before an optimizer step
        (torch FSDP2 may then leave earlier backwards' reduce-scatters in
        flight). Recorded, with no effect on results or on when collectives
        finish: fullshard finishes every backward's reduce-scatters before
        ``backward()`` returns, so no gradient read afterwards (clipping,
        logging, an optimizer step) can be a partial sum. Call on the root.

        Raises:
            RuntimeError: not the root.
        """
        self._lazy_init()
        if not self._runtime.is_root:
            raise RuntimeError("set_is_last_backward() must be called on the root module (the outermost "
                               "fully_shard module, which runs forward first)")
        self._runtime.settings.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps each unit's unsharded gradient and sums
        it over micro-batches (``no_sync``); the first backward with True
        reduce-scatters the sum. Results equal one larger batch, as DDP's."""
        for m in self._targets(recurse):
            m._runtime.settings.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, reduce-scattered gradients are summed locally and
        the all-reduce over replicas waits for a backward with True, which
        all-reduces the sum (``.grad`` is written then). ``zero_grad()`` in
        between discards the sums, as DDP discards ``param.grad`` (until then a
        trainable parameter whose ``.grad`` was None holds a zero gradient:
        core/stash.py [Note: held sums and zero_grad])."""
        for m in self._targets(recurse):
            m._runtime.settings.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free full parameters after forward (True) or keep them for
        backward (False). The root always keeps them.

        Raises:
            ValueError: not a bool.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}")
        for m in self._targets(recurse):
            m._runtime.settings.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, full parameters stay gathered after backward, so the
        next micro-batch's forward needs no all-gather. They are reused only
        while the shards are unchanged: after an optimizer step (or an
        in-place write to a parameter) the next forward gathers again, of
        the root or of a unit called on its own. A write through ``p.data``
        or a ``torch._foreach_*`` call outside an optimizer step is not
        seen: reshard first (``reshard()``)."""
        for m in self._targets(recurse):
            m._runtime.settings.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules`` (fully_shard modules) right after this one's
        all-gather in forward, instead of at their own forward.

        Raises:
            ValueError: an entry is not a fully_shard module.
        """
        self._runtime.settings.forward_prefetch_units = _runtimes_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules`` right after this one's all-gather in
        backward, replacing the default (the previous unit in forward order).

        Raises:
            ValueError: an entry is not a fully_shard module.
        """
        self._runtime.settings.backward_prefetch_units = _runtimes_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's gradients by ``factor`` before summing them
        over ranks (default: the data-parallel world size, DDP's mean).

        Raises:
            ValueError: ``factor`` is not positive.
        """
        if not float(factor) > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}")
        self._runtime.settings.grad_divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, the unit is not gathered for its backward (for modules
        whose backward does not read their parameters, e.g. an embedding).

        Raises:
            RuntimeError: (in backward) the backward reads a full parameter
                that is not gathered (see core/backward_guard.py), never a
                wrong gradient or a crash.
        """
        self._runtime.settings.unshard_in_backward = bool(unshard_in_backward)

    # -------------------------------------------------- nn.Module overrides
    def _apply(self, fn, recurse: bool = True):
        """``to_empty(device=...)`` (deferred init), ``.to(dtype)`` and
        friends: after ``nn.Module._apply`` the unit takes the new values
        into its flat shard (``core.convert.adopt``); the parameter objects stay.

        Raises:
            RuntimeError: during forward or backward.
            ValueError: a unit's parameters end up with different dtypes, or
                on a device other than the mesh's.
        """
        rt = self._runtime
        if rt.root is not None:
            state.require_idle(rt.root, "module._apply()/.to()")
        if rt.unit.state is not ShardedState.SHARDED:
            rt.unit.reshard()
        out = super()._apply(fn, recurse)
        _adopt(rt)
        return out


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``."""

    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        """Finish the all-gather; the unit's modules then read full parameters."""
        unit, self._unit = self._unit, None
        if unit is not None and unit.state is ShardedState.UNSHARDING:
            unit.wait_unshard()
        if unit is not None and unit.state is ShardedState.UNSHARDED:
            unit.use_full_params(grad=False)


def fully_shard(module: Union[nn.Module, list[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Optional[Union[bool, int]] = None,
                mp_policy: MixedPrecisionPolicy = _NO_MP,
                offload_policy: OffloadPolicy = _NO_OFFLOAD,
                ignored_params: Optional[set[nn.Parameter]] = None, world_size_invariant: bool = False,
                shard_placement_fn: Optional[Callable] = None):
    """Shard ``module``'s parameters not taken by an earlier call over
    ``mesh`` as one unit (torch FSDP2's ``fully_shard``; apply it to each
    block, then to the root).

    Args:
        module: a module, or a list of modules that form one unit (tied
            weights across them; one all-gather for all).
        mesh: 1-D ``DeviceMesh`` to shard over (default: every rank, on the
            current accelerator or the CPU), or 2-D ``(replicate, shard)`` for
            HSDP. Parameters that are already DTensors (tensor parallelism:
            ``parallelize_module`` on a mesh sliced from the same root, e.g.
            ``mesh["tp"]`` with ``mesh=mesh["dp"]`` here) are sharded on dim 0
            of their TP-local part and become DTensors on the (dp, tp) mesh;
            modules read the TP DTensor (dtensor_specs.py [Note:
            tensor-parallel parameters]).
        reshard_after_forward: free full parameters after forward and gather
            again for backward (True, default for non-root units), keep them
            (False), or an int k dividing the shard size: keep 1/k of them and
            gather within k consecutive ranks in backward (intra-node, hpZ).
            The root keeps them either way.
        mp_policy: a :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`OffloadPolicy` (none) or
            :class:`CPUOffloadPolicy`.
        ignored_params: parameters left as they are (neither sharded nor
            reduced).
        world_size_invariant: (fullshard's) sum gradients over ranks in
            global micro-batch order, so training gives the same bits at
            every world size: rank r's j-th micro-batch of an update must be
            global micro-batch ``j·W + r``, and the loss is divided by the
            global count (gradients are summed, not averaged). Needs a mesh
            over the whole world (core/invariant.py, docs/invariance.md).
        shard_placement_fn: ``fn(param) -> None | Shard(d) | RowShard()``
            per original parameter (torch FSDP2's name): ``Shard(d)`` (any
            d, negative too) keeps ``torch.chunk(param, N, dim=d)[rank]``,
            contiguous, as ``DTensor(Shard(d))``; ``BlockShard``/``Owned``
            need :class:`~fullshard.FullyShardedDataParallel`.

    Returns:
        ``module`` (its class now a subclass of :class:`FSDPModule`), or the list.
    Raises:
        RuntimeError: no initialized process group.
        ValueError: a module already passed to ``fully_shard`` or wrapped by
            ``FullyShardedDataParallel``; an ``nn.ModuleList``/``ModuleDict`` (no forward); a mesh of more
            than 2 dimensions; a ``reshard_after_forward`` int that does not divide the shard group size;
            policies of the wrong type; a DTensor parameter placed other than ``Shard``/``Replicate`` or on a
            mesh that is not a disjoint slice of ``mesh``'s root.
            At the first forward (not here, so a full state dict loaded
            after ``fully_shard`` can fix them): parameters that differed
            across the ranks of the mesh and were not written since.
    """
    if not collectives.is_initialized():
        raise RuntimeError("fully_shard needs an initialized process group: launch with `torchrun "
                           "--nproc-per-node N script.py` and call torch.distributed.init_process_group() first")
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    name = "+".join(type(m).__name__ for m in modules)
    where = f"[rank {collectives.rank()}] fully_shard({name})"
    _check_args(modules, reshard_after_forward, mp_policy, offload_policy, where)
    mesh = mesh if mesh is not None else dtensor_specs.default_mesh()
    shard_group, replicate_group, placements = dtensor_specs.groups_of(mesh, where)
    reshard_after_forward, post_forward_group = dtensor_specs.post_forward_group(
        reshard_after_forward, shard_group, where)
    device = dtensor_specs.mesh_device(mesh)
    ignored = {id(p) for p in ignored_params or ()}
    is_unit = lambda m: isinstance(m, UnitModule)  # noqa: E731
    slots = _collect(modules, ignored, name, is_unit)
    for s in slots:
        if s.param.ndim == 0:  # Shard(0) cannot express it; DDP would replicate it
            raise ValueError(f"{where}: parameter '{s.fqn}' is 0-dimensional, which a Shard(0) DTensor cannot "
                             "hold; make it a 1-element 1-D tensor, pass it in ignored_params, or use "
                             "FullyShardedDataParallel")
        extensions.check_new(s.fqn, s.param, where)
    construct.apply_placements(slots, shard_placement_fn, where, ragged_ok=False)
    originals = [s.param for s in slots]
    dtensor_specs.assign_specs(slots, mesh, placements, where)  # DTensor (TP) slots now hold their local part
    tp = next((s.fqn for s in slots if s.spec is not None and s.spec.full_mesh is not None), None)
    if world_size_invariant and tp is not None:
        raise ValueError(f"{where}: world_size_invariant=True with tensor-parallel parameters ('{tp}'): the "
                         "invariant fold and its exact norm run over the data-parallel ranks only; drop one of them")
    own = [o for m in modules for o in wrap._unwrapped_modules(m, is_unit, set())]
    if not any(b.is_meta for o in own for b in o.buffers(recurse=False)):  # meta: to_empty moves them
        deferred_init.move_buffers(own, device, None)
    real = [s for s in slots if not s.param.is_meta]
    # Values that differ across ranks are refused at the first forward unless a load writes them first
    # (core/consistency.py): fully_shard has no sync_module_states; torch's remedy loads after it.
    differ = construct.prepare_values(real, own, None, device, False, name, (shard_group, replicate_group), True)
    # Backward prefetches the previous unit in forward order, as torch FSDP2 does by default.
    settings = UnitSettings(reshard_after_forward=reshard_after_forward is not False,
                            backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False)
    runtime = construct.build_unit(name, slots, originals, (shard_group, replicate_group), device, mp=mp_policy,
                                   offload=offload_policy, settings=settings, post_forward_group=post_forward_group,
                                   invariant_where=where if world_size_invariant else None, modules=own)
    consistency.defer(runtime.unit, differ)
    shared = fsdp2_state.FSDPState(runtime, modules, own, mp_policy, mesh)
    for m in modules:
        construct.mark_wrapped(m, name)
        m.__class__ = _fsdp_class(type(m))
        m._runtime = runtime
        m._fsdp_state = shared
        m.register_forward_pre_hook(_pre_forward_hook, prepend=True, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, with_kwargs=True, always_call=True)
        m.register_load_state_dict_pre_hook(_before_load)
        m.register_load_state_dict_post_hook(_after_load)
    return module


# ------------------------------------------------------------------ hooks
@torch.compiler.disable
def _pre_forward_hook(module: FSDPModule, args: tuple, kwargs: dict):
    return _pre_forward(module, args, kwargs)


@torch.compiler.disable
def _post_forward_hook(module: FSDPModule, args: tuple, kwargs: dict, output: Any):
    return _post_forward(module, args, kwargs, output)


def _pre_forward(module: FSDPModule, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    shared = module._fsdp_state
    rt = shared.runtime
    settings = rt.settings
    if settings.forward_depth:  # a module of this unit called inside its forward
        settings.forward_depth += 1
        return args, kwargs
    module._lazy_init()
    if consistency.PENDING and rt.is_root:
        consistency.verify([r.unit for r in rt.root.runtimes])
    out = state.pre_forward(rt, args, kwargs)
    if rt.state is state.TrainingState.FORWARD:
        shared.before = stored.snapshot(shared.own) if torch.is_grad_enabled() else None
        if torch.is_grad_enabled() and not settings.unshard_in_backward:
            backward_guard.enter(rt.unit)
    settings.forward_depth = 1
    return out


def _post_forward(module: FSDPModule, args: tuple, kwargs: dict, output: Any) -> Any:
    # Also runs when the forward raised (always_call; output is None then):
    # the unit leaves FORWARD, so the next call is not taken for a nested one.
    shared = module._fsdp_state
    rt = shared.runtime
    settings = rt.settings
    if not settings.forward_depth:  # the pre-forward raised: nothing to finish
        return output
    settings.forward_depth -= 1
    if settings.forward_depth:
        return output
    kept = ()
    if rt.state is state.TrainingState.FORWARD and shared.before is not None:
        kept = stored.stored_since(shared.before)  # [Note: stored outputs]
    shared.before = None
    backward_guard.leave(rt.unit)
    output = state.post_forward(rt, output, kept)
    dtype = shared.output_dtype
    if dtype is not None:
        output = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
    return output


def _before_load(module: FSDPModule, *args) -> None:
    """Reshard first, as torch FSDP2 does: the load writes the shards, and
    full parameters kept gathered (``unshard()``, ``reshard_after_backward=
    False``, a forward without backward) are then stale; ``adopt`` needs
    the sharded state.

    Raises:
        RuntimeError: during forward or backward.
    """
    rt = module._runtime
    if rt.root is not None:
        state.require_idle(rt.root, "load_state_dict()")
    stale_graph.updated(rt.unit)  # a graph of an earlier forward must not backpropagate through the new values
    if rt.unit.state is not ShardedState.SHARDED:
        rt.unit.reshard()


def _after_load(module: FSDPModule, incompatible_keys) -> None:
    _adopt(module._runtime)


def _adopt(rt: state.UnitRuntime) -> None:
    with torch.no_grad():
        for part in rt.unit.side:  # a mixed unit's frozen dtype parts (core/mixed.py)
            adopt(part)
        if adopt(rt.unit):
            rt.rearm_grad_hook()


# ------------------------------------------------------------ construction
def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: the module's class with :class:`FSDPModule` first in its bases (cached)."""
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                             {"__module__": cls.__module__, "_fsdp_original": cls})
    return _CLASSES[cls]


def _check_args(modules: list[nn.Module], reshard_after_forward, mp_policy, offload_policy, where: str) -> None:
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(f"{where}: takes an nn.Module or a non-empty list of them")
    for m in modules:
        fsdp2_state.check_module(m, where)
        if isinstance(m, UnitModule):
            raise ValueError(f"{where}: {type(m).__name__} is already sharded (fully_shard or "
                             "FullyShardedDataParallel); apply fully_shard once per module")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"{where}: reshard_after_forward must be None, a bool or an int, got "
                         f"{reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"{where}: mp_policy must be a fullshard.MixedPrecisionPolicy, got "
                         f"{type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"{where}: offload_policy must be a fullshard.OffloadPolicy or CPUOffloadPolicy, got "
                         f"{type(offload_policy).__name__}")


def _collect(modules: list[nn.Module], ignored: set[int], name: str, is_unit) -> list:
    """This unit's parameter records: parameters below ``modules`` that no
    earlier ``fully_shard`` took, merged by identity (tied weights)."""
    by_id: dict[int, Any] = {}
    for m in modules:
        for slot in construct.collect_slots(m, set(), frozenset(ignored), name, is_unit):
            if id(slot.param) in by_id:
                by_id[id(slot.param)].owners.extend(o for o in slot.owners if o not in by_id[id(slot.param)].owners)
            else:
                by_id[id(slot.param)] = slot
    return list(by_id.values())


def _runtimes_of(modules: Iterable, what: str) -> list[state.UnitRuntime]:
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{what}: {type(m).__name__} is not a fully_shard module")
    return [m._runtime for m in modules]


fully_shard.state = fsdp2_state.state_of  # torch FSDP2's fully_shard.state(module)
