"""Building units, for both front doors: policy and group resolution,
which parameters a unit takes, their values across ranks, :func:`build_unit`
(the one place a unit's config, settings, shards and schedule are made), and
the registries that keep a module or parameter from being wrapped twice
(held by id with weak references, never as attributes on foreign objects;
the sharded parameters live units registered are in ``core/registry.py``).
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Optional

import torch
import torch.nn as nn

from .api import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from .core import (
    added_params,
    casting,
    collectives,
    consistency,
    deferred_init,
    invariant,
    mixed,
    placement,
    registry,
    state,
)
from .core.module import UnitModule
from .core.names import WRAPPER_SEGMENTS, clean_name  # noqa: F401 (re-exported: the names' old home)
from .core.params import ParamSlot
from .core.settings import UnitSettings
from .core.unit import UnitConfig

_PREFIX = "_fsdp_wrapped_module."
# Modules already wrapped: id -> (weakref, unit name). Kept here, never as attributes on foreign objects
# (original parameters a unit took: core/registry.py).
WRAPPED: dict[int, tuple[weakref.ref, str]] = {}
# The default HYBRID_SHARD groups, per world group (held weakly: a world made
# again after destroy_process_group gets new groups) and (local, world) size.
HYBRID_GROUPS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], tuple[Any, Any]]]" = weakref.WeakKeyDictionary()
HYBRID_CHECKED: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id shard, id replicate) -> the groups


def check_policies(name: str, strategy, mp, offload):
    """Validate and default the policy arguments: (strategy, MixedPrecision, CPUOffload)."""
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if not isinstance(strategy, ShardingStrategy):
        raise ValueError(f"[rank {collectives.rank()}] unit '{name}': sharding_strategy must be a "
                         f"fullshard.ShardingStrategy, got {strategy!r}")
    mp = mp or MixedPrecision()
    offload = offload or CPUOffload()
    if not isinstance(mp, MixedPrecision) or not isinstance(offload, CPUOffload):
        raise ValueError(f"[rank {collectives.rank()}] unit '{name}': mixed_precision must be a "
                         "fullshard.MixedPrecision "
                         f"and cpu_offload a fullshard.CPUOffload; got {type(mp).__name__}, "
                         f"{type(offload).__name__}")
    return strategy, mp, offload


def check_param_init_fn(param_init_fn, where: str) -> None:
    """Raises ValueError: ``param_init_fn`` given but not callable."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"{where}: expected param_init_fn to be callable, fn(module) materializing the module's "
                         f"meta tensors, but got {type(param_init_fn).__name__} {param_init_fn!r}")


def materialize(own: list[nn.Module], param_init_fn, device: torch.device,
                buffer_dtype) -> dict[tuple[int, str], torch.dtype]:
    """Materialize this unit's meta tensors and place its buffers.

    Row-wise init (see ``deferred_init.rowwise_init``) leaves meta parameters to the
    unit, which creates only this rank's rows; modules with meta buffers are
    then still materialized whole.

    Returns:
        The buffers' dtypes before the cast to ``buffer_dtype``, by
        ``(id(module), name)`` (see :func:`place_buffers`).
    """
    rowwise = deferred_init.rowwise_init(param_init_fn)
    deferred_init.materialize([m for m in own if deferred_init.has_meta_buffers(m)] if rowwise else own,
                              param_init_fn, device)
    return place_buffers(own, device, buffer_dtype)


def place_buffers(own: list[nn.Module], device: torch.device, buffer_dtype) -> dict[tuple[int, str], torch.dtype]:
    """Move ``own``'s buffers to ``device`` and cast floating ones to
    ``buffer_dtype``; returns their dtypes before the cast by ``(id(module),
    name)``: full and sharded state dicts hold buffers in these dtypes, as
    torch FSDP1's do (empty without ``buffer_dtype``: state dicts then hold
    the buffers themselves)."""
    dtypes = {} if buffer_dtype is None else {
        (id(m), name): b.dtype for m in own for name, b in m._buffers.items() if b is not None}
    deferred_init.move_buffers(own, device, buffer_dtype)
    return dtypes


