"""`fullshard train --fsdp-version 1|2`: the trainer's FullyShardedDataParallel path and its
fully_shard path give the same per-update losses, gradient norms and parameters, bit for bit, under
every flag the trainer maps (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, no_sync and reduce-scatter
accumulation, clipping, bf16, fp16 loss scaling, activation checkpointing, CPU offload with the
fused CPU AdamW), and NO_SHARD's 2-D mesh equals the wrapper's NO_SHARD. ``--cpu-offload --optimizer
cpu_adam`` (OffloadAdamW: units stepped during backward, redone when --clip-norm clips) also equals
the fused AdamW stepped after backward, bit for bit."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from fullshard.construct import clean_name
from fullshard.models import ARCHS
from fullshard.train.config import TrainConfig
from tests.dist.harness import run_ranks

ARCH = "transformer_lm_gpt_mini"
VOCAB, T, B = 97, 16, 2
UPDATES = 3


def _cfg(**over) -> TrainConfig:
    base = dict(data_dir="unused", arch=ARCH, max_positions=ARCHS[ARCH].max_positions, vocab_size=VOCAB,
                tokens_per_sample=T, batch_size=B, lr=3e-3, weight_decay=0.01, clip_norm=0.05, seed=3,
                fp16_scale_window=4)
    return TrainConfig(**{**base, **over})


def _micro_batches(rank: int, update: int, k: int) -> list:
    g = torch.Generator().manual_seed(1000 * update + 10 * rank)
    out = []
    for _ in range(k):
        tok = torch.randint(0, VOCAB, (B, T + 1), generator=g)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def _local_params(model) -> dict:
    """This rank's shard of each parameter by original name (both versions shard the same rows), as
    numpy arrays (pickled by value: tensors would travel as file descriptors of exited ranks)."""
    return {clean_name(n): (p.to_local() if hasattr(p, "to_local") else p).detach().float().numpy().copy()
            for n, p in model.named_parameters()}


def _train(cfg: TrainConfig, rank: int) -> dict:
    from fullshard.train.trainer import Trainer

    trainer = Trainer(cfg, torch.device("cpu"))
    history = []
    for update in range(UPDATES):
        out = trainer.train_step(_micro_batches(rank, update, cfg.update_freq))
        history.append((out["loss_sum"], out["gnorm"], out["overflow"], out["loss_scale"]))
    opt = trainer.optimizer
    overlap = (opt.unit_steps_in_backward, opt.redone_steps) if hasattr(opt, "redone_steps") else None
    return dict(history=history, params=_local_params(trainer.model), num_updates=trainer.num_updates,
                overlap=overlap)


CASES = {
    "full_no_sync_clip": dict(update_freq=2),
    "grad_op_reduce_scatter": dict(reshard_after_forward=False, update_freq=2, accumulate_mode="reduce_scatter"),
    "bf16_checkpoint_activations": dict(bf16=True, checkpoint_activations=True),
    "fp16_loss_scale": dict(fp16=True, fp16_init_scale=2.0 ** 18),
    "cpu_offload_fused_adam": dict(cpu_offload=True, optimizer="cpu_adam", clip_norm=0.0),
    "cpu_offload_fused_adam_clip": dict(cpu_offload=True, optimizer="cpu_adam", update_freq=2),
}


def _compare_versions(rank, world, cases):
    # The loss scaler must unscale DTensor gradients through their local shards, not through
    # DTensor's implicit replication of its (1,) flag tensors (which warns, and was how it ran).
    warnings.filterwarnings("error", message="Found a non-scalar tensor")
    out = {}
    from fullshard.train import optimizers

    for name in cases:
        runs = [_train(_cfg(fsdp_version=v, **CASES[name]), rank) for v in (1, 2)]
        if CASES[name].get("optimizer") == "cpu_adam":  # and today's fused AdamW after backward
            overlaps, optimizers.overlaps = optimizers.overlaps, lambda *_: False
            try:
                runs.append(_train(_cfg(fsdp_version=2, **CASES[name]), rank))
            finally:
                optimizers.overlaps = overlaps
        out[name] = runs
    return out


def _assert_same(name, runs):
    one = runs[0]
    exact = lambda history: [tuple(map(repr, h)) for h in history]  # noqa: E731  (nan == nan, bit for bit)
    for i, two in enumerate(runs[1:], 1):
        assert exact(two["history"]) == exact(one["history"]), \
            f"{name}: run {i}: per-update (loss, gnorm, overflow, scale) differ"
        assert one["params"].keys() == two["params"].keys()
        for key, value in one["params"].items():
            assert np.array_equal(value, two["params"][key]), f"{name}: run {i}: parameter {key} differs"


@pytest.mark.fast
def test_versions_match_bitwise_at_two_ranks():
    ranks = run_ranks(_compare_versions, 2, list(CASES), timeout_s=300)
    for rank_out in ranks:
        for name, runs in rank_out.items():
            _assert_same(name, runs)
            assert runs[0]["num_updates"] == UPDATES or name == "fp16_loss_scale"
    # fp16 at 2**18 overflows first, backs off and skips those updates on both versions alike.
    overflows = [h[2] for h in ranks[0]["fp16_loss_scale"][0]["history"]]
    assert overflows[0] and not overflows[-1]
    # Clipping acted: every clipped update's norm is above --clip-norm.
    for name in ("full_no_sync_clip", "cpu_offload_fused_adam_clip"):
        assert all(h[1] > 0.05 for h in ranks[0][name][0]["history"]), name
    # cpu_adam: both versions stepped every unit during backward (3 units, 3 updates); with --clip-norm
    # every update redid its steps, without it none; the run after backward had no OffloadAdamW.
    for name, redone in (("cpu_offload_fused_adam", 0), ("cpu_offload_fused_adam_clip", UPDATES)):
        assert [r["overlap"] for r in ranks[0][name]] == [(3 * UPDATES, redone)] * 2 + [None], name


def _hybrid(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks
    return [_train(_cfg(fsdp_version=v, hybrid_shard=True), rank) for v in (1, 2)]


def test_hybrid_shard_versions_match_bitwise_at_four_ranks():
    for runs in run_ranks(_hybrid, 4, timeout_s=300):
        _assert_same("hybrid_shard", runs)


def _no_shard(rank, world):
    """The wrapper's NO_SHARD against fully_shard on device_mesh(NO_SHARD) = a (world, 1) mesh."""
    from fullshard import FullyShardedDataParallel, ShardingStrategy, fully_shard
    from fullshard.models import TransformerBlock, build_model
    from fullshard.train.sharding import device_mesh
    from fullshard.wrap import ModuleWrapPolicy

    results = []
    for version in (1, 2):
        model = build_model(ARCH, vocab_size=VOCAB, max_positions=T, device="cpu", seed=5)
        if version == 1:
            model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.NO_SHARD,
                                             auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        else:
            mesh = device_mesh(ShardingStrategy.NO_SHARD, "cpu")
            assert mesh.shape == (world, 1)
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x, y = _micro_batches(rank, step, 1)[0]
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.item(),))
        results.append(dict(history=losses, params=_local_params(model)))
    return results


