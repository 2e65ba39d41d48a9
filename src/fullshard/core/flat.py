"""Pure sharding math for one unit: dim-0 chunking, padding, flat offsets,
copy-out of an all-gather and copy-in for a reduce-scatter. No
``torch.distributed`` here.

[Note: flat layouts]
A unit with parameters p_0..p_k and a shard group of N ranks uses two layouts
of the same padded elements:

* rank-major (what travels): rank r's *flat shard* is the concatenation over
  i of chunk r of p_i, each chunk padded to ``chunk_rows_i`` rows. Chunks
  follow ``torch.chunk(p_i, N, dim=0)``: ``chunk_rows_i = ceil(rows_i / N)``,
  so trailing ranks may own fewer (even zero) real rows. Every rank's flat
  shard has the same numel S = Σ chunk_rows_i · row_numel_i, which is what
  all-gather and reduce-scatter need.
* param-major (what modules see): the *unsharded flat* holds each full
  parameter contiguously at offset N · shard_offset_i, followed by its padding
  rows, so every full parameter is a zero-copy view.

All-gather output (N, S) → param-major is a per-parameter transpose of
blocks (``copy_out``); the reverse for gradients is ``copy_in``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from . import torch_private


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one original parameter sits in a unit's flat buffers.

    Attributes:
        fqn: original (unwrapped) name of the parameter's first occurrence.
        shape: full shape of the parameter.
        rows: ``shape[0]`` (1 for a 0-dim parameter).
        row_numel: elements per dim-0 row, ``prod(shape[1:])``.
        chunk_rows: rows per rank's chunk, ``ceil(rows / N)``.
        shard_offset: element offset of this parameter's chunk in a flat shard.
        grad_offset: element offset in the flat gradient shard (trainable
            parameters only; -1 for frozen ones).
        requires_grad: whether the original parameter is trained.
    """

    fqn: str
    shape: torch.Size
    rows: int
    row_numel: int
    chunk_rows: int
    shard_offset: int
    grad_offset: int
    requires_grad: bool

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def shard_numel(self) -> int:
        """Padded elements of one rank's chunk."""
        return self.chunk_rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Real (unpadded) rows that ``rank`` owns, ``torch.chunk`` semantics."""
        start = rank * self.chunk_rows
        return max(0, min(self.rows, start + self.chunk_rows) - start)

    def local_shape(self, rank: int) -> torch.Size:
        """Shape of ``rank``'s shard: ``(local_rows, *shape[1:])``; 1-D for scalars."""
        return torch.Size((self.local_rows(rank), *self.shape[1:]))

    def local_row_range(self, rank: int) -> tuple[int, int]:
        start = min(self.rows, rank * self.chunk_rows)
        return start, start + self.local_rows(rank)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """All parameter layouts of one unit for a shard group of ``world`` ranks."""

    params: tuple[ParamLayout, ...]
    world: int

    @property
    def shard_numel(self) -> int:
        """S: elements in each rank's flat shard (padding included)."""
        return sum(p.shard_numel for p in self.params)

    @property
    def grad_shard_numel(self) -> int:
        """Elements in each rank's flat gradient shard (trainable params only)."""
        return sum(p.shard_numel for p in self.params if p.requires_grad)

    @property
    def unsharded_numel(self) -> int:
        return self.world * self.shard_numel

    @property
    def numel(self) -> int:
        """Ψ of the unit: real elements, no padding."""
        return sum(p.numel for p in self.params)


def make_layout(named_shapes: Sequence[tuple[str, torch.Size, bool]], world: int) -> FlatLayout:
    """Build the layout for ``(fqn, shape, requires_grad)`` triples, in order.

    Raises:
        ValueError: if ``world`` < 1.
    """
    if world < 1:
        raise ValueError(f"shard group size must be >= 1, got {world}")
    params, offset, grad_offset = [], 0, 0
    for fqn, shape, requires_grad in named_shapes:
        shape = torch.Size(shape)
        rows = shape[0] if len(shape) > 0 else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        chunk_rows = math.ceil(rows / world) if rows else 0
        layout = ParamLayout(fqn, shape, rows, row_numel, chunk_rows, offset,
                             grad_offset if requires_grad else -1, requires_grad)
        params.append(layout)
        offset += layout.shard_numel
        if requires_grad:
            grad_offset += layout.shard_numel
    return FlatLayout(tuple(params), world)


def shard_into(flat_shard: torch.Tensor, layout: FlatLayout,
               full: Sequence[torch.Tensor | Callable[[int, int], torch.Tensor]], rank: int) -> None:
    """Copy ``rank``'s chunk of each full tensor into ``flat_shard``; zero the padding.

    Args:
        flat_shard: 1-D tensor of ``layout.shard_numel`` elements.
        full: in layout order, each a full parameter or ``fn(row_start,
            row_end)`` returning just those rows (deferred init of a shard).
    """
    flat_shard.zero_()
    for p, t in zip(layout.params, full):
        lo, hi = p.local_row_range(rank)
        if hi > lo:
            rows = t(lo, hi) if callable(t) else t.detach().reshape(p.rows, p.row_numel)[lo:hi]
            flat_shard[p.shard_offset:p.shard_offset + (hi - lo) * p.row_numel].copy_(rows.reshape(-1))


