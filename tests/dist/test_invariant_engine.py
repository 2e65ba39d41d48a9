"""``world_size_invariant=True`` in the engine: both front doors train a GPT with dropout,
clipping and AdamW to the same bits at world sizes 1, 2, 3 and 4, under FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD (2 x 2) and fully_shard (1-D and 2-D meshes), with
gradients reduced every micro-batch or accumulated under no_sync; and the exact norm sum is
independent of how elements are split."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard import (
    BlockShard,
    CPUOffload,
    FSDPModule,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    Owned,
    ShardingStrategy,
    fully_shard,
)
from fullshard.construct import clean_name
from fullshard.core import collectives, invariant
from fullshard.models import TransformerBlock, build_model
from fullshard.train.sharding import no_sync
from fullshard.wrap import ModuleWrapPolicy
from tests.dist.harness import run_ranks

VOCAB, T, B = 97, 16, 2
MICRO = 12  # global micro-batches per update: divisible by 1, 2, 3 and 4
UPDATES = 2
TOKENS = torch.Generator().manual_seed(7)
DATA = torch.randint(0, VOCAB, (UPDATES, MICRO, B, T + 1), generator=TOKENS)


def _model():
    return build_model("transformer_lm_gpt_mini", vocab_size=VOCAB, max_positions=T, dropout=0.1, seed=3)


def _shard(how: str, world: int):
    base = _model()
    if how == "owned":  # whole matrices on one rank (core/placement.py): the same fold, the same bits
        return FSDP(base, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), world_size_invariant=True,
                    shard_placement_fn=lambda p: Owned() if p.dim() == 2 else BlockShard(2))
    if how in ("full", "grad_op", "no_shard", "bf16_offload"):
        strategy = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP,
                    "no_shard": ShardingStrategy.NO_SHARD}.get(how, ShardingStrategy.FULL_SHARD)
        extra = dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                     cpu_offload=CPUOffload(offload_params=True)) if how == "bf16_offload" else {}
        return FSDP(base, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                    world_size_invariant=True, **extra)
    if how == "hybrid":
        shards = [collectives.new_group([0, 1]), collectives.new_group([2, 3])]
        reps = [collectives.new_group([0, 2]), collectives.new_group([1, 3])]
        rank = collectives.rank()
        groups = (shards[rank // 2], reps[rank % 2])
        return FSDP(base, sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups,
                    auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), world_size_invariant=True)
    mesh = init_device_mesh("cpu", (2, world // 2)) if how == "fully_shard_2d" else None
    for block in base.layers:
        fully_shard(block, mesh=mesh, world_size_invariant=True)
    return fully_shard(base, mesh=mesh, world_size_invariant=True)


def _full_params(model) -> dict:
    if isinstance(model, FSDPModule):
        named = {n: p.full_tensor() for n, p in model.named_parameters()}
    elif isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            named = {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    else:
        named = dict(model.named_parameters())
    return {name: named[name].detach().numpy().copy() for name in sorted(named)}


def _digest(params: dict) -> str:
    digest = hashlib.sha256()
    for name, value in params.items():
        digest.update(name.encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _train(how: str, rank: int, world: int, accumulate: str = "reduce") -> dict:
    model = _model() if how == "plain" else _shard(how, world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    history = []
    for update in range(UPDATES):
        local = MICRO // world
        for j in range(local):
            m = j * world + rank  # the global micro-batch this rank computes
            torch.manual_seed(1000 * update + m)  # dropout keyed by the global micro-batch
            tok = DATA[update, m]
            sync = accumulate == "reduce" or j == local - 1
            ctx = no_sync(model) if not sync else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
            with ctx:
                logits = model(tok[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1),
                                                         reduction="sum")
                (loss / (MICRO * B * T)).backward()
        if how == "plain":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif isinstance(model, FSDPModule):
            norm = fullshard.clip_grad_norm_(model.parameters(), 0.05)
        else:
            norm = model.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(repr(float(norm)))
    params = _full_params(model)
    return dict(history=history, digest=_digest(params), params=params if how in ("plain", "full") else None)


def _runs(rank, world, cases):
    return {name: _train(how, rank, world, accumulate) for name, (how, accumulate) in cases.items()
            if how not in ("hybrid", "fully_shard_2d") or world == 4}


CASES = {
    "full": ("full", "reduce"),
    "full_no_sync": ("full", "no_sync"),
    "owned_no_sync": ("owned", "no_sync"),
    "grad_op": ("grad_op", "reduce"),
    "no_shard": ("no_shard", "reduce"),
    "hybrid": ("hybrid", "reduce"),
    "fully_shard": ("fully_shard", "reduce"),
    "fully_shard_no_sync": ("fully_shard", "no_sync"),
    "fully_shard_2d": ("fully_shard_2d", "reduce"),
    "bf16_offload": ("bf16_offload", "no_sync"),  # bitwise among bf16 runs
}


def test_same_bits_at_world_sizes_one_to_four():
    results = {world: run_ranks(_runs, world, CASES, timeout_s=300)[0] for world in (1, 2, 3, 4)}
    reference = results[1]["full"]
    assert len(set(reference["history"])) == UPDATES  # the norms are real values that changed
    # ... and the right ones: one process accumulating .grad over the 12 micro-batches in order.
    plain = _train("plain", 0, 1)
    for (a, b) in zip(plain["history"], reference["history"]):
        assert abs(float(a) - float(b)) <= 1e-6 * float(a)
    for name, value in plain["params"].items():
        np.testing.assert_allclose(reference["params"][name], value, rtol=0, atol=1e-6, err_msg=name)
    bf16 = results[1]["bf16_offload"]
    assert bf16["digest"] != reference["digest"]
    for world, runs in results.items():
        for name, run in runs.items():
            if name == "bf16_offload":
                assert (run["history"], run["digest"]) == (bf16["history"], bf16["digest"]), f"bf16 at {world}"
                continue
            assert run["history"] == reference["history"], f"{name} at {world} ranks: gradient norms differ"
            assert run["digest"] == reference["digest"], f"{name} at {world} ranks: parameters differ"
    assert set(results[4]) == set(CASES)


def _exact_sums(rank, world):
    gen = torch.Generator().manual_seed(5)
    values = torch.rand(1001, generator=gen, dtype=torch.float64) ** 8 * 1e3
    cuts = np.linspace(0, values.numel(), world + 1).astype(int)
    mine = values[cuts[rank]:cuts[rank + 1]]
    return invariant.exact_sum(mine, [collectives.world_group()]), float(values.sum()), \
        invariant.exact_sum(torch.zeros(0, dtype=torch.float64) if rank else torch.tensor([float("nan")]),
                            [collectives.world_group()])


@pytest.mark.fast
def test_exact_sum_does_not_depend_on_the_split():
    sums = [run_ranks(_exact_sums, world, timeout_s=120) for world in (1, 3)]
    one, three = sums[0][0], sums[1]
    assert all(s[0] == one[0] for s in three)
    assert abs(one[0] - one[1]) <= 1e-12 * one[1]
    assert all(np.isnan(s[2]) for s in three)  # a nan on one rank is not lost by the MAX reduction


def _kept_unsharded():
    """fully_shard over the world, unsharded after the first forward: no all-gather after it, so the folds
    are the only collectives of a backward."""
    base = _model()
    for block in base.layers:
        fully_shard(block, world_size_invariant=True, reshard_after_forward=False)
    model = fully_shard(base, world_size_invariant=True, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    return model


def _bad_uses(rank, world):
    errors = []
    own = [collectives.new_group([0]), collectives.new_group([1])][rank]
    try:
        # Replicas on a sub-group (the wrappers' own checks refuse such groups first).
        from fullshard.core import invariant
        invariant.check_layout(own, own, "unit 'GPT'")
    except ValueError as e:
        errors.append(str(e))
    mesh = init_device_mesh("cpu", (2, 1))
    model = fully_shard(_model(), mesh=mesh, world_size_invariant=True)
    model.set_requires_all_reduce(False)
    try:
        model(DATA[0, rank][:, :-1]).sum().backward()
    except RuntimeError as e:
        errors.append(str(e))
    # no_sync windows of different lengths: identical blocks, whose folds would pair up across units
    # unnoticed. Rank 1 runs one no_sync backward fewer (2 and 1; then 1 and 0, the wrapper).
    for how, fewer in (("kept", 2), ("no_shard", 2), ("no_shard", 1)):
        model = _kept_unsharded() if how == "kept" else _shard(how, world)
        for _ in range(fewer - rank):
            with no_sync(model):
                model(DATA[0, rank][:, :-1]).sum().backward()
        try:
            model(DATA[0, rank][:, :-1]).sum().backward()
        except RuntimeError as e:
            errors.append(str(e))
    return errors


@pytest.mark.fast
def test_layouts_it_cannot_order_are_refused_with_one_line():
    for rank, errors in enumerate(run_ranks(_bad_uses, 2, timeout_s=60)):
        assert len(errors) == 5, errors
        assert "world_size_invariant=True with replicas needs the unit's ranks to be the whole world (shard " \
               "group 1 x replicas 1 != world size 2)" in errors[0]
        assert errors[1].startswith(f"[rank {rank}] unit ") and \
            "set_requires_all_reduce(False) cannot be used with world_size_invariant=True" in errors[1]
        for error, mine in zip(errors[2:], (2 - rank, 2 - rank, 1 - rank)):
            assert error.startswith(f"[rank {rank}] unit ") and "\n" not in error, error
            assert f"world_size_invariant=True with no_sync: ranks ran different numbers of backwards since the " \
                f"last synchronizing backward (this rank: {mine})" in error, error
