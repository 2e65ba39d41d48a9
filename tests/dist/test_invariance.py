"""`fullshard train --world-size-invariant`: the same configuration at 1, 2, 3 and 4 ranks gives
bitwise the same per-update losses and gradient norms, validation loss and full parameters, with
dropout and clipping, under FULL_SHARD (no_sync and reduce-scatter accumulation, both front doors,
activation checkpointing), SHARD_GRAD_OP, HYBRID_SHARD (1 x W, and 2 x 2 at four ranks), replication
(HYBRID_SHARD with one-rank shard groups, the engine's NO_SHARD: the trainer has no NO_SHARD flag),
--cpu-offload, and bf16 (bitwise among bf16 runs).

The training goes through the CLI's code paths: `loop.epoch_updates` (GlobalBatchSampler and the
micro-batch ids), `loop.collate`, `loop.valid_batches`, `TrainConfig.at_world_size` (the rank's
re-derivation of --update-freq from --global-batch-size) and `Trainer.train_step` / `valid_step`
(micro-batch keyed dropout, global loss normalization, gathered sums)."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from fullshard.models import ARCHS
from fullshard.train.config import TrainConfig
from tests.dist.common import Tokens as SyntheticTokens
from tests.dist.harness import run_ranks

ARCH = "transformer_lm_gpt_mini"
VOCAB, T, B = 97, 16, 1
GLOBAL_BATCH = 12  # micro-batches of one sequence: 12, 6, 4, 3 per rank at 1, 2, 3, 4 ranks
UPDATES = 3
TRAIN_ITEMS, VALID_ITEMS = 3 * GLOBAL_BATCH + 5, 7  # 5 left over: the incomplete 4th update is dropped
WORLDS = (1, 2, 3, 4)


def Tokens(n: int, seed: int):
    return SyntheticTokens(n, seed, VOCAB, T)


def _cfg(**over) -> TrainConfig:
    base = dict(data_dir="unused", arch=ARCH, max_positions=ARCHS[ARCH].max_positions, vocab_size=VOCAB,
                tokens_per_sample=T, batch_size=B, global_batch_size=GLOBAL_BATCH, world_size_invariant=True,
                dropout=0.1, clip_norm=0.05, lr=3e-3, weight_decay=0.01, seed=3, fp16_scale_window=4)
    return TrainConfig(**{**base, **over})


CASES = {
    "full_no_sync": dict(),
    "full_reduce_scatter_fully_shard_ckpt": dict(fsdp_version=2, accumulate_mode="reduce_scatter",
                                                 checkpoint_activations=True),
    "grad_op_reduce_scatter": dict(reshard_after_forward=False, accumulate_mode="reduce_scatter"),
    "cpu_offload": dict(cpu_offload=True),
    "bf16": dict(bf16=True),
    "hybrid": dict(hybrid_shard=True),  # shard groups of 2 ranks at 2 and 4 ranks (2 x 2), of W at 1 and 3
    "replicate": dict(hybrid_shard=True),  # shard groups of one rank: every rank holds everything
}
LOCAL_WORLD = {"hybrid": lambda world: 2 if world % 2 == 0 else world, "replicate": lambda world: 1}


def _param_digest(model) -> str:
    """sha256 of the full parameters (the full state dict, gathered; fp32 bytes by sorted name)."""
    state = model.state_dict()
    digest = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        digest.update(name.encode())
        digest.update(value.detach().cpu().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _train(cfg: TrainConfig, world: int) -> dict:
    from fullshard.train.loop import collate, epoch_updates, valid_batches
    from fullshard.train.trainer import Trainer

    cfg = cfg.at_world_size(world)  # what train_main does at rank start
    assert cfg.update_freq * world * B == GLOBAL_BATCH
    train, valid = Tokens(TRAIN_ITEMS, seed=11), Tokens(VALID_ITEMS, seed=12)
    trainer = Trainer(cfg, torch.device("cpu"))
    updates = epoch_updates(cfg, train, epoch=1)
    assert len(updates) == UPDATES  # the incomplete last update is dropped
    history = []
    for group in updates:
        out = trainer.train_step([collate(train, idx) for _, idx in group], [mid for mid, _ in group])
        history.append((repr(out["loss_sum"]), repr(out["gnorm"]), out["ntokens"], out["nsentences"]))
    valid_out = trainer.valid_step(valid_batches(cfg, valid))
    return dict(history=history, valid=(repr(valid_out["loss_sum"]), valid_out["ntokens"]),
                params=_param_digest(trainer.model))


def _run_cases(rank, world, names):
    out = {}
    for name in names:
        local = LOCAL_WORLD.get(name, lambda w: w)(world)
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        try:
            out[name] = _train(_cfg(**CASES[name]), world)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
    return out


def test_world_size_invariant_training_is_bitwise_the_same_at_1_2_3_4_ranks():
    results = {world: run_ranks(_run_cases, world, list(CASES), timeout_s=300) for world in WORLDS}
    for world, ranks in results.items():
        for rank_out in ranks[1:]:
            assert rank_out == ranks[0], f"{world} ranks: ranks disagree"
    one = results[1][0]
    for name in CASES:
        history = one[name]["history"]
        assert [h[2:] for h in history] == [(GLOBAL_BATCH * T, GLOBAL_BATCH)] * UPDATES
        assert all(float(h[1]) > 0.05 for h in history), f"{name}: clipping did not act"
        assert one[name]["valid"][1] == VALID_ITEMS * T
        for world in WORLDS[1:]:
            got = results[world][0][name]
            for key in ("history", "valid", "params"):
                assert got[key] == one[name][key], (f"{name}: {key} at {world} ranks differs from 1 rank:\n"
                                                    f"{got[key]}\n{one[name][key]}")
    # Every fp32 strategy is the same computation: one result for all of them.
    fp32 = [name for name in CASES if name != "bf16"]
    assert len({(repr(one[n]["history"]), one[n]["params"]) for n in fp32}) == 1, {n: one[n] for n in fp32}
    assert results[4][0]["hybrid"] == one["full_no_sync"]  # HYBRID_SHARD 2 x 2


def _start_at(rank, world):
    """What train_main does once the ranks know their world size (which under an elastic launch may
    differ from the launcher's): update_freq derived again, or one line naming the rank."""
    from fullshard.train.config import GlobalBatchError
    from fullshard.train.loop import _at_world_size

    launched = _cfg(batch_size=2, global_batch_size=8, update_freq=1)  # derived at 4 ranks
    started = _at_world_size(launched, world)
    try:
        _at_world_size(_cfg(batch_size=2, global_batch_size=6, update_freq=1), world)
        message = None
    except GlobalBatchError as e:
        message = str(e)
    return started.update_freq, message


@pytest.mark.fast
def test_ranks_derive_update_freq_at_the_world_size_they_start_with():
    for rank, (update_freq, message) in enumerate(run_ranks(_start_at, 2, timeout_s=120)):
        assert update_freq == 2
        assert message == (f"[rank {rank}] cannot start at world size 2: --global-batch-size 6 is not divisible by "
                           "--batch-size 2 x 2 ranks = 4; use a multiple of 4, or a --batch-size and number of ranks "
                           "whose product divides 6")