@pytest.mark.fast
def test_no_shard_mesh_matches_the_wrappers_no_shard():
    for runs in run_ranks(_no_shard, 2, timeout_s=120):
        _assert_same("no_shard", runs)
        assert all(v.shape == runs[0]["params"][k].shape for k, v in runs[1]["params"].items())


def _resume(rank, world, root, pairs):
    """For each (saving, loading) version pair: train 2 updates under the first, save with
    fullshard.checkpoint, load into a fresh trainer of the second and take one more update on
    both: the same loss, norm and parameters."""
    from fullshard import checkpoint
    from fullshard.train.trainer import Trainer

    out = {}
    for versions in pairs:
        saved, loaded = (Trainer(_cfg(fsdp_version=v), torch.device("cpu")) for v in versions)
        for update in range(2):
            saved.train_step(_micro_batches(rank, update, 1))
        ckpt = os.path.join(root, f"v{versions[0]}_to_v{versions[1]}")
        checkpoint.save(ckpt, saved.model, saved.optimizer)
        checkpoint.load(ckpt, loaded.model, loaded.optimizer)
        steps = [t.train_step(_micro_batches(rank, 2, 1)) for t in (saved, loaded)]
        out[versions] = [dict(history=[(o["loss_sum"], o["gnorm"])], params=_local_params(t.model))
                         for o, t in zip(steps, (saved, loaded))]
    return out


@pytest.mark.fast
def test_optimizer_state_resumes_across_versions_at_one_and_two_ranks(tmp_path):
    """fully_shard's AdamW state (DTensors) saves and loads through fullshard.checkpoint at one rank
    (where a shard's shape is the parameter's) and two, from and into either version."""
    for world in (1, 2):
        root = tmp_path / f"world{world}"
        root.mkdir()
        for rank_out in run_ranks(_resume, world, str(root), [(2, 2), (1, 2), (2, 1)], timeout_s=120):
            for versions, runs in rank_out.items():
                _assert_same(f"{world} ranks, v{versions[0]} -> v{versions[1]}", runs)