def build_unit(name: str, slots: list[ParamSlot], taken: list[nn.Parameter], groups: tuple,
               device: torch.device, *, mp, offload, settings: UnitSettings, post_forward_group=None,
               invariant_where: Optional[str] = None, modules: tuple = ()) -> state.UnitRuntime:
    """Make one unit from what a front door resolved: its immutable
    :class:`UnitConfig`, its shards (:class:`Unit`, which takes ``settings``,
    the knobs the door may change later) and its schedule
    (:class:`state.UnitRuntime`). ``taken`` (the original parameters) are
    registered as taken before sharding replaces them.

    Args:
        groups: (shard_group, replicate_group or None).
        mp: the door's mixed-precision policy (``MixedPrecision`` or
            ``MixedPrecisionPolicy``).
        offload: the door's offload policy (``CPUOffload``, or
            ``OffloadPolicy`` / ``CPUOffloadPolicy``).
        post_forward_group: ``reshard_after_forward=k``'s group, or None.
        invariant_where: ``world_size_invariant=True`` (gradients folded in a
            fixed order, core/invariant.py): the door's name of the unit
            for errors; None: reduce-scattered and averaged.
        modules: the modules the unit owns (not inside a nested unit), watched for parameters added later
            (core/added_params.py).
    Parameters of several dtypes make a :class:`~fullshard.core.mixed.MixedUnit`
    (core/mixed.py [Note: units that mix dtypes]).

    Raises:
        ValueError: ``world_size_invariant`` with groups that do not tile
            the world; parameters partly on the meta device; trainable
            parameters of different dtypes.
    """
    mixed.check_dtypes(name, slots)
    shard_group, replicate_group = groups
    rep_size = collectives.group_size(replicate_group) if replicate_group is not None else 1
    offload_params = offload.offload_params if isinstance(offload, CPUOffload) else \
        isinstance(offload, CPUOffloadPolicy)
    cfg = UnitConfig(
        shard_group=shard_group, replicate_group=replicate_group,
        dp_world_size=collectives.group_size(shard_group) * rep_size,
        compute_device=device, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
        offload_params=offload_params, pin_memory=offload_params and getattr(offload, "pin_memory", True),
        keep_low_precision_grads=getattr(mp, "keep_low_precision_grads", False),
        post_forward_group=post_forward_group,
        invariant_layout=None if invariant_where is None else
        invariant.check_layout(shard_group, replicate_group, invariant_where),
        mp_policy=mp if isinstance(mp, MixedPrecisionPolicy) else None)
    for slot, p in zip(slots, taken):
        registry.mark_taken(p, name, slot.fqn)
    with torch.no_grad():
        unit = mixed.make_unit(name, slots, cfg, settings)
    added_params.record(unit, modules)
    return state.UnitRuntime(unit, forward_input_caster=casting.input_caster(mp),
                             root_input_caster=casting.input_caster(mp, root=True))


def prepare_values(slots: list[ParamSlot], own: list[nn.Module], param_init_fn, device: torch.device,
                   sync_module_states: bool, name: str, groups: tuple, defer: bool = False) -> list[str]:
    """Attach row initializers to meta slots; make the other values agree
    across the ranks of the unit's ``groups`` = (shard_group, replicate_group):
    broadcast the unit's first rank's parameters and buffers, or check the
    parameters and name the first that differs. Ranks outside the groups
    take no part (see ``consistency.broadcast_from_first``).

    Returns:
        With ``defer`` (fully_shard), the names of the parameters that
        differ, for ``consistency.defer``; otherwise they raise here."""
    for s in slots:
        if s.param.is_meta:  # only reachable with row-wise init
            s.init_rows = deferred_init.rows_fn(param_init_fn, s.param, device)
    real = [s for s in slots if not s.param.is_meta]  # deferred rows are identical by construction
    if sync_module_states:
        consistency.broadcast_from_first([s.param for s in real] + deferred_init.buffers_of(own), *groups)
        return []
    return consistency.check_same_across_ranks([(s.fqn, s.param) for s in real], *groups, name, defer=defer)


def mark_wrapped(module: nn.Module, name: str) -> None:
    """Record that unit ``name`` wraps ``module`` (see :func:`check_not_wrapped`)."""
    registry.remember(WRAPPED, module, name)


def check_not_wrapped(module: nn.Module, name: str, is_unit) -> None:
    if is_unit(module):
        raise ValueError(f"[rank {collectives.rank()}] module '{name}' is already a FullyShardedDataParallel "
                         "unit; wrap each module once")
    prior = registry.recall(WRAPPED, module)
    if prior is not None:
        raise ValueError(f"[rank {collectives.rank()}] module '{name}' was already wrapped as unit '{prior}'; "
                         "wrap each module once")


