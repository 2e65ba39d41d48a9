"""Cross-rank consistency of a unit's values at construction: broadcast from
the unit's first rank (``sync_module_states``) or check that every rank
holding the unit starts from the same parameters.

Both run over the unit's own groups only, replicate group first (see
:func:`fullshard.core.collectives.multi_rank_groups`): units on other groups
construct independently.
"""
from __future__ import annotations

import torch

from . import collectives


@torch.no_grad()
def broadcast_from_first(tensors: list[torch.Tensor], shard_group, replicate_group) -> None:
    """Overwrite every rank's tensors with those of the unit's first rank
    (``sync_module_states``; see ``collectives.is_first_rank``): over the
    replicate group from its rank 0, then over the shard group from its rank 0.

    Replicate group first, as torch FSDP1 does: in a HYBRID_SHARD layout
    (replicas hold the same shard rank) the shard groups' rank-0 ranks form
    one replicate group, so after the first broadcast they all hold its rank
    0's values, and the second spreads exactly those. Only the unit's ranks
    take part: units on other groups construct independently.
    """
    for group in collectives.multi_rank_groups(shard_group, replicate_group):
        for t in tensors:
            collectives.broadcast(t.data, 0, group, tag="sync_module_states")


@torch.no_grad()
def check_same_across_ranks(named: list[tuple[str, torch.Tensor]], shard_group, replicate_group,
                            unit: str) -> None:
    """Compare three strided fp64 checksums per parameter across the ranks
    that hold the unit with one small all-reduce (max of [v, -v]) per group
    (replicate, then shard: the maximum over a HYBRID_SHARD layout). Every
    such rank reaches the same verdict.

    Raises:
        ValueError: naming the first parameter whose checksums differ.
    """
    groups = collectives.multi_rank_groups(shard_group, replicate_group)
    if not named or not groups:
        return
    sums = []
    for _, p in named:
        # Strided sums: position-sensitive without allocating a copy.
        t = p.detach().reshape(-1)
        sums += [t.sum(dtype=torch.float64), t[::7].sum(dtype=torch.float64),
                 t[1::3].sum(dtype=torch.float64)]
    v = torch.stack(sums).cpu()
    both = torch.cat([v, -v])
    for group in groups:
        collectives.all_reduce(both, group, "max", tag=f"unit '{unit}' construction check")
    hi, lo = both[:v.numel()], -both[v.numel():]
    bad = (hi != lo).nonzero()
    if bad.numel():
        name = named[int(bad[0]) // 3][0]
        ranks = sorted({r for g in groups for r in collectives.group_ranks(g)})
        raise ValueError(
            f"[rank {collectives.rank()}] unit '{unit}': parameter '{name}' differs across ranks {ranks} (the "
            "unit's process group) at construction; initialize with the same seed on each of them or pass "
            "sync_module_states=True")
