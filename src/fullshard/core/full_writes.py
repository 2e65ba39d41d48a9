"""Writes into a unit's gathered full parameters, which resharding would lose.

[Note: writes to gathered parameters]
While a unit is unsharded its modules compute from views of ``flat_full``; resharding frees that
memory, and the next all-gather rebuilds it from the shards. A write into a full view (an
``nn.Embedding(max_norm=...)`` renormalizing its rows in forward, a weight constraint clamping
``module.weight`` in place under ``torch.no_grad()``) changes one iteration's computation and is then
lost: the plain model and DDP keep it. Under grad mode autograd refuses such a write (the views are
outputs of ``grads.UnflattenFull``); without grad nothing did. Every view (detached or not) shares
``flat_full``'s version counter, and the engine fills ``flat_full`` only through ``.data`` (a counter
of its own), so a changed counter at reshard is exactly a write through the views: :func:`check`
raises then, after the unit has resharded (its state stays consistent). Not covered: writes through
``.data`` (no counter sees them), all-gather extensions' outputs (their own tensors) and units whose
full flat is the shard itself (one rank, same dtype: the write lands in the shard and is kept).
"""
from __future__ import annotations

from typing import Optional

from . import collectives, torch_private


def record(unit) -> Optional[int]:
    """The counter to compare at reshard, taken once the gathered values are laid out (None: aliased)."""
    return None if unit.aliased else torch_private.version_counter(unit.flat_full)


def written(unit) -> bool:
    """Whether the full parameters were written in place since :func:`record` (call before freeing)."""
    return unit.full_version is not None and torch_private.version_counter(unit.flat_full) != unit.full_version


def check(unit, was_written: bool) -> None:
    """Raise for a write :func:`written` saw.

    Raises:
        RuntimeError: the unit's full parameters were written in place while gathered.
    """
    if was_written:
        raise RuntimeError(
            f"[rank {collectives.rank()}] unit '{unit.name}': a full parameter was written in place while the unit "
            "was gathered (e.g. nn.Embedding(max_norm=...) renormalizing rows, or an in-place clamp in forward under "
            "torch.no_grad()); resharding drops the write, where one process and DDP keep it. Write the sharded "
            "parameters outside forward (torch.no_grad(): p.clamp_()), or inside summon_full_params(writeback=True)")