def collect_slots(module: nn.Module, ignored: set[int], skip: frozenset, unit: str,
                  is_unit) -> list[ParamSlot]:
    """This unit's parameters: every not-yet-sharded parameter below ``module``
    (including tied ones that nested units left to it), with all their owners."""
    sharded = {id(s.sharded) for m in module.modules() if is_unit(m)
               for s in mixed.all_slots(m.unit)}
    by_id: dict[int, ParamSlot] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        if id(m) in ignored:
            continue
        for attr, p in m._parameters.items():
            if p is None or id(p) in sharded or id(p) in skip:
                continue
            fqn = f"{mname}.{attr}".replace(_PREFIX, "") if mname else attr
            sparse = getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            if sparse and p.requires_grad:
                raise ValueError(f"[rank {collectives.rank()}] parameter '{fqn}' of unit '{unit}': "
                                 f"{type(m).__name__}(sparse=True) makes sparse gradients, which a unit cannot "
                                 "reduce-scatter; use sparse=False (the same gradient, stored dense)")
            holder = registry.holder(p)  # a sharded parameter of a live unit
            if holder is not None:
                raise ValueError(
                    f"[rank {collectives.rank()}] parameter '{fqn}' of unit '{unit}' is already a sharded parameter "
                    f"of unit '{holder}', which holds this module (fully_shard applied to a parent before its "
                    "children, or to a module inside a FullyShardedDataParallel wrapper); shard the inner modules "
                    "first, then the module that holds them")
            prior = (registry.taken(p) or (None,))[0]
            if prior is not None:
                raise ValueError(
                    f"[rank {collectives.rank()}] parameter '{fqn}' of unit '{unit}' is already sharded by unit "
                    f"'{prior}' (a tied weight split between units); wrap so that every module "
                    "using it sits in one unit, or let auto_wrap_policy place it")
            slot = by_id.get(id(p))
            if slot is None:
                slot = by_id[id(p)] = ParamSlot(fqn, p, [])
            if (m, attr) not in [(o, a) for o, a in slot.owners]:
                slot.owners.append((m, attr))
    return list(by_id.values())


def ignored_ids(module: nn.Module, ignored_modules, where: str) -> set[int]:
    """Ids of the ignored modules and their descendants, with those the units
    already inside ``module`` ignore (as in torch FSDP1, so an enclosing unit
    does not take what a nested one left alone).

    Raises:
        TypeError: an entry is not an ``nn.Module``.
        ValueError: an entry is a unit (ignore the module it wraps instead).
    """
    out: set[int] = set()
    for m in ignored_modules or ():
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where}: ignored_modules must hold nn.Module objects, got {type(m).__name__}")
        if isinstance(m, UnitModule):
            raise ValueError(f"{where}: ignored_modules holds unit '{m.unit.name}' (a FullyShardedDataParallel "
                             "or fully_shard module); pass modules that are not wrapped")
        out.update(id(s) for s in m.modules())
    for u in module.modules():
        if isinstance(u, UnitModule):
            out.update(id(m) for m in getattr(u, "_ignored_modules", ()))
    return out


