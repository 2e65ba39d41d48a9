"""The global gradient norm of a sharded model (``clip_grad_norm_``): which
gradients each rank counts, and their norm over the root unit's groups.

Clipping itself is ``torch.nn.utils.clip_grads_with_norm_`` with the norm
computed here: it multiplies each gradient by the 0-dim fp32 coefficient,
so a low-precision gradient is multiplied in fp32 and rounded once.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import collectives, invariant, registry
from .params import local_of


def grads_by_kind(runtimes, params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                    list[torch.Tensor]]:
    """(gradients of sharded parameters this rank counts in the norm, those
    a replica with replicate-group rank 0 counts instead, gradients of
    unmanaged parameters)."""
    sharded_ids, counted, replica = set(), [], []
    for rt in runtimes:
        rep = rt.unit.cfg.replicate_group
        mine = rep is None or collectives.group_rank(rep) == 0
        for slot in rt.unit.slots:
            sharded_ids.add(id(slot.sharded))
            grad = slot.grad()
            if grad is not None:
                (counted if mine else replica).append(grad)
    local = [p.grad for p in params if id(p) not in sharded_ids and p.grad is not None]
    return counted, replica, local


def _norm_part(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # An empty shard (fewer rows than ranks) adds nothing; the inf norm of an
    # empty tensor is an error (no identity for max), which would leave the
    # other ranks waiting in the all-reduce.
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type).cpu() for g in grads])
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _powered(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """|g|**p of every element as one float64 vector (exact for p = 2 and
    fp32 / bf16 / fp16 gradients: the square of a 24-bit mantissa fits in 53)."""
    parts = [local_of(g).detach().reshape(-1).to("cpu", torch.float64).abs() for g in grads if g.numel()]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    cat = torch.cat(parts)
    return cat.square() if norm_type == 2.0 else cat.pow(norm_type)


def _exact_norm(grads: list[torch.Tensor], norm_type: float, groups: list) -> float:
    """The p-th power of the ``norm_type`` norm of ``grads`` summed over
    ``groups`` with :func:`~fullshard.core.invariant.exact_sum` (the same
    bits however the elements are split over ranks)."""
    return invariant.exact_sum(_powered(grads, norm_type), groups)


def global_norm(counted: list[torch.Tensor], local: list[torch.Tensor], shard_group, replicate_group,
                norm_type: float, exact: bool = False) -> torch.Tensor:
    """Total ``norm_type`` norm of all gradients of a model whose root unit is
    on ``shard_group`` / ``replicate_group``: the ``counted`` shard
    contributions (each gradient element held by exactly one rank; see
    :func:`grads_by_kind`) are summed (max for inf) over the root's ranks,
    replicate group then shard group; unmanaged gradients are replicated and
    added once.

    ``exact`` (``world_size_invariant`` units, p < inf): the p-th powers are
    summed exactly (core/invariant.py :func:`exact_sum`), so the norm does
    not depend on how the elements are split over ranks.

    Returns:
        0-dim fp32 tensor on the host, identical on every rank of the groups.
    """
    is_inf = norm_type == float("inf")
    if exact and not is_inf:
        groups = collectives.multi_rank_groups(shard_group, replicate_group)
        value = _exact_norm(counted, norm_type, groups) + _exact_norm(local, norm_type, [])
        return torch.tensor(value ** (1.0 / norm_type), dtype=torch.float32)
    part = _norm_part(counted, norm_type)
    for group in collectives.multi_rank_groups(shard_group, replicate_group):
        collectives.all_reduce(part, group, "max" if is_inf else "sum", tag="gradient norm")
    rest = _norm_part(local, norm_type)
    if is_inf:
        return torch.maximum(part, rest)
    return (part + rest).pow(1.0 / norm_type)


def _shard_groups(t) -> list:
    """Process groups of the mesh dimensions a DTensor is sharded over (its
    norm contributions are summed over them; replicated dimensions hold
    copies and are not).

    Raises:
        ValueError: a ``Partial`` placement (a gradient not yet reduced).
    """
    groups = []
    for dim, dt_placement in enumerate(t.placements):
        if dt_placement.is_partial():
            raise ValueError(f"clip_grad_norm_: a gradient is a Partial DTensor ({t.placements}); reduce it "
                             "(redistribute to Shard or Replicate) before clipping")
        if dt_placement.is_shard():
            groups.append(t.device_mesh.get_group(dim))
    return groups


def total_norm(grads: list[torch.Tensor], norm_type: float, exact: bool = False,
               plain_groups: Optional[list[tuple]] = None) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads`` as if every DTensor were gathered:
    each DTensor's local contribution is summed (max for inf) over the mesh
    dimensions it is sharded on, plain tensors count once (replicated), and
    empty local shards contribute nothing. Gradients on different meshes
    (tensor parallelism on some modules only) and plain ones may be mixed.

    ``exact``: as in :func:`global_norm`. ``plain_groups``: per gradient, the
    groups a plain one is sharded over (``FullyShardedDataParallel``'s
    parameters are plain shards); default none (replicated).

    Returns:
        0-dim fp32 plain tensor on the host, equal on every rank.
    """
    is_inf = norm_type == float("inf")
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for i, g in enumerate(grads):
        if isinstance(g, DTensor):
            key = tuple(_shard_groups(g))
        else:
            key = plain_groups[i] if plain_groups is not None else ()
        by_groups.setdefault(key, []).append(local_of(g))
    if exact and not is_inf:
        value = sum(_exact_norm(locals_, norm_type, list(groups)) for groups, locals_ in by_groups.items())
        return torch.tensor(value ** (1.0 / norm_type), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32)
    for groups, locals_ in by_groups.items():  # insertion order: the same on every rank
        part = _norm_part([t for t in locals_ if t.numel()], norm_type)
        for group in groups:
            collectives.all_reduce(part, group, "max" if is_inf else "sum", tag="gradient norm")
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


def _plain_groups(param) -> tuple:
    """The shard group of a plain parameter a unit registered (the wrapper's
    shards; replicas of HSDP hold the same rows), else none."""
    if isinstance(param, DTensor):
        return ()
    found = registry.find(param)
    if found is None or found[0].world == 1:
        return ()
    return (found[0].cfg.shard_group,)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models, returning the
    global norm as a plain tensor: every rank gets the same value (torch's
    returns a DTensor, ``Partial`` for the inf norm, whose ``.item()`` is
    the rank's local maximum), gradients on several meshes and plain ones
    (replicated, or ``FullyShardedDataParallel``'s shards, summed over their
    shard group) may be mixed, and empty shards are skipped; with
    parameters of ``world_size_invariant`` units the sum is exact
    (:func:`global_norm`). Each
    gradient is multiplied in place by ``min(1, max_norm / (norm + 1e-6))``,
    torch's coefficient.

    Args:
        parameters: tensors or DTensors (e.g. ``model.parameters()``).
        max_norm: the norm to clip to.
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
    Returns:
        The total norm before clipping: 0-dim fp32 tensor on the host.
    Raises:
        ValueError: a ``Partial`` DTensor gradient.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    exact = any(invariant.is_marked(p) for p in parameters)
    norm = total_norm(grads, float(norm_type), exact=exact, plain_groups=[_plain_groups(p) for p in parameters])
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = local_of(g)
        local.mul_(coef.to(local.device))  # as torch: a low-precision gradient is scaled in fp32, rounded once
    return norm
