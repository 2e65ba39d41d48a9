"""The global gradient norm of a sharded model (``clip_grad_norm_``): which
gradients each rank counts, and their norm over the root unit's groups.

Clipping itself is ``torch.nn.utils.clip_grads_with_norm_`` with the norm
computed here: it multiplies each gradient by the 0-dim fp32 coefficient,
so a low-precision gradient is multiplied in fp32 and rounded once.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from . import collectives


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


def global_norm(counted: list[torch.Tensor], local: list[torch.Tensor], shard_group, replicate_group,
                norm_type: float) -> torch.Tensor:
    """Total ``norm_type`` norm of all gradients of a model whose root unit is
    on ``shard_group`` / ``replicate_group``: the ``counted`` shard
    contributions (each gradient element held by exactly one rank; see
    :func:`grads_by_kind`) are summed (max for inf) over the root's ranks,
    replicate group then shard group; unmanaged gradients are replicated and
    added once.

    Returns:
        0-dim fp32 tensor on the host, identical on every rank of the groups.
    """
    is_inf = norm_type == float("inf")
    part = _norm_part(counted, norm_type)
    for group in collectives.multi_rank_groups(shard_group, replicate_group):
        collectives.all_reduce(part, group, "max" if is_inf else "sum", tag="gradient norm")
    rest = _norm_part(local, norm_type)
    if is_inf:
        return torch.maximum(part, rest)
    return (part + rest).pow(1.0 / norm_type)
