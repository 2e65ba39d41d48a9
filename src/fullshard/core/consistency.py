"""Cross-rank consistency of a unit's values at construction: broadcast from
the unit's first rank (``sync_module_states``) or check that every rank
holding the unit starts from the same parameters.

Both run over the unit's own groups only, replicate group first (see
:func:`fullshard.core.collectives.multi_rank_groups`): units on other groups
construct independently.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import collectives, torch_private, tree

# fully_shard units whose parameters differed across ranks at construction, until a
# load writes them (see :func:`defer`); keyed weakly so a deleted model leaves.
PENDING: "weakref.WeakKeyDictionary[object, _Unwritten]" = weakref.WeakKeyDictionary()


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
                            unit: str, defer: bool = False) -> list[str]:
    """Compare three strided fp64 checksums per parameter across the ranks
    that hold the unit with one small all-reduce (max of [v, -v]) per group
    (replicate, then shard: the maximum over a HYBRID_SHARD layout). Every
    such rank reaches the same verdict.

    Returns:
        With ``defer``, the names of the parameters that differ (raising is
        left to :func:`verify`); else [].
    Raises:
        ValueError: (without ``defer``) naming the first parameter whose
            checksums differ.
    """
    groups = collectives.multi_rank_groups(shard_group, replicate_group)
    if not named or not groups:
        return []
    sums, owner = [], []
    for i, (_, p) in enumerate(named):
        for part in tree.plain_tensors([p.detach()]) or [p.detach()]:
            # Strided sums: position-sensitive without allocating a copy.
            t = part.reshape(-1)
            sums += [t.sum(dtype=torch.float64), t[::7].sum(dtype=torch.float64),
                     t[1::3].sum(dtype=torch.float64)]
            owner += [i] * 3
    if not sums:
        return []
    v = torch.stack(sums).cpu()
    both = torch.cat([v, -v])
    for group in groups:
        collectives.all_reduce(both, group, "max", tag=f"unit '{unit}' construction check")
    hi, lo = both[:v.numel()], -both[v.numel():]
    bad = (hi != lo).nonzero()
    if defer:
        return list(dict.fromkeys(named[owner[i]][0] for i in bad.flatten().tolist()))
    if bad.numel():
        name = named[owner[int(bad[0])]][0]
        ranks = sorted({r for g in groups for r in collectives.group_ranks(g)})
        raise ValueError(
            f"[rank {collectives.rank()}] unit '{unit}': parameter '{name}' differs across ranks {ranks} (the "
            "unit's process group) at construction; initialize with the same seed on each of them or pass "
            "sync_module_states=True")


class _Unwritten:
    """Parameters of one unit that differed across ranks at construction,
    with the version counters they had once sharded: a write since (a
    ``load_state_dict``, ``set_model_state_dict``, ``copy_``) bumps one."""

    def __init__(self, unit, names: list[str]):
        self.slots = [s for part in (unit, *unit.side) for s in part.slots if s.fqn in set(names)]  # dtype parts
        self.versions = [self._versions(s) for s in self.slots]

    @staticmethod
    def _versions(slot) -> tuple:
        return (id(slot.sharded), torch_private.version_counter(slot.sharded),
                torch_private.version_counter(slot.registered_local()))

    def first_unwritten(self) -> Optional[str]:
        """The first parameter not written since construction (None: all were)."""
        return next((s.fqn for s, v in zip(self.slots, self.versions) if self._versions(s) == v), None)


def defer(unit, names: list[str]) -> None:
    """``fully_shard``: the parameters ``names`` of ``unit`` differed across
    its ranks at construction; :func:`verify` refuses to run the unit until
    each has been written (torch's remedy: a full state dict loaded after
    ``fully_shard``, broadcast from rank 0)."""
    if names:
        PENDING[unit] = _Unwritten(unit, names)


def verify(units: list) -> None:
    """Before a forward under the root of ``units`` (in the same order on
    every rank): refuse to run while a parameter that differed across ranks
    at construction has not been written since. One small all-reduce per
    pending unit (max over its groups), so every rank reaches one verdict.

    Raises:
        ValueError: naming the first such parameter and what to do.
    """
    for unit in units:
        record = PENDING.get(unit)
        if record is None:
            continue
        name = record.first_unwritten()
        flag = torch.tensor([0.0 if name is None else 1.0])
        groups = collectives.multi_rank_groups(unit.cfg.shard_group, unit.cfg.replicate_group)
        for group in groups:
            collectives.all_reduce(flag, group, "max", tag=f"unit '{unit.name}' construction check")
        if not flag.item():
            del PENDING[unit]
            continue
        ranks = sorted({r for g in groups for r in collectives.group_ranks(g)})
        raise ValueError(
            f"[rank {collectives.rank()}] unit '{unit.name}': parameter '{name or record.slots[0].fqn}' differed "
            f"across ranks {ranks} (the unit's process group) when fully_shard sharded it, and nothing has "
            "written it since; each rank would train its own rows of different models (DDP starts from rank "
            "0's). Initialize every rank with the same seed before building the model, or load one full state "
            "dict after fully_shard: torch.distributed.checkpoint.state_dict.set_model_state_dict(model, sd, "
            "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))")
