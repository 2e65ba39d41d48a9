"""Single-process tests of the flat-layout math (``core/flat.py``): what an
all-gather of every rank's flat shard reassembles, what a reduce-scatter
input hands each rank, ``torch.chunk`` semantics, padding, and units whose
parameters have fewer rows than ranks."""
from __future__ import annotations

import itertools

import pytest
import torch

from fullshard.core import flat, placement, torch_private

PLACED = {
    "row": lambda n: [placement.RowShard()] * n,
    "block2": lambda n: [placement.BlockShard(2)] * n,
    "owned": lambda n: [placement.Owned()] * n,
    "mixed": lambda n: [(placement.Owned(), placement.BlockShard(3), placement.RowShard())[i % 3] for i in range(n)],
}


def _layout(params, world, kind, frozen=frozenset()):
    requested = PLACED[kind](len(params))
    placed = placement.assign_owners("u", requested, [p.numel() for p in params], world)
    return flat.make_layout([(f"p{i}", p.shape, i not in frozen) for i, p in enumerate(params)], world, placed)

SHAPES = [
    [(7, 3)],
    [(1,), (2, 2)],
    [(5, 4), (3,), (), (2, 3, 2)],
    [(0, 3), (4,)],  # an empty parameter
    [(1, 1), (1, 1), (9,)],  # fewer rows than ranks
]


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _flat_shards(params, layout):
    shards = []
    for r in range(layout.world):
        s = torch.full((layout.shard_numel,), float("nan"))
        flat.shard_into(s, layout, params, r)
        shards.append(s)
    return shards


# One case per placement kind; each walks every shape list at world sizes 1-5
# (a case per combination cost 200 pytest items for the same checks).
CASES = list(itertools.product(SHAPES, range(1, 6)))


@pytest.mark.parametrize("kind", PLACED)
def test_all_gather_round_trip(kind):
    for shapes, world in CASES:
        _check_round_trip(shapes, world, kind)


def _check_round_trip(shapes, world, kind):
    params = _params(shapes)
    layout = _layout(params, world, kind)
    shards = _flat_shards(params, layout)
    for r, s in enumerate(shards):
        assert not torch.isnan(s).any(), "padding must be zeroed"
        for p, lay, view in zip(params, layout.params, flat.shard_views(s, layout, r)):
            rows = p.reshape(lay.rows, lay.row_numel)
            lo, hi = lay.local_row_range(r)
            if kind == "row":  # torch.chunk semantics
                chunks = torch.chunk(rows, world, dim=0) if lay.rows else ()
                assert torch.equal(rows[lo:hi], chunks[r] if r < len(chunks) else rows[:0])
            elif isinstance(lay.placement, placement.Owned):
                assert (lo, hi) == ((0, lay.rows) if r == lay.placement.rank else (lo, lo))
            elif isinstance(lay.placement, placement.BlockShard):
                assert all(b % lay.placement.rows == 0 or b == lay.rows for b in (lo, hi))
            assert view.shape == lay.local_shape(r)
            assert torch.equal(view.reshape(-1), rows[lo:hi].reshape(-1)), (shapes, world, lay.fqn, r)
        assert sum(lay.local_rows(r) for r in range(world)) == lay.rows
    gathered = torch.cat(shards)  # what all_gather_into_tensor produces
    full = torch.full((layout.unsharded_numel,), float("nan"))
    flat.copy_out(full, gathered, layout)
    for p, v in zip(params, flat.unsharded_views(full, layout)):
        assert torch.equal(v, p)
    _check_one_rank_identity(params, gathered, layout)
    assert layout.numel == sum(p.numel() for p in params)
    assert layout.unsharded_numel == world * layout.shard_numel >= layout.numel


def _unfused(layout):
    """``layout`` with the fused copies turned off (per-parameter copies, the path of owned, strided
    and empty parameters)."""
    layout.__dict__["fused_sizes"] = ()
    return layout


def test_fused_copies_equal_per_parameter_copies():
    """copy_out (split_with_sizes_copy) and copy_in (chunk_cat, zeros after the gradient in a longer block;
    at one rank with every parameter trainable one copy) give the per-parameter copies' bits; so does
    chunk_cat's bf16 -> fp32 cast, which copy_in uses on CUDA only (its CUDA kernel runs in
    tests/dist/test_cuda.py)."""
    for (shapes, world), frozen in itertools.product(CASES, ({1}, set())):
        params = _params(shapes)
        fused, plain = (_layout(params, world, "row", frozen=frozen) for _ in range(2))
        assert bool(fused.fused_sizes) == (min(p.numel() for p in params) > 0)
        trainable = not frozen.intersection(range(len(params)))
        assert fused.grad_is_prefix == (world == 1 and bool(fused.fused_sizes) and trainable)  # one copy
        _unfused(plain)
        gathered = torch.cat(_flat_shards(params, fused))
        outs = [torch.full((fused.unsharded_numel,), float("nan")) for _ in range(2)]
        for out, lay in zip(outs, (fused, plain)):
            flat.copy_out(out, gathered, lay)
        assert torch.equal(outs[0], outs[1]), (shapes, world)
        block = fused.grad_shard_numel + 3
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.randn(fused.unsharded_numel).to(dtype)
            ins = [torch.full((world * block,), float("nan")) for _ in range(2)]
            for into, lay in zip(ins, (fused, plain)):
                flat.copy_in(into, full, lay, block_numel=block)
            grads = [x.view(world, block)[:, :fused.grad_shard_numel] for x in ins]
            assert torch.equal(grads[0], grads[1]), (shapes, world, dtype)
            if fused.fused_sizes and not fused.grad_is_prefix and dtype == torch.float32:
                assert not ins[0].view(world, block)[:, fused.grad_shard_numel:].any()  # zeros
            elif fused.fused_sizes:  # the op copy_in calls on CUDA, with its cast
                cast = torch.empty(world, fused.grad_shard_numel)
                torch_private.chunk_cat(flat._param_major_blocks(full, fused, grad=True), world, cast)
                assert torch.equal(cast, grads[1]), (shapes, world)


