"""Per-parameter placements on a unit's flat shard, and where a sharded
parameter's rows are (:func:`shard_info`, a view of its slot found in
``core/registry.py`` [Note: sharded-parameter registry]).

[Note: placements]
A unit still has one flat shard per rank and moves it with one all-gather
and one reduce-scatter; a placement only decides which rows of a parameter
each rank of the shard group keeps (dim 0, in rank order):

* :class:`RowShard` (default): ``torch.chunk`` semantics, ``ceil(rows / N)``
  rows per rank, so trailing ranks may hold fewer (or zero) rows.
* :class:`BlockShard`: the same on blocks of ``rows`` rows, so a block never
  straddles two ranks (per-block preconditioners, block-wise quantized state).
* :class:`Owned`: one rank keeps every row, the others none; an optimizer
  that needs the whole matrix (Muon's Newton–Schulz iteration) runs on the
  owner, and the next all-gather brings the result to everyone.
* :class:`DimShard` (``fully_shard``'s ``Shard(d)``, d != 0): ``torch.chunk``
  semantics along dim d, each rank's chunk stored contiguously in its slot;
  its "rows" are the slices of dim d (``bounds`` index dim d). Only the
  copies between the rank-major and param-major layouts differ (strided,
  ``flat.py`` [Note: flat layouts]).

Row- and block-sharded parameters take the same padded slot on every rank
(``chunk_rows`` rows), as before. Owned parameters are packed after them on
their owner only, so ranks' used elements differ; the flat shard is padded to
the largest (see ``flat.py`` [Note: flat layouts]). ``Owned(rank=None)``
lets :func:`assign_owners` pick owners by longest-processing-time-first:
largest parameter to the least-loaded rank, which bounds the largest rank's
load by 4/3 of the optimum (Graham 1969, "Bounds on multiprocessing timing
anomalies", Theorem 1). The same related systems (veScale-FSDP's
``RaggedShard``, Megatron-FSDP's row/tensor-atomic buffers) motivate the
design; the code is ours.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Optional, Sequence, Union

import torch

from . import registry


@dataclasses.dataclass(frozen=True)
class RowShard:
    """Dim-0 chunks, ``torch.chunk(p, N, dim=0)`` semantics (the default)."""


@dataclasses.dataclass(frozen=True)
class BlockShard:
    """Shard boundaries only at multiples of ``rows`` rows.

    Blocks of ``rows`` rows (the last may be shorter) are chunked over the N
    ranks with ``torch.chunk`` semantics, so ``ceil(ceil(R / rows) / N)``
    blocks per rank.

    Raises:
        ValueError: ``rows`` is not a positive int.
    """

    rows: int

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"BlockShard(rows) needs a positive int number of rows, got {self.rows!r}")


@dataclasses.dataclass(frozen=True)
class Owned:
    """The whole parameter lives on one rank of the shard group.

    Args:
        rank: the owner's rank in the shard group; None lets fullshard assign
            owners within each unit to balance the ranks' shard sizes.

    Raises:
        ValueError: ``rank`` is negative or not an int.
    """

    rank: Optional[int] = None

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0):
            raise ValueError(f"Owned(rank) needs a shard-group rank >= 0 or None, got {self.rank!r}")


@dataclasses.dataclass(frozen=True)
class DimShard:
    """``torch.chunk(p, N, dim=dim)`` chunks, each stored contiguously: what
    ``fully_shard``'s ``Shard(dim)`` with ``dim != 0`` becomes (``dim`` is
    resolved to ``0 < dim < p.ndim``; dim 0 is :class:`RowShard`)."""

    dim: int


Placement = Union[RowShard, BlockShard, Owned, DimShard]


def normalize(result, fqn: str, ndim: int = 1) -> Placement:
    """A ``shard_placement_fn`` result as a placement for a parameter of
    ``ndim`` dimensions: None and ``Shard(0)`` (or ``Shard(-ndim)``) mean
    :class:`RowShard`, ``Shard(d)`` for another d :class:`DimShard` (d
    made non-negative).

    Raises:
        ValueError: ``Shard(d)`` with d out of range for ``ndim``, or anything else.
    """
    if result is None:
        return RowShard()
    if isinstance(result, (RowShard, BlockShard, Owned)):
        return result
    dim = getattr(result, "dim", None)
    if type(result).__name__ == "Shard" and isinstance(dim, int):
        if not -max(ndim, 1) <= dim < max(ndim, 1):
            raise ValueError(f"shard_placement_fn returned Shard({dim}) for '{fqn}', which has {ndim} dimension(s); "
                             f"return Shard(d) with -{max(ndim, 1)} <= d < {max(ndim, 1)}")
        dim %= max(ndim, 1)
        return RowShard() if dim == 0 else DimShard(dim)
    raise ValueError(f"shard_placement_fn returned {result!r} for '{fqn}'; return None, Shard(d), "
                     "fullshard.RowShard(), fullshard.BlockShard(rows) or fullshard.Owned(rank=None)")


def shard_dim(placement: Placement) -> int:
    """The dimension whose slices a placement spreads over ranks."""
    return placement.dim if isinstance(placement, DimShard) else 0


def chunk_rows(placement: Placement, rows: int, world: int) -> int:
    """Rows of a row- or block-sharded parameter's slot on every rank."""
    if isinstance(placement, BlockShard):
        blocks = math.ceil(rows / placement.rows)
        return math.ceil(blocks / world) * placement.rows if rows else 0
    return math.ceil(rows / world) if rows else 0


