"""The buffer pool: reuse, size rounding, the cache cap, and lending memory to
a storage that autograd-saved views keep referring to."""
import torch

from fullshard.core import buffers as B


def test_returned_buffer_is_reused_and_sizes_round_to_one_mib():
    pool = B.BufferPool()
    a = pool.take(3 << 18, torch.float32, torch.device("cpu"))  # 3 MiB
    x = pool.take(1 << 20, torch.float32, torch.device("cpu"))  # 4 MiB, in use beside it: both stay cached
    ptr = a.untyped_storage().data_ptr()
    pool.give(a)
    pool.give(x)
    # 3 MiB is a multiple of the granule; 8 bytes more round up to 4 MiB (another list).
    b = pool.take((3 << 18) + 2, torch.float32, torch.device("cpu"))
    assert b.untyped_storage().data_ptr() != ptr and b.untyped_storage().nbytes() == 4 << 20
    c = pool.take((3 << 18) - 5, torch.float32, torch.device("cpu"))
    assert c.untyped_storage().data_ptr() == ptr and c.numel() == (3 << 18) - 5
    assert pool.stats()["hits"] == 2 and pool.stats()["misses"] == 2
    small = pool.take(10, torch.bfloat16, torch.device("cpu"))
    assert small.untyped_storage().nbytes() == 20  # below 1 MiB: exact


def test_cache_is_capped_relative_to_largest_buffer():
    pool = B.BufferPool()
    bufs = [pool.take(1 << 18, torch.float32, torch.device("cpu")) for _ in range(B.CACHE_FACTOR + 3)]
    for t in bufs:
        pool.give(t)
    assert pool.cached_bytes == B.CACHE_FACTOR * (1 << 20)
    assert pool.stats()["in_use_bytes"] == 0
    assert pool.stats()["peak_in_use_bytes"] == (B.CACHE_FACTOR + 3) * (1 << 20)
    pool.clear()
    assert pool.cached_bytes == 0


def test_lend_and_reclaim_keep_the_storage_object():
    pool = B.BufferPool()
    flat = torch.empty(1000)
    flat.untyped_storage().resize_(0)
    pool.lend(flat.untyped_storage(), 4000)
    saved = flat[10:20].view(2, 5)  # as autograd saves a parameter view in forward
    flat.copy_(torch.arange(1000.0))
    assert torch.equal(saved, torch.arange(10.0, 20.0).view(2, 5))
    pool.reclaim(flat.untyped_storage())
    assert flat.untyped_storage().nbytes() == 0
    if not B._CAN_SWAP:  # torch before 2.12 (no UntypedStorage._swap_data_ptr_): resized, counted, not pooled
        assert pool.cached_bytes == 0 and pool.in_use_bytes == 0
        pool.lend(flat.untyped_storage(), 4000)
        assert pool.in_use_bytes == 4000
        flat.copy_(torch.arange(1000.0))
        assert torch.equal(saved, torch.arange(10.0, 20.0).view(2, 5))
        return
    assert pool.cached_bytes == 4000
    pool.lend(flat.untyped_storage(), 4000)  # the same memory comes back
    assert torch.equal(saved, torch.arange(10.0, 20.0).view(2, 5))
    assert pool.stats()["hits"] == 1


def test_resized_storages_are_counted_in_use_where_torch_cannot_swap(monkeypatch):
    """torch before 2.12: lend resizes from the allocator and reclaim frees; both count the bytes, so a
    buffer from take() that is reclaimed (an all-gather extension's output, core/extensions.py) leaves
    nothing counted in use."""
    monkeypatch.setattr(B, "_CAN_SWAP", False)
    pool = B.BufferPool()
    storage = pool.take(1 << 18, torch.float32, torch.device("cpu")).untyped_storage()  # 1 MiB
    assert pool.in_use_bytes == 1 << 20
    pool.reclaim(storage)
    assert storage.nbytes() == 0 and pool.in_use_bytes == 0 and pool.cached_bytes == 0
    assert pool.lend(storage, 3000) is None  # no event: the allocator's block may still be read
    assert storage.nbytes() == 3000 and pool.in_use_bytes == 3000
    pool.reclaim(storage)
    assert pool.in_use_bytes == 0 and pool.peak_in_use_bytes == 1 << 20


def test_footprint_never_exceeds_the_peak_in_use():
    """Buffers in use plus cached stay within the most ever in use at once:
    sizes used at different times share that budget (oldest evicted first)."""
    pool = B.BufferPool()
    mib = 1 << 18  # fp32 elements per MiB
    a = pool.take(4 * mib, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.cached_bytes == 4 << 20
    b = pool.take(2 * mib, torch.float32, torch.device("cpu"))  # another size: a miss
    assert pool.stats()["misses"] == 2 and pool.stats()["peak_in_use_bytes"] == 4 << 20
    # 2 MiB in use + 4 MiB cached would exceed the 4 MiB peak: the 4 MiB buffer went before b was allocated
    assert pool.cached_bytes == 0
    pool.give(b)
    assert pool.cached_bytes == 2 << 20
    c = pool.take(2 * mib, torch.float32, torch.device("cpu"))
    d = pool.take(2 * mib, torch.float32, torch.device("cpu"))
    assert pool.stats()["hits"] == 1 and pool.stats()["in_use_bytes"] == 4 << 20
    pool.give(c)
    pool.give(d)
    assert pool.cached_bytes == 4 << 20 == pool.stats()["peak_in_use_bytes"]