def _check_one_rank_identity(params, gathered, layout):
    """At one rank the flat shard is the unsharded flat: core/unit.py casts
    the shard straight into it, with no copy-out."""
    if layout.world == 1:
        assert layout.unsharded_numel == layout.shard_numel
        for p, v in zip(params, flat.unsharded_views(gathered, layout)):
            assert torch.equal(v, p)


@pytest.mark.parametrize("kind", PLACED)
def test_reduce_scatter_input(kind):
    """copy_in of each rank's full gradient, summed over ranks block by block,
    gives every rank the sum of its chunk (frozen parameters skipped)."""
    for shapes, world in CASES:
        _check_reduce_scatter_input(shapes, world, kind)


def _check_reduce_scatter_input(shapes, world, kind):
    params = _params(shapes)
    frozen = {1}
    layout = _layout(params, world, kind, frozen)
    grads = [_params(shapes, seed=10 + r) for r in range(world)]
    total = None
    for r in range(world):
        full = torch.zeros(layout.unsharded_numel)
        for v, g in zip(flat.unsharded_views(full, layout), grads[r]):
            v.copy_(g)
        reduce_in = torch.full((world * layout.grad_shard_numel,), float("nan"))
        flat.copy_in(reduce_in, full, layout)
        total = reduce_in if total is None else total + reduce_in
    for r in range(world):
        block = total.view(world, layout.grad_shard_numel)[r]
        for i, (lay, view) in enumerate(zip(layout.params, flat.grad_shard_views(block, layout, r))):
            if i in frozen:
                assert view is None
                continue
            want = sum(g[i] for g in grads).reshape(lay.rows, lay.row_numel)
            lo, hi = lay.local_row_range(r)
            assert torch.allclose(view.reshape(-1), want[lo:hi].reshape(-1)), (shapes, world, lay.fqn, r)


def test_unit_without_parameters():
    layout = flat.make_layout([], 3)
    assert layout.shard_numel == layout.unsharded_numel == layout.numel == 0
    flat.copy_out(torch.empty(0), torch.empty(0), layout)
    flat.copy_in(torch.empty(0), torch.empty(0), layout)
    assert flat.unsharded_views(torch.empty(0), layout) == []


def test_row_deferred_init():
    """``shard_into`` with ``fn(row_start, row_end, out)`` creates only the rank's rows, in ``out``, a
    view of the shard (no transient copy); a ``fn`` that returns new rows is copied in."""
    p = torch.arange(20.0).reshape(5, 4)
    layout = flat.make_layout([("w", p.shape, True)], 3)
    calls = []

    def into(lo, hi, out):
        calls.append((lo, hi, out.untyped_storage().data_ptr()))
        return out.copy_(p[lo:hi])

    for r in range(3):
        for fn in (into, lambda lo, hi, out: p[lo:hi].clone()):
            s = torch.full((layout.shard_numel,), float("nan"))
            flat.shard_into(s, layout, [fn], r)
            assert torch.equal(flat.shard_views(s, layout, r)[0], p[[0, 2, 4][r]:[2, 4, 5][r]])
            assert not torch.isnan(s).any()  # the padding is zeroed
            if fn is into:
                assert calls[-1][2] == s.untyped_storage().data_ptr()
    assert [c[:2] for c in calls] == [(0, 2), (2, 4), (4, 5)]


def test_rows_fn_passes_out_only_to_initializers_that_take_it():
    """``deferred_init.rows_fn``: ``out=`` reaches an ``init_rows`` that declares it (with the parameter's
    dtype); an older ``init_rows(param, lo, hi, device)`` gets no ``out`` and its rows are returned."""
    from fullshard.core import deferred_init

    param = torch.empty(4, 3, device="meta")
    seen = []

    class Into:
        def init_rows(self, param, lo, hi, device, out=None):
            seen.append(out)
            return out.fill_(lo) if out is not None else torch.full((hi - lo, 3), float(lo))

    class Old:
        def init_rows(self, param, lo, hi, device):
            return torch.full((hi - lo, 3), float(lo))

    out = torch.empty(2, 3)
    assert deferred_init.rows_fn(Into(), param, torch.device("cpu"))(2, 4, out) is out and seen == [out]
    assert torch.equal(out, torch.full((2, 3), 2.0))
    wrong_dtype = torch.empty(2, 3, dtype=torch.float64)  # not the parameter's: a new tensor instead
    got = deferred_init.rows_fn(Into(), param, torch.device("cpu"))(2, 4, wrong_dtype)
    assert got is not wrong_dtype and seen[-1] is None
    assert torch.equal(deferred_init.rows_fn(Old(), param, torch.device("cpu"))(1, 3, out), torch.full((2, 3), 1.0))