def shard_views(flat_shard: torch.Tensor, layout: FlatLayout, rank: int) -> list[torch.Tensor]:
    """Views of ``flat_shard`` with each parameter's local (unpadded) shape."""
    views = []
    for p in layout.params:
        n = p.local_rows(rank) * p.row_numel
        views.append(flat_shard[p.shard_offset:p.shard_offset + n].view(p.local_shape(rank)))
    return views


def grad_shard_views(flat_grad: torch.Tensor, layout: FlatLayout, rank: int) -> list[torch.Tensor | None]:
    """Views of the flat gradient shard per parameter (None for frozen ones)."""
    views = []
    for p in layout.params:
        if not p.requires_grad:
            views.append(None)
            continue
        n = p.local_rows(rank) * p.row_numel
        views.append(flat_grad[p.grad_offset:p.grad_offset + n].view(p.local_shape(rank)))
    return views


def split_sizes(layout: FlatLayout) -> list[int]:
    """Sizes that cut the unsharded flat into [param_0, pad_0, param_1, pad_1, ...]."""
    sizes = []
    for p in layout.params:
        sizes += [p.numel, layout.world * p.shard_numel - p.numel]
    return sizes


def unsharded_views(flat_full: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Full-parameter views of the param-major unsharded flat.

    One ``split_with_sizes`` produces every view, so under autograd all their
    gradients meet in a single node and reach ``flat_full.grad`` in one
    accumulation (one post-accumulate-grad hook call per backward).
    """
    pieces = torch.split_with_sizes(flat_full, split_sizes(layout))
    return [pieces[2 * i].view(p.shape) for i, p in enumerate(layout.params)]


def _rank_major_blocks(buf: torch.Tensor, layout: FlatLayout, numel: int, grad: bool) -> list[torch.Tensor]:
    """(N, chunk) strided views of a rank-major buffer, one per parameter."""
    two_d = buf.view(layout.world, numel)
    out = []
    for p in layout.params:
        if grad and not p.requires_grad:
            continue
        off = p.grad_offset if grad else p.shard_offset
        out.append(two_d[:, off:off + p.shard_numel])
    return out


def _param_major_blocks(flat_full: torch.Tensor, layout: FlatLayout, grad: bool) -> list[torch.Tensor]:
    """(N, chunk) contiguous views of a param-major buffer, one per parameter."""
    out = []
    for p in layout.params:
        if grad and not p.requires_grad:
            continue
        start = layout.world * p.shard_offset
        out.append(flat_full[start:start + layout.world * p.shard_numel].view(layout.world, p.shard_numel))
    return out


def copy_out(flat_full: torch.Tensor, gathered: torch.Tensor, layout: FlatLayout) -> None:
    """All-gather output (rank-major, N·S) → unsharded flat (param-major, N·S)."""
    dst = _param_major_blocks(flat_full, layout, grad=False)
    src = _rank_major_blocks(gathered, layout, layout.shard_numel, grad=False)
    if dst:  # a unit without parameters (a root holding only nested units) moves nothing
        torch_private.foreach_copy_(dst, src)


def copy_in(reduce_in: torch.Tensor, full_grad: torch.Tensor, layout: FlatLayout,
            block_numel: int | None = None) -> None:
    """Unsharded flat gradient (param-major) → reduce-scatter input (rank-major,
    trainable parameters only). ``reduce_in`` holds N blocks of
    ``block_numel`` elements (default ``grad_shard_numel``); the gradient
    fills the first ``grad_shard_numel`` of each and the rest is untouched."""
    dst = _rank_major_blocks(reduce_in, layout, block_numel or layout.grad_shard_numel, grad=True)
    src = _param_major_blocks(full_grad, layout, grad=True)
    if dst:
        torch_private.foreach_copy_(dst, src)


def copy_rank_rows(dst: torch.Tensor, flat_full: torch.Tensor, layout: FlatLayout, first: int, count: int) -> None:
    """Ranks ``first .. first+count-1``'s flat shards, rank-major (``count·S``
    elements in ``dst``), taken from the unsharded flat (param-major): the
    part of an all-gather's output a post-forward group member keeps
    (``reshard_after_forward=int``), so that an all-gather of the members'
    parts rebuilds the whole output."""
    dst_blocks = _rank_major_blocks(dst, FlatLayout(layout.params, count), layout.shard_numel, grad=False)
    src = [b[first:first + count] for b in _param_major_blocks(flat_full, layout, grad=False)]
    if dst_blocks:
        torch_private.foreach_copy_(dst_blocks, src)