def row_bounds(placement: Placement, rows: int, world: int) -> tuple[int, ...]:
    """``bounds`` with rank r keeping rows ``[bounds[r], bounds[r + 1])``
    (``world + 1`` entries). ``Owned`` must have its rank resolved."""
    if isinstance(placement, Owned):
        return tuple(0 if r <= placement.rank else rows for r in range(world + 1))
    step = chunk_rows(placement, rows, world)
    return tuple(min(rows, r * step) for r in range(world + 1))


def assign_owners(unit_name: str, placements: Sequence[Placement], numels: Sequence[int],
                  world: int, tally: Optional[list[int]] = None) -> list[Placement]:
    """Resolve every ``Owned(None)`` of one unit (see [Note: placements]).

    Fixed owners count first; then the unset ones, largest first, go to the
    rank with the fewest owned elements in this unit. Ties go to the rank
    with the fewest owned elements in earlier units (``tally``, updated in
    place; the ranks of a group build the same units in the same order, so
    they agree), then in an order rotated by a hash of ``unit_name``, so
    equal units do not all load the same rank.

    Raises:
        ValueError: an ``Owned(rank)`` with ``rank >= world``.
    """
    load = [0] * world
    for p, n in zip(placements, numels):
        if isinstance(p, Owned) and p.rank is not None:
            if p.rank >= world:
                raise ValueError(f"unit '{unit_name}': Owned(rank={p.rank}) but the shard group has {world} ranks; "
                                 "use a rank below the shard-group size or Owned(rank=None)")
            load[p.rank] += n
    rot = zlib.crc32(unit_name.encode()) % world
    earlier = tally if tally is not None and len(tally) == world else [0] * world
    out = list(placements)
    unset = [i for i, p in enumerate(placements) if isinstance(p, Owned) and p.rank is None]
    for i in sorted(unset, key=lambda i: (-numels[i], i)):
        owner = min(range(world), key=lambda r: (load[r], earlier[r], (r - rot) % world))
        load[owner] += numels[i]
        out[i] = Owned(owner)
    if tally is not None:
        tally[:] = [a + b for a, b in zip(earlier, load)]
    return out


# Owned elements per rank of the units built so far, per shard group
# (``assign_owners``'s tie-break across units).
_TALLY: dict[tuple[int, int], list[int]] = {}


def group_tally(group, world: int) -> list[int]:
    """The running owned-element tally of ``group`` (None: a one-rank group)."""
    key = (id(group), world)
    return _TALLY.setdefault(key, [0] * world)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where one parameter registered by fullshard keeps its rows.

    Attributes:
        fqn: the parameter's original name.
        shape: the full (global) shape.
        placement: resolved placement (an ``Owned`` has its ``rank``).
        bounds: rank r of the shard group keeps rows ``[bounds[r], bounds[r+1])``.
        rank: this process's rank in the shard group.
        world: shard-group size N.
        group: the shard group (reduce statistics over it), or None if N == 1.
        replicate_group: the group of replicas holding the same rows (HSDP), or None.
        invariant: the unit was built with ``world_size_invariant=True``.
    """

    fqn: str
    shape: torch.Size
    placement: Placement
    bounds: tuple[int, ...]
    rank: int
    world: int
    group: object
    replicate_group: object
    invariant: bool

    @classmethod
    def of(cls, slot, unit) -> ShardInfo:
        """The view of ``slot`` (a ``ParamSlot`` of ``unit``): its layout
        entry, and the unit's rank, world and groups."""
        lay, cfg = slot.layout, unit.cfg
        return cls(lay.fqn, lay.shape, lay.placement, lay.bounds, unit.rank, unit.world,
                   cfg.shard_group if unit.world > 1 else None, cfg.replicate_group,
                   cfg.invariant_layout is not None)

    @property
    def dim(self) -> int:
        """The dimension ``bounds`` index: 0, or d for :class:`DimShard`."""
        return shard_dim(self.placement)

    @property
    def rows(self) -> int:
        """Slices of the sharded dimension (``shape[dim]``; 1 for a 0-dim parameter)."""
        return self.shape[self.dim] if len(self.shape) else 1

    @property
    def row_range(self) -> tuple[int, int]:
        """This rank's rows ``[lo, hi)`` of dim :attr:`dim` (0 but for ``DimShard``)."""
        return self.bounds[self.rank], self.bounds[self.rank + 1]

    @property
    def owner(self) -> Optional[int]:
        """The owning shard-group rank for ``Owned``; None otherwise."""
        return self.placement.rank if isinstance(self.placement, Owned) else None

    @property
    def whole(self) -> bool:
        """Whether this rank holds every row of the parameter."""
        lo, hi = self.row_range
        return hi - lo == self.rows


def shard_info(param) -> Optional[ShardInfo]:
    """Where ``param`` (as ``model.parameters()`` yields it under either front
    door) keeps its rows, or None for a parameter fullshard does not shard.

    The local rows are ``param``'s own tensor (its ``to_local()`` for a
    DTensor), shape ``(hi - lo, *shape[1:])`` (``shape`` with ``hi - lo`` at
    ``info.dim`` for :class:`DimShard`); its ``.grad`` has the same shape.
    """
    found = registry.find(param)
    return ShardInfo.of(found[1], found[0]) if found is not None else None
