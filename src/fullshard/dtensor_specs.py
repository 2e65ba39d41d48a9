"""How ``fully_shard`` presents each parameter of a unit as a DTensor
(core/params.py :class:`DTensorSpec`), including parameters that are
already DTensors of tensor parallelism (``parallelize_module``), and the
meshes it shards over (default mesh, shard/replicate groups, the
post-forward group of ``reshard_after_forward=k``).

[Note: tensor-parallel parameters]
A tensor-parallel (TP) parameter is a DTensor on a TP mesh whose local
tensor is this rank's TP part. The engine shards that local tensor (a plain
tensor) on dim 0 over the data-parallel (dp) group, exactly as a plain
parameter; the ranks of one dp group share a TP coordinate, so they hold
parts of equal shapes. The registered sharded parameter is a DTensor on the
concatenation of the dp mesh and the TP mesh with placements (dp placement,
*TP placements): dp shards dim 0 of the TP part, which is ``Shard(0)`` of
the global tensor unless TP also shards dim 0, when the dp chunks interleave
with the TP chunks and the placement is ``_StridedShard(0, split_factor=
<TP shards of dim 0>)`` (torch FSDP2's ``_init_sharding_spec_tp``). Modules
read the gathered TP part as a DTensor on the TP mesh with the original
placements; its backward (``DTensor.from_local``'s) gives the TP-local
gradient, which the engine reduce-scatters over dp like any other.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .core import collectives, flat, torch_private
from .core.params import DTensorSpec, ParamSlot


def assign_specs(slots: list[ParamSlot], mesh, placements: tuple, where: str) -> None:
    """Give each slot its :class:`DTensorSpec`; a DTensor parameter's slot
    then holds its TP-local tensor (a plain tensor, what the engine shards).

    Args:
        slots: the unit's records; ``slot.param`` the original parameter.
        mesh: the data-parallel mesh (1-D shard, or 2-D (replicate, shard)).
        placements: the data-parallel placements (``(Shard(0),)`` or
            ``(Replicate(), Shard(0))``); a slot placed ``DimShard(d)`` gets
            ``Shard(d)`` in place of the last.
        where: ``"[rank r] fully_shard(Name)"`` for errors.
    Raises:
        ValueError: a DTensor parameter with a placement other than ``Shard``
            or ``Replicate`` (``Partial``, already strided), or whose mesh is
            not disjoint from ``mesh`` within one root mesh; ``Shard(d)``,
            d != 0, for a DTensor parameter.
    """
    concatenated: dict = {}
    for slot in slots:
        p = slot.param
        dim = getattr(slot.placement, "dim", 0)  # DimShard: fully_shard's Shard(d), d != 0
        if not isinstance(p, DTensor):
            slot.spec = DTensorSpec(mesh, (*placements[:-1], Shard(dim)), p.shape, flat.contiguous_stride(p.shape))
            continue
        if dim:
            raise ValueError(f"{where}: shard_placement_fn returned Shard({dim}) for the tensor-parallel parameter "
                             f"'{slot.fqn}'; fully_shard shards tensor-parallel parameters on dim 0 only: return "
                             "None or Shard(0) for it")
        tp_mesh = p.device_mesh
        if tp_mesh not in concatenated:
            concatenated[tp_mesh] = _concatenate(mesh, tp_mesh, slot.fqn, where)
        slot.spec = tp_spec(p, concatenated[tp_mesh], placements, slot.fqn, where)
        local = torch_private.local_tensor(p).detach()
        slot.param = local.requires_grad_(p.requires_grad)


def tp_spec(param: DTensor, spmd_mesh, dp_placements: tuple, fqn: str, where: str) -> DTensorSpec:
    """The spec of a TP parameter sharded over dp (see [Note: tensor-parallel
    parameters]): the sharded parameter on ``spmd_mesh`` (dp dims, then TP
    dims) with placements ``(*dp_placements[:-1], dp placement, *TP
    placements)``; the full view on the TP mesh with the TP placements.

    Raises:
        ValueError: a TP placement that is not ``Shard`` or ``Replicate``.
    """
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    for placement in tp_placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"{where}: parameter '{fqn}' is a DTensor with placements {tp_placements}; fully_shard takes "
                "tensor-parallel parameters placed Shard(d) or Replicate() on each mesh dim (not Partial or "
                "strided); redistribute it (or pass it in ignored_params)")
    split = math.prod(tp_mesh.size(i) for i, pl in enumerate(tp_placements)
                      if isinstance(pl, Shard) and pl.dim % param.ndim == 0)
    dp_placement = torch_private.strided_shard(0, split) if split > 1 else Shard(0)
    return DTensorSpec(spmd_mesh, (*dp_placements[:-1], dp_placement, *tp_placements), param.shape,
                       tuple(param.stride()), full_mesh=tp_mesh, full_placements=tp_placements)


def _concatenate(dp_mesh, tp_mesh, fqn: str, where: str):
    """The mesh of the dp dims followed by the TP dims (one root mesh)."""
    try:
        return torch_private.concatenate_meshes([dp_mesh, tp_mesh])
    except (RuntimeError, TypeError, ValueError, AssertionError) as e:
        raise ValueError(
            f"{where}: parameter '{fqn}' is a DTensor on mesh "
            f"{tp_mesh}, which does not combine with the data-parallel mesh {dp_mesh} ({str(e).splitlines()[0]}); "
            "slice both from one named mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')); parallelize_module(..., mesh['tp']); fully_shard(..., "
            "mesh=mesh['dp'])") from None


# ------------------------------------------------------------------ meshes
_DEFAULT_MESH: "weakref.WeakKeyDictionary[Any, DeviceMesh]" = weakref.WeakKeyDictionary()
_POST_FORWARD_GROUPS: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()


def post_forward_group(reshard_after_forward, shard_group, where: str):
    """(reshard after forward?, post-forward group or None). An int k keeps
    1/k of the full parameters on each rank after forward, gathered in
    backward within k consecutive ranks of the shard group (hpZ; ZeRO++,
    Wang et al. 2023, §3.2). k = shard size is True, k = 1 is False.

    Raises:
        ValueError: k is not a positive divisor of the shard group's size.
    """
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    k, n = reshard_after_forward, collectives.group_size(shard_group)
    if k < 1 or n % k:
        raise ValueError(f"{where}: reshard_after_forward={k} must divide the shard group size {n} "
                         "(the ranks that re-gather in backward)")
    if k in (1, n):
        return k == n, None
    cache = _POST_FORWARD_GROUPS.setdefault(shard_group, {})
    if k not in cache:  # every rank creates every subgroup, in the same order
        ranks, mine = collectives.group_ranks(shard_group), collectives.group_rank(shard_group) // k
        groups = [collectives.new_group(ranks[i:i + k]) for i in range(0, n, k)]
        cache[k] = groups[mine]
    return True, cache[k]


def default_mesh() -> DeviceMesh:
    world = collectives.world_group()
    if world not in _DEFAULT_MESH:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        _DEFAULT_MESH[world] = init_device_mesh(device_type, (collectives.world_size(),))
    return _DEFAULT_MESH[world]


def groups_of(mesh: DeviceMesh, where: str):
    """(shard group, replicate group or None, DTensor placements) of a mesh."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None, (Shard(0),)
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0), (Replicate(), Shard(0))
    raise ValueError(f"{where}: mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())
