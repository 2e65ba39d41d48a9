"""all_gather and reduce_scatter give the same result with gloo's native
collectives and with the all-to-all variants (core/collectives.py [Note:
collective algorithms]), at odd sizes, 3 ranks, fp32 and bf16; pooled
buffers are all returned."""
from __future__ import annotations

import os

import torch

from fullshard.core import collectives as C
from fullshard.core.buffers import POOL
from tests.dist.harness import run_ranks


def _check(rank, world):
    group = C.world_group()
    results = {}
    for algo in ("native", "all_to_all"):
        os.environ["FULLSHARD_COLLECTIVES"] = algo
        assert C.algorithm(group, torch.device("cpu")) == algo
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (1, 7, 1 << 18):  # 1 MiB+ blocks come from the pool's rounded lists
                g = torch.Generator().manual_seed(100 * rank + numel)
                shard = torch.randn(numel, generator=g).to(dtype)
                gathered = torch.empty(world * numel, dtype=dtype)
                C.all_gather(gathered, shard, group, async_op=True, tag="test").wait()
                full = torch.randn(world * numel, generator=g).to(dtype)
                out = torch.empty(numel, dtype=dtype)
                C.reduce_scatter(out, full, group, async_op=False, tag="test")
                results[(algo, dtype, numel)] = (gathered, out)
        assert POOL.stats()["in_use_bytes"] == 0
    del os.environ["FULLSHARD_COLLECTIVES"]
    for (algo, dtype, numel), (gathered, out) in results.items():
        if algo == "native":
            continue
        ref_gathered, ref_out = results[("native", dtype, numel)]
        assert torch.equal(gathered, ref_gathered), (dtype, numel)
        # Sums of 3 terms may be added in another order (and, in bf16, rounded
        # once instead of twice): equal up to a rounding or two.
        tol = 2e-6 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    # The expected values, independently: rank r's shard is block r of the gather.
    for dtype in (torch.float32,):
        gathered = results[("all_to_all", dtype, 7)][0]
        for r in range(world):
            g = torch.Generator().manual_seed(100 * r + 7)
            assert torch.equal(gathered[7 * r:7 * (r + 1)], torch.randn(7, generator=g).to(dtype))
    return True


def test_all_to_all_variants_match_native_collectives():
    assert all(run_ranks(_check, 3))


def test_unknown_algorithm_is_refused(monkeypatch):
    monkeypatch.setenv("FULLSHARD_COLLECTIVES", "ring")
    try:
        C.algorithm(None, torch.device("cpu"))
    except ValueError as e:
        assert "FULLSHARD_COLLECTIVES='ring'" in str(e)
    else:
        raise AssertionError("expected ValueError")
