"""Pure sharding math for one unit: dim-0 chunking, padding, flat offsets,
copy-out of an all-gather and copy-in for a reduce-scatter. No
``torch.distributed`` here.

[Note: flat layouts]
A unit with parameters p_0..p_k and a shard group of N ranks uses two layouts
of the same padded elements:

* rank-major (what travels): rank r's *flat shard* is the concatenation over
  the row- and block-sharded p_i of their chunk r, each padded to
  ``chunk_rows_i`` rows. For :class:`RowShard` chunks follow
  ``torch.chunk(p_i, N, dim=0)``: ``chunk_rows_i = ceil(rows_i / N)``, so
  trailing ranks may own fewer (even zero) real rows; :class:`BlockShard`
  rounds the chunk up to whole blocks. These slots sit at the same offsets
  on every rank (``uniform_numel`` elements). The parameters each rank owns
  (:class:`Owned`) follow, packed, on that rank only. Every rank's flat shard
  is padded to the same numel S (the largest rank's), which is what
  all-gather and reduce-scatter need.
* param-major (what modules see): the *unsharded flat* holds each row- or
  block-sharded parameter contiguously at ``full_offset = N · shard_offset``
  followed by its padding rows, then the owned parameters back to back, so
  every full parameter is a zero-copy view.

All-gather output (N, S) → param-major is a per-parameter transpose of
blocks (``copy_out``); the reverse for gradients is ``copy_in``.

A :class:`DimShard` parameter (dim d != 0) takes a ``RowShard`` slot whose
"rows" are slices of dim d (``rows = shape[d]``, ``row_numel = numel /
shape[d]``): rank r's slot holds ``torch.chunk(p, N, dim=d)[r]``
contiguously (its local tensor, a view) and then padding. Its param-major
region holds the parameter contiguously, then the padding of all N slots,
so the full view is still zero-copy. The copies between the two are
strided instead of block transposes: the ranks with whole chunks move as one
copy into ``p.unflatten(d, (k, chunk)).movedim(d, 0)``, the one rank with a
partial chunk as a second; slot padding is skipped on the way out and
zeroed on the way in (:func:`_strided_pairs`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import torch

from . import placement as placements, torch_private


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one original parameter sits in a unit's flat buffers.

    Attributes:
        fqn: original (unwrapped) name of the parameter's first occurrence.
        shape: full shape of the parameter.
        rows: ``shape[0]`` (1 for a 0-dim parameter); ``shape[d]`` for
            :class:`DimShard` (d).
        row_numel: elements per dim-0 row, ``prod(shape[1:])``; per slice of
            dim d for ``DimShard``.
        chunk_rows: rows of this parameter's slot on a rank that holds it:
            ``ceil(rows / N)`` for :class:`RowShard`, whole blocks for
            :class:`BlockShard`, all rows (on the owner only) for :class:`Owned`.
        shard_offset: element offset of the slot in a flat shard (the owner's
            for an ``Owned`` parameter; the same on every rank otherwise).
        grad_offset: the same in the flat gradient shard (trainable
            parameters only; -1 for frozen ones).
        requires_grad: whether the original parameter is trained.
        placement: the resolved placement (``core/placement.py``).
        bounds: rank r keeps rows ``[bounds[r], bounds[r + 1])``.
        full_offset: start of the parameter's region in the unsharded flat.
        full_span: elements of that region (the parameter, then padding).
    """

    fqn: str
    shape: torch.Size
    rows: int
    row_numel: int
    chunk_rows: int
    shard_offset: int
    grad_offset: int
    requires_grad: bool
    placement: placements.Placement = placements.RowShard()
    bounds: tuple = ()
    full_offset: int = 0
    full_span: int = 0

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def owned(self) -> bool:
        """Whether one rank holds all rows (the slot exists on that rank only)."""
        return isinstance(self.placement, placements.Owned)

    @property
    def dim(self) -> int:
        """The sharded dimension: 0, or d for :class:`DimShard`."""
        return placements.shard_dim(self.placement)

    @property
    def strided(self) -> bool:
        """Whether the layouts' copies are strided (a :class:`DimShard`), not block transposes."""
        return self.dim != 0

    @property
    def shard_numel(self) -> int:
        """Padded elements of the slot on a rank that holds it."""
        return self.chunk_rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Real (unpadded) rows that ``rank`` keeps."""
        return self.bounds[rank + 1] - self.bounds[rank]

    def local_shape(self, rank: int) -> torch.Size:
        """Shape of ``rank``'s shard: ``(local_rows, *shape[1:])`` (``shape``
        with ``local_rows`` at dim d for ``DimShard``); 1-D for scalars."""
        return self.chunk_shape(self.local_rows(rank))

    def chunk_shape(self, rows: int) -> torch.Size:
        """``shape`` with ``rows`` slices of the sharded dimension."""
        d = self.dim
        return torch.Size((*self.shape[:d], rows, *self.shape[d + 1:]))

    def local_row_range(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """All parameter layouts of one unit for a shard group of ``world`` ranks.

    Attributes:
        params: one :class:`ParamLayout` per parameter, in unit order.
        world: N, the shard-group size.
        shard_numel: S, elements in each rank's flat shard (padding included).
        grad_shard_numel: elements in each rank's flat gradient shard
            (trainable parameters only).
        uniform_numel: elements of the row- and block-sharded slots, which
            sit at the same offsets on every rank; owned parameters follow.
        uniform_grad_numel: the same in the flat gradient shard.
    """

    params: tuple[ParamLayout, ...]
    world: int
    shard_numel: int = 0
    grad_shard_numel: int = 0
    uniform_numel: int = 0
    uniform_grad_numel: int = 0

    @property
    def unsharded_numel(self) -> int:
        return self.world * self.shard_numel

    @property
    def numel(self) -> int:
        """Ψ of the unit: real elements, no padding."""
        return sum(p.numel for p in self.params)

    def rank_numel(self, rank: int) -> int:
        """Real (unpadded) elements ``rank`` keeps."""
        return sum(p.local_rows(rank) * p.row_numel for p in self.params)

    # Python integers derived once per layout (layouts are immutable): the
    # copy-in / copy-out of every all-gather and reduce-scatter reads them,
    # and recomputing them per call was host time on the forward's critical
    # path (a GPU waits on it).
    @functools.cached_property
    def memory_order(self) -> tuple[int, ...]:
        """Parameter indices in the order of their regions in the unsharded flat."""
        return tuple(sorted(range(len(self.params)), key=lambda i: self.params[i].full_offset))

    @functools.cached_property
    def split_sizes(self) -> tuple[int, ...]:
        """Sizes that cut the unsharded flat into [param, pad, param, pad, ...,
        tail] in memory order (see :func:`unsharded_views`)."""
        sizes, end = [], 0
        for i in self.memory_order:
            p = self.params[i]
            sizes += [p.numel, p.full_span - p.numel]
            end = p.full_offset + p.full_span
        return tuple(sizes + [self.unsharded_numel - end])

    @functools.cached_property
    def fused_sizes(self) -> tuple[int, ...]:
        """The slots' numels when no parameter is owned, strided or empty (each copy between the layouts
        is then one fused op: :func:`copy_out`, :func:`copy_in`); () otherwise."""
        fused = all(not p.owned and not p.strided and p.shard_numel for p in self.params)
        return tuple(p.shard_numel for p in self.params) if fused else ()

    @functools.cached_property
    def all_trainable(self) -> bool:
        return all(p.requires_grad for p in self.params)

    @functools.cached_property
    def grad_is_prefix(self) -> bool:
        """One rank, fused and all trainable: a reduce block's gradient is the unsharded gradient's first
        ``grad_shard_numel`` elements (both layouts are one), so :func:`copy_in` is one copy."""
        return self.world == 1 and bool(self.fused_sizes) and self.all_trainable

    def block_plan(self, grad: bool) -> tuple[tuple[int, int, int, int, int], ...]:
        """Per non-strided parameter (trainable ones only with ``grad``): its
        offset and length in a rank's block of a rank-major buffer, the owner
        rank (-1 unless owned), and its region (offset, span) in the
        param-major unsharded flat; see :func:`_rank_major_blocks`."""
        return self._grad_plan if grad else self._shard_plan

    def local_plan(self, rank: int, grad: bool) -> tuple[tuple, ...]:
        """Per parameter: its offset in ``rank``'s flat shard (flat gradient
        shard with ``grad``; None for a frozen parameter there), its local
        numel and local shape; see :func:`shard_views`."""
        key = (rank, grad)
        plan = self._local_plans.get(key)
        if plan is None:
            plan = self._local_plans[key] = tuple(
                (None if grad and not p.requires_grad else p.grad_offset if grad else p.shard_offset,
                 p.local_rows(rank) * p.row_numel, p.local_shape(rank)) for p in self.params)
        return plan

    @functools.cached_property
    def _local_plans(self) -> dict:
        return {}

    @functools.cached_property
    def _shard_plan(self) -> tuple:
        return _block_plan(self, grad=False)

    @functools.cached_property
    def _grad_plan(self) -> tuple:
        return _block_plan(self, grad=True)


def _block_plan(layout: FlatLayout, grad: bool) -> tuple:
    plan = []
    for p in layout.params:
        if (grad and not p.requires_grad) or p.strided:
            continue
        off = p.grad_offset if grad else p.shard_offset
        if p.owned:
            plan.append((off, p.numel, p.placement.rank, p.full_offset, p.full_span))
        else:
            plan.append((off, p.shard_numel, -1, p.full_offset, p.full_span))
    return tuple(plan)


def make_layout(named_shapes: Sequence[tuple[str, torch.Size, bool]], world: int,
                placed: Optional[Sequence[placements.Placement]] = None) -> FlatLayout:
    """Build the layout for ``(fqn, shape, requires_grad)`` triples, in order.

    Args:
        placed: one resolved placement per parameter (an ``Owned`` with its
            rank; default :class:`RowShard` for all). See [Note: flat layouts].

    Raises:
        ValueError: if ``world`` < 1, or an ``Owned`` rank is unresolved or >= ``world``.
    """
    if world < 1:
        raise ValueError(f"shard group size must be >= 1, got {world}")
    placed = list(placed) if placed is not None else [placements.RowShard()] * len(named_shapes)
    shapes = []
    for (fqn, shape, requires_grad), pl in zip(named_shapes, placed):
        shape = torch.Size(shape)
        d = placements.shard_dim(pl)
        if d and not 0 < d < len(shape):
            raise ValueError(f"parameter '{fqn}': {pl} needs 0 < dim < {len(shape)} (its dimensions)")
        rows = shape[d] if len(shape) > 0 else 1
        row_numel = math.prod(shape[:d]) * math.prod(shape[d + 1:]) if len(shape) > 1 else 1
        if isinstance(pl, placements.Owned) and (pl.rank is None or pl.rank >= world):
            raise ValueError(f"parameter '{fqn}': Owned(rank={pl.rank}) needs a resolved rank below {world}")
        shapes.append((fqn, shape, requires_grad, pl, rows, row_numel))
    # Row- and block-sharded slots first, at the same offsets on every rank.
    fields: dict[int, dict] = {}
    offset = grad_offset = full = 0
    for i, (_, _, rg, pl, rows, row_numel) in enumerate(shapes):
        if isinstance(pl, placements.Owned):
            continue
        chunk = placements.chunk_rows(pl, rows, world)
        fields[i] = dict(chunk_rows=chunk, shard_offset=offset, grad_offset=grad_offset if rg else -1,
                         bounds=placements.row_bounds(pl, rows, world), full_offset=full,
                         full_span=world * chunk * row_numel)
        offset += chunk * row_numel
        full += world * chunk * row_numel
        grad_offset += chunk * row_numel if rg else 0
    uniform, uniform_grad = offset, grad_offset
    # Owned parameters packed on their owner after them; the unsharded flat
    # holds them contiguously after the uniform regions.
    used, used_grad = [uniform] * world, [uniform_grad] * world
    for i, (_, _, rg, pl, rows, row_numel) in enumerate(shapes):
        if not isinstance(pl, placements.Owned):
            continue
        n = rows * row_numel
        fields[i] = dict(chunk_rows=rows, shard_offset=used[pl.rank],
                         grad_offset=used_grad[pl.rank] if rg else -1,
                         bounds=placements.row_bounds(pl, rows, world), full_offset=full, full_span=n)
        used[pl.rank] += n
        used_grad[pl.rank] += n if rg else 0
        full += n
    params = tuple(ParamLayout(fqn, shape, rows, row_numel, requires_grad=rg, placement=pl, **fields[i])
                   for i, (fqn, shape, rg, pl, rows, row_numel) in enumerate(shapes))
    return FlatLayout(params, world, max(used), max(used_grad), uniform, uniform_grad)


def shard_into(flat_shard: torch.Tensor, layout: FlatLayout,
               full: Sequence[torch.Tensor | Callable[[int, int], torch.Tensor]], rank: int) -> None:
    """Copy ``rank``'s chunk of each full tensor into ``flat_shard``; zero the padding.

    Args:
        flat_shard: 1-D tensor of ``layout.shard_numel`` elements.
        full: in layout order, each a full parameter or ``fn(row_start,
            row_end, out)`` returning just those rows (deferred init of a shard;
            written into ``out``, a view of ``flat_shard``, where it can).
    """
    flat_shard.zero_()
    for p, t in zip(layout.params, full):
        lo, hi = p.local_row_range(rank)
        if hi <= lo:
            continue
        dst = flat_shard[p.shard_offset:p.shard_offset + (hi - lo) * p.row_numel]
        if p.strided:  # a row initializer gives dim-0 rows: take them all, keep the chunk of dim d
            whole = t(0, p.shape[0], None) if callable(t) else t.detach()
            dst.view(p.local_shape(rank)).copy_(whole.reshape(p.shape).narrow(p.dim, lo, hi - lo))
        elif callable(t):
            out = dst.view(hi - lo, *p.shape[1:])
            rows = t(lo, hi, out)
            if rows is not out:
                out.copy_(rows)
        else:
            dst.copy_(t.detach().reshape(p.rows, p.row_numel)[lo:hi].reshape(-1))


def shard_views(flat_shard: torch.Tensor, layout: FlatLayout, rank: int) -> list[torch.Tensor]:
    """Views of ``flat_shard`` with each parameter's local (unpadded) shape."""
    return [flat_shard[o:o + n].view(shape) for o, n, shape in layout.local_plan(rank, grad=False)]


