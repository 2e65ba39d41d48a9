"""Parity with torch.nn.parallel.DistributedDataParallel: same init, different
data per rank, 10 AdamW steps with gradient clipping; per-step losses, the
gradient norm and the full parameters after training must match DDP's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import BackwardPrefetch, FullyShardedDataParallel as FSDP, ShardingStrategy
from fullshard.core import collectives
from tests.dist import models as M
from tests.dist.common import ATOL, RTOL, train
from tests.dist.harness import run_ranks


def _strategies(world):
    out = [(ShardingStrategy.FULL_SHARD, None), (ShardingStrategy.SHARD_GRAD_OP, None),
           (ShardingStrategy.NO_SHARD, None)]
    if world == 4:
        rank = dist.get_rank()
        shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        rep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        out.append((ShardingStrategy.HYBRID_SHARD, (shard_groups[rank // 2], rep_groups[rank % 2])))
    return out


def _parity(rank, world, kinds):
    worst, reduce_scatters = 0.0, []
    real = collectives.reduce_scatter
    collectives.reduce_scatter = lambda *a, **k: reduce_scatters.append(1) or real(*a, **k)
    for kind in kinds:
        base = M.make_model(kind)
        ref = DDP(M.clone(base))
        ref_losses, ref_norms = train(ref, kind, rank)
        ref_params = {n.removeprefix("module."): p.detach() for n, p in ref.named_parameters()}
        for strategy, pg in _strategies(world):
            for prefetch in (BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
                model = FSDP(M.clone(base), process_group=pg, sharding_strategy=strategy,
                             auto_wrap_policy=M.unit_policy(kind), backward_prefetch=prefetch)
                reduce_scatters.clear()
                losses, norms = train(model, kind, rank)
                where = f"{kind} {strategy.value} {prefetch.value} world={world}"
                if world == 1 and strategy != ShardingStrategy.NO_SHARD:
                    # One rank: the reduce input becomes the gradient shard, not copied (core/reduce.py).
                    assert not reduce_scatters, where
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                           rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} losses: {m}")
                torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms),
                                           rtol=1e-5, atol=ATOL, msg=lambda m: f"{where} grad norms: {m}")
                worst = max(worst, max(abs(a - b) for a, b in zip(losses, ref_losses)))
                with model.summon_full_params():
                    full = dict(model.named_parameters())
                    assert full.keys() == ref_params.keys(), (where, sorted(full), sorted(ref_params))
                    for n, p in full.items():
                        torch.testing.assert_close(p, ref_params[n], rtol=RTOL, atol=ATOL,
                                                   msg=lambda m: f"{where} param {n}: {m}")
    return worst


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.fast), 3, 4])
def test_parity_with_ddp(world):
    worst = run_ranks(_parity, world, ["mlp", "frozen", "gpt"])
    print(f"world={world}: largest per-step loss difference to DDP = {max(worst):.3e}")


def test_parity_with_ddp_native_collectives(monkeypatch):
    # gloo defaults to the all-to-all variants (core/algorithms.py [Note:
    # collective algorithms]); the native reduce-scatter and all-gather, which
    # NCCL uses, must give DDP's result too.
    monkeypatch.setenv("FULLSHARD_COLLECTIVES", "native")
    worst = run_ranks(_parity, 3, ["gpt"])
    print(f"native collectives, world=3: largest per-step loss difference to DDP = {max(worst):.3e}")