def nested_ignored_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the units already inside ``module`` ignore (``ignored_states``)."""
    return [p for u in module.modules() if isinstance(u, UnitModule) for p in getattr(u, "_ignored_params", ())]


def check_no_units(module: nn.Module, where: str) -> None:
    """``auto_wrap_policy`` on a model that already holds units (torch FSDP1
    refuses it too: the policy would nest new units around or beside them
    without knowing them).

    Raises:
        ValueError: naming the first unit found.
    """
    for path, m in module.named_modules():
        if isinstance(m, UnitModule):
            raise ValueError(f"{where}: auto_wrap_policy needs a model without units, but '{clean_name(path)}' is "
                             "already a FullyShardedDataParallel/fully_shard unit; either wrap the plain model with "
                             "auto_wrap_policy, or nest by hand (wrap children, then the parent without a policy)")


def split_ignored(ignored_modules, ignored_states, where: str) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """``ignored_states`` (torch FSDP1): modules or parameters, not both kinds."""
    modules = list(ignored_modules or ())
    states = list(ignored_states or ())
    if states and not (all(isinstance(s, nn.Parameter) for s in states)
                       or all(isinstance(s, nn.Module) for s in states)):
        raise ValueError(f"{where}: ignored_states must hold only nn.Parameter or only nn.Module objects")
    params = [s for s in states if isinstance(s, nn.Parameter)]
    modules += [s for s in states if isinstance(s, nn.Module)]
    return modules, params


def group_from_mesh(device_mesh, process_group, strategy: ShardingStrategy, where: str):
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


def resolve_device(device_id, module: nn.Module) -> torch.device:
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


def resolve_groups(strategy: ShardingStrategy, process_group, where: str):
    """(shard_group, replicate_group) for the strategy; None means the world."""
    pair = isinstance(process_group, (tuple, list))
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if process_group is None:
            return default_hybrid_groups(where)
        if not pair or len(process_group) != 2:
            raise ValueError(f"{where}: HYBRID_SHARD takes process_group as a (shard_group, replicate_group) "
                             f"pair, or None to group by LOCAL_WORLD_SIZE; got {type(process_group).__name__}")
        shard, rep = process_group
        if collectives.group_size(shard) * collectives.group_size(rep) != collectives.world_size():
            raise ValueError(
                f"{where}: HYBRID_SHARD shard group size {collectives.group_size(shard)} x replicate group size "
                f"{collectives.group_size(rep)} != world size {collectives.world_size()}; pass groups that tile the "
                "world")
        check_hybrid_layout(shard, rep, where)
        return shard, rep
    if pair:
        raise ValueError(f"{where}: {strategy.value} takes a single process group; a (shard, replicate) "
                         "pair is only for HYBRID_SHARD")
    group = process_group if process_group is not None else collectives.world_group()
    if strategy is ShardingStrategy.NO_SHARD:
        # Hybrid sharding with shards of one rank: gradients are all-reduced.
        return collectives.SELF_GROUP, group
    return group, None


def check_hybrid_layout(shard, rep, where: str) -> None:
    """Check (once per pair) that the replicas in each replicate group hold
    the same shard (the same shard-group rank): otherwise the gradient
    all-reduce would sum different shards. Two small all-reduces (replicate,
    then shard group), so every rank reaches the same verdict.

    Raises:
        ValueError: naming this rank's replicate group and its shard ranks.
    """
    key = (id(shard), id(rep))
    if key in HYBRID_CHECKED and HYBRID_CHECKED[key][0] is shard and HYBRID_CHECKED[key][1] is rep:
        return
    mine = float(collectives.group_rank(shard))
    seen = torch.tensor([mine, -mine])
    collectives.all_reduce(seen, rep, "max", tag="HYBRID_SHARD layout check")
    bad = torch.tensor([float(seen[0] != -seen[1])])
    collectives.all_reduce(bad, shard, "max", tag="HYBRID_SHARD layout check")
    if bad.item():
        raise ValueError(
            f"{where}: HYBRID_SHARD replicate group {collectives.group_ranks(rep)} (or another) joins ranks at "
            "different "
            f"shard-group ranks (this rank is shard rank {int(mine)} of {collectives.group_ranks(shard)}), so replicas "
            "would hold different shards; pass replicate groups of the ranks with equal shard rank, e.g. a "
            "2-D DeviceMesh (replicate, shard) built from init_device_mesh")
    HYBRID_CHECKED[key] = (shard, rep)  # held, so the ids are not reused


def default_hybrid_groups(where: str):
    world = collectives.world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"{where}: HYBRID_SHARD world size {world} is not a multiple of LOCAL_WORLD_SIZE "
                         f"{local}; pass process_group=(shard_group, replicate_group)")
    key = (local, world)
    cache = HYBRID_GROUPS.setdefault(collectives.world_group(), {})
    if key not in cache:
        me = collectives.rank()
        shard = rep = None
        for start in range(0, world, local):
            g = collectives.new_group(list(range(start, start + local)))
            if start <= me < start + local:
                shard = g
        for i in range(local):
            g = collectives.new_group(list(range(i, world, local)))
            if me % local == i:
                rep = g
        cache[key] = (shard, rep)
    return cache[key]


def apply_placements(slots: list[ParamSlot], shard_placement_fn, where: str, ragged_ok: bool = True) -> None:
    """Set each slot's requested placement from ``shard_placement_fn(param)``
    (core/placement.py [Note: placements]); None leaves every slot
    :class:`RowShard`.

    Raises:
        ValueError: the function returned something that is not a placement,
            ``Shard(d)`` with d out of range, ``Shard(d)`` with d != 0 on the
            wrapper (``ragged_ok=True``: its state dicts hold dim-0 rows), or
            (``ragged_ok=False``: ``fully_shard``) a ``BlockShard``/``Owned``,
            which a ``Shard(d)`` DTensor cannot present.
    """
    if shard_placement_fn is None:
        return
    for s in slots:
        s.placement = placement.normalize(shard_placement_fn(s.param), s.fqn, s.param.ndim)
        if ragged_ok and isinstance(s.placement, placement.DimShard):
            raise ValueError(
                f"{where}: shard_placement_fn returned Shard({s.placement.dim}) for '{s.fqn}'; "
                "FullyShardedDataParallel shards dim 0 only (Shard(0), RowShard, BlockShard, Owned); "
                "use fully_shard(..., shard_placement_fn=...) to shard another dim")
        if not ragged_ok and not isinstance(s.placement, (placement.RowShard, placement.DimShard)):
            raise ValueError(
                f"{where}: shard_placement_fn returned {s.placement} for '{s.fqn}', but fully_shard presents "
                "parameters as DTensor(Shard(0)) (or Shard(d)), which holds torch.chunk chunks only; return "
                "None/Shard(d) here, or wrap with FullyShardedDataParallel(..., shard_placement_fn=...) for block or "
                "owned placements")