def test_bad_world_size():
    with pytest.raises(ValueError, match="shard group size must be >= 1"):
        flat.make_layout([("w", torch.Size((2,)), True)], 0)


DIM_SHAPES = [(3, 7), (4, 2, 5), (2, 1), (6, 0), (5, 9)]


def _dim_layout(world):
    """Mixed unit: Shard(1), Shard(-1) of a 3-D, a dim smaller than the world, an empty one, and a RowShard."""
    dims = [1, -1, 1, 1, 0]
    placed = [placement.normalize(type("Shard", (), {"dim": d})(), f"p{i}", len(s))
              for i, (d, s) in enumerate(zip(dims, DIM_SHAPES))]
    assert placed[1] == placement.DimShard(2) and placed[4] == placement.RowShard()
    return flat.make_layout([(f"p{i}", torch.Size(s), i != 2) for i, s in enumerate(DIM_SHAPES)], world, placed)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_dim_shard_layout(world):
    """DimShard: each rank's view is torch.chunk(p, N, dim=d)[r], contiguous; the all-gather
    output copies out to the params; copy_in hands each rank its chunk of the summed
    gradient with zeroed padding; copy_rank_rows parts rebuild the all-gather output."""
    params = _params(DIM_SHAPES)
    layout = _dim_layout(world)
    shards = _flat_shards(params, layout)
    for r, s in enumerate(shards):
        assert not torch.isnan(s).any()
        for p, lay, view in zip(params, layout.params, flat.shard_views(s, layout, r)):
            chunks = torch.chunk(p, world, dim=lay.dim) if p.numel() or p.shape[lay.dim] else ()
            want = chunks[r] if r < len(chunks) else p.narrow(lay.dim, 0, 0)
            assert view.shape == want.shape and view.is_contiguous() and torch.equal(view, want), (lay.fqn, r)
    gathered = torch.cat(shards)
    full = torch.full((layout.unsharded_numel,), float("nan"))
    flat.copy_out(full, gathered, layout)
    for p, v in zip(params, flat.unsharded_views(full, layout)):
        assert torch.equal(v, p)
    _check_one_rank_identity(params, gathered, layout)
    for k in [k for k in range(1, world + 1) if world % k == 0]:
        parts = []
        for first in range(0, world, k):
            part = torch.full((k * layout.shard_numel,), float("nan"))
            flat.copy_rank_rows(part, full, layout, first, k)
            parts.append(part)
        assert torch.equal(torch.cat(parts), gathered), k
    grads = [_params(DIM_SHAPES, seed=10 + r) for r in range(world)]
    total = 0
    for r in range(world):
        fg = torch.zeros(layout.unsharded_numel)
        for v, g in zip(flat.unsharded_views(fg, layout), grads[r]):
            v.copy_(g)
        reduce_in = torch.full((world * layout.grad_shard_numel,), float("nan"))
        flat.copy_in(reduce_in, fg, layout)
        assert not torch.isnan(reduce_in).any()
        total = total + reduce_in
    for r in range(world):
        block = total.view(world, layout.grad_shard_numel)[r]
        for i, (lay, view) in enumerate(zip(layout.params, flat.grad_shard_views(block, layout, r))):
            if i == 2:
                assert view is None
                continue
            want = sum(g[i] for g in grads)
            lo, hi = lay.local_row_range(r)
            assert torch.allclose(view, want.narrow(lay.dim, lo, hi - lo)), (lay.fqn, r)


def test_shard_dim_out_of_range():
    shard = type("Shard", (), {"dim": 2})()
    with pytest.raises(ValueError, match=r"Shard\(2\) for 'w', which has 2 dimension"):
        placement.normalize(shard, "w", 2)


def test_dim_shard_row_initializer():
    """``shard_into`` with ``fn(row_start, row_end, out)`` (dim-0 rows) for a DimShard slot keeps the chunk of dim d."""
    p = torch.arange(15.0).reshape(3, 5)
    layout = flat.make_layout([("w", p.shape, True)], 2, [placement.DimShard(1)])
    for r, want in enumerate(torch.chunk(p, 2, dim=1)):
        s = torch.full((layout.shard_numel,), float("nan"))
        flat.shard_into(s, layout, [lambda lo, hi, out: p[lo:hi]], r)
        assert torch.equal(flat.shard_views(s, layout, r)[0], want) and not torch.isnan(s).any()
    with pytest.raises(ValueError, match=r"needs 0 < dim < 2"):
        flat.make_layout([("w", p.shape, True)], 2, [placement.DimShard(2)])