def grad_shard_views(flat_grad: torch.Tensor, layout: FlatLayout, rank: int) -> list[torch.Tensor | None]:
    """Views of the flat gradient shard per parameter (None for frozen ones)."""
    return [None if o is None else flat_grad[o:o + n].view(shape)
            for o, n, shape in layout.local_plan(rank, grad=True)]


def unsharded_views(flat_full: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Full-parameter views of the param-major unsharded flat, in layout order.

    One ``split_with_sizes`` produces every view, so under autograd all their
    gradients meet in a single node and reach ``flat_full.grad`` in one
    accumulation (one post-accumulate-grad hook call per backward).
    """
    pieces = torch.split_with_sizes(flat_full, layout.split_sizes)
    views: list = [None] * len(layout.params)
    params = layout.params
    for k, i in enumerate(layout.memory_order):
        views[i] = pieces[2 * k].view(params[i].shape)
    return views


def _rank_major_blocks(buf: torch.Tensor, layout: FlatLayout, numel: int, grad: bool) -> list[torch.Tensor]:
    """Views of a rank-major buffer (N blocks of ``numel``), one per
    parameter: (N, chunk) strided for a row- or block-sharded one, the
    owner's whole slot for an owned one."""
    two_d = buf.view(layout.world, numel)
    return [two_d[r, off:off + n] if r >= 0 else two_d[:, off:off + n]
            for off, n, r, _, _ in layout.block_plan(grad)]


def _param_major_blocks(flat_full: torch.Tensor, layout: FlatLayout, grad: bool) -> list[torch.Tensor]:
    """The matching views of a param-major buffer: (N, chunk) contiguous, or the owned parameter itself."""
    world = layout.world
    return [flat_full[fo:fo + span] if r >= 0 else flat_full[fo:fo + span].view(world, n)
            for _, n, r, fo, span in layout.block_plan(grad)]


def _owned_tails(buf: torch.Tensor, layout: FlatLayout, numel: int, grad: bool) -> list[torch.Tensor]:
    """Each rank's elements of a rank-major buffer past its owned slots (up
    to ``grad_shard_numel`` or ``shard_numel``): what no parameter fills."""
    if not any(p.owned for p in layout.params):
        return []
    two_d = buf.view(layout.world, numel)
    base = layout.uniform_grad_numel if grad else layout.uniform_numel
    end = layout.grad_shard_numel if grad else layout.shard_numel
    used = [base] * layout.world
    for p in layout.params:
        if p.owned and (p.requires_grad or not grad):
            used[p.placement.rank] += p.numel
    return [two_d[r, used[r]:end] for r in range(layout.world) if used[r] < end]


def _strided_pairs(buf: torch.Tensor, flat_full: torch.Tensor, layout: FlatLayout, numel: int, grad: bool,
                   first: int = 0, count: Optional[int] = None) -> tuple[list, list, list]:
    """For each :class:`DimShard` parameter (trainable ones if ``grad``) and
    ranks ``first .. first+count-1`` (default all) of a rank-major buffer
    (``count`` blocks of ``numel``): matching rank-major and param-major
    views, and the slot padding of those ranks (see [Note: flat layouts]).

    Returns:
        ``(rank-major views, param-major views, padding views)``.
    """
    count = layout.world if count is None else count
    two_d = buf.view(count, numel)
    rank_side, param_side, pads = [], [], []
    for p in layout.params:
        if not p.strided or (grad and not p.requires_grad) or p.chunk_rows == 0:
            continue
        off = p.grad_offset if grad else p.shard_offset
        c, d, sn = p.chunk_rows, p.dim, p.shard_numel
        whole = flat_full[p.full_offset:p.full_offset + p.numel].view(p.shape)
        k = min(p.rows // c, first + count)  # ranks below k hold whole chunks
        if k > first:
            n = k - first
            rank_side.append(two_d[:n, off:off + sn].view(n, *p.chunk_shape(c)))
            param_side.append(whole.narrow(d, first * c, n * c).unflatten(d, (n, c)).movedim(d, 0))
        for r in range(max(k, first), first + count):
            rr = p.local_rows(r)
            if rr:  # the one rank with a partial chunk
                rank_side.append(two_d[r - first, off:off + rr * p.row_numel].view(p.local_shape(r)))
                param_side.append(whole.narrow(d, p.bounds[r], rr))
                pads.append(two_d[r - first, off + rr * p.row_numel:off + sn])
            else:  # the rest hold nothing
                pads.append(two_d[r - first:, off:off + sn])
                break
    return rank_side, param_side, pads


def copy_out(flat_full: torch.Tensor, gathered: torch.Tensor, layout: FlatLayout) -> None:
    """All-gather output (rank-major, N·S, contiguous) → unsharded flat (param-major, N·S)."""
    dst = _param_major_blocks(flat_full, layout, grad=False)
    if layout.fused_sizes:  # one op; on CUDA one kernel (torch FSDP2's copy-out), not one per parameter
        torch.split_with_sizes_copy(gathered.view(layout.world, layout.shard_numel), layout.fused_sizes, dim=1,
                                    out=dst)
        return
    src = _rank_major_blocks(gathered, layout, layout.shard_numel, grad=False)
    strided_src, strided_dst, _ = _strided_pairs(gathered, flat_full, layout, layout.shard_numel, grad=False)
    dst, src = dst + strided_dst, src + strided_src
    if dst:  # a unit without parameters (a root holding only nested units) moves nothing
        torch_private.foreach_copy_(dst, src)


def copy_in(reduce_in: torch.Tensor, full_grad: torch.Tensor, layout: FlatLayout,
            block_numel: int | None = None) -> None:
    """Unsharded flat gradient (param-major) → reduce-scatter input (rank-major, trainable parameters only).
    ``reduce_in`` holds N blocks of ``block_numel`` elements (default ``grad_shard_numel``); the gradient
    (padding included, zero where no parameter lies) fills the first ``grad_shard_numel`` of each; the
    rest is left for the caller (it may be zeroed)."""
    block = block_numel or layout.grad_shard_numel
    if layout.grad_is_prefix:  # one elementwise copy: on an H200 faster than chunk_cat (see docs/benchmarks.md)
        reduce_in[:layout.grad_shard_numel].copy_(full_grad[:layout.grad_shard_numel])
        return
    # One op (on CUDA one kernel, casting bf16 → fp32 too: torch FSDP2's copy-in); a CPU cast is faster per tensor.
    if layout.fused_sizes and layout.grad_shard_numel and (full_grad.dtype == reduce_in.dtype or (
            reduce_in.is_cuda and (full_grad.dtype, reduce_in.dtype) == (torch.bfloat16, torch.float32))):
        src = _param_major_blocks(full_grad, layout, grad=True)
        if block > layout.grad_shard_numel:  # zeros for the row's rest: the output rows are whole blocks
            src.append(_zeros(layout.world, block - layout.grad_shard_numel, full_grad))
        torch_private.chunk_cat(src, layout.world, reduce_in.view(layout.world, block))
        return
    dst = _rank_major_blocks(reduce_in, layout, block, grad=True)
    src = _param_major_blocks(full_grad, layout, grad=True)
    strided_dst, strided_src, pads = _strided_pairs(reduce_in, full_grad, layout, block, grad=True)
    dst, src = dst + strided_dst, src + strided_src
    if dst:
        torch_private.foreach_copy_(dst, src)
    tails = _owned_tails(reduce_in, layout, block, grad=True) + pads
    if tails:
        torch_private.foreach_zero_(tails)


_ZEROS: dict = {}  # (rows, cols, dtype, device) -> a zero tensor, only ever read


def _zeros(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    key = (rows, cols, like.dtype, like.device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(rows, cols, dtype=like.dtype, device=like.device)
    return _ZEROS[key]


def copy_rank_rows(dst: torch.Tensor, flat_full: torch.Tensor, layout: FlatLayout, first: int, count: int) -> None:
    """Ranks ``first .. first+count-1``'s flat shards, rank-major (``count·S`` elements in ``dst``), taken from
    the unsharded flat (param-major): the part of an all-gather's output a post-forward group member keeps
    (``reshard_after_forward=int``), so that an all-gather of the members' parts rebuilds the whole output."""
    rows = dst.view(count, layout.shard_numel)
    dst_blocks, src, pads = _strided_pairs(dst, flat_full, layout, layout.shard_numel, False, first, count)
    if pads:  # nobody reads them; zero for the same bits as an all-gather of shards
        torch_private.foreach_zero_(pads)
    uniform = [p for p in layout.params if not p.strided]
    for p, block in zip(uniform, _param_major_blocks(flat_full, layout, grad=False)):
        if not p.owned:
            dst_blocks.append(rows[:, p.shard_offset:p.shard_offset + p.shard_numel])
            src.append(block[first:first + count])
        elif first <= p.placement.rank < first + count:
            dst_blocks.append(rows[p.placement.rank - first, p.shard_offset:p.shard_offset + p.numel])
            src.append(block)
    if dst_blocks:
        torch_private.foreach_copy_(dst_blocks, src)


def contiguous_stride(shape: torch.Size) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    return torch.empty(shape, device="meta").stride()
