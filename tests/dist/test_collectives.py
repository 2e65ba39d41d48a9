"""all_gather and reduce_scatter give the same result with gloo's native
collectives and with the all-to-all variants (core/algorithms.py [Note:
collective algorithms]), at odd sizes, 3 ranks, fp32 and bf16; pooled
buffers are all returned."""
from __future__ import annotations

import os

import pytest
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


@pytest.mark.fast
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


def _pooled_full_grad(rank, world):
    """A unit's full gradient lives in a pooled buffer that autograd adopts as
    ``flat_full.grad`` (no copy) and that returns to the pool once the
    reduce-scatter input is written (core/grads.py [Note: pooled full
    gradient]); with ``no_sync`` the stash keeps it and the pool stops
    counting it. Gradients still equal DDP's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fullshard import FullyShardedDataParallel as FSDP, MixedPrecision, memory_stats
    from fullshard.models import TransformerBlock
    from fullshard.wrap import ModuleWrapPolicy
    from tests.dist.models import batch, loss_fn, make_model

    forgotten = []
    real_forget = POOL.forget
    POOL.forget = lambda nbytes, ptr=None: (forgotten.append(nbytes), real_forget(nbytes, ptr))
    try:
        for mp in (None, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            model = FSDP(make_model("gpt"), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                         mixed_precision=mp)
            units = [m._runtime.unit for m in model.modules() if isinstance(m, FSDP)]
            assert len(units) == 3

            def held(field):
                stats = memory_stats(model)
                return [e[field] for name, e in stats.items() if name != "pool"]
            ref = DDP(make_model("gpt"))
            for step in range(3):
                x, y = batch("gpt", rank, step)
                hits = POOL.stats()["hits"]
                loss_fn("gpt", model, x, y).backward()
                loss_fn("gpt", ref, x, y).backward()
                assert memory_stats(model)["pool"]["in_use_bytes"] == 0 and POOL.stats()["hits"] > hits
                assert held("full_grad_bytes") == [0, 0, 0]
                assert forgotten == [], "autograd copied the pooled gradient instead of adopting it"
                got = {n: p.grad for n, p in model.named_parameters()}
                with model.summon_full_params(model, with_grads=True):
                    got = {n: p.grad.clone() for n, p in model.named_parameters()}
                tol = dict(rtol=0, atol=0) if mp is None else dict(rtol=0.05, atol=2e-3)
                for n, p in ref.module.named_parameters():
                    torch.testing.assert_close(got[n], p.grad, **tol, msg=f"{mp} step {step} {n}")
                model.zero_grad()
                ref.zero_grad()
            with model.no_sync():
                loss_fn("gpt", model, *batch("gpt", rank, 9)).backward()
            # fp32: the stash adopts the pooled buffer (no cast), which leaves the pool's count.
            assert len(forgotten) == (len(units) if mp is None else 0), forgotten
            assert memory_stats(model)["pool"]["in_use_bytes"] == 0
            assert all(held("stashed_grad_bytes")) and held("full_grad_bytes") == [0, 0, 0]
            loss_fn("gpt", model, *batch("gpt", rank, 10)).backward()
            assert memory_stats(model)["pool"]["in_use_bytes"] == 0 and held("stashed_grad_bytes") == [0, 0, 0]
            forgotten.clear()
    finally:
        POOL.forget = real_forget
    return "ok"


def test_pooled_full_gradient():
    assert run_ranks(_pooled_full_grad, 2) == ["ok", "ok"]
