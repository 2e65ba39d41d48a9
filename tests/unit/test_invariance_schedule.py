"""The single-process parts of --world-size-invariant and --global-batch-size: deriving
--update-freq, the global micro-batch schedule (each global micro-batch computed exactly once, the
same items at every world size), micro-batch keyed seeds, sums in global order, the flags."""
from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from fullshard.data import GlobalBatchSampler, ShardedBatchSampler, global_micro_batch
from fullshard.models import ARCHS
from fullshard.train import invariance
from fullshard.train.config import GlobalBatchError, TrainConfig, derive_update_freq
from fullshard.train.options import OneLineArgumentParser, add_train_args, resolve_batch


def test_derive_update_freq():
    assert derive_update_freq(16, 2, 4) == 2
    assert derive_update_freq(12, 1, 3) == 4
    assert derive_update_freq(8, 8, 1) == 1
    with pytest.raises(GlobalBatchError, match=r"^--global-batch-size 12 is not divisible by --batch-size 2 x 4 "
                                               r"ranks = 8; use a multiple of 8"):
        derive_update_freq(12, 2, 4)
    for bad in (0, -8):
        with pytest.raises(GlobalBatchError, match=rf"^--global-batch-size must be >= 1, got {bad}$"):
            derive_update_freq(bad, 2, 1)
    with pytest.raises(GlobalBatchError, match="must be >= 1"):
        derive_update_freq(8, 0, 1)
    with pytest.raises(ValueError):  # GlobalBatchError is a ValueError
        derive_update_freq(7, 2, 1)
    message = ""
    try:
        derive_update_freq(10, 4, 2)
    except GlobalBatchError as e:
        message = str(e)
    assert message and "\n" not in message


def _args(**over):
    base = dict(global_batch_size=None, update_freq=None, batch_size=2, world_size_invariant=False)
    return argparse.Namespace(**{**base, **over})


def test_resolve_batch_explicit_update_freq():
    """An explicit --update-freq equal to the derived one is accepted, another one is not; without
    --global-batch-size the invariant run records its global batch (so restarts keep it)."""
    assert resolve_batch(_args(), 4) == (1, None)
    assert resolve_batch(_args(update_freq=3), 4) == (3, None)
    assert resolve_batch(_args(update_freq=3, world_size_invariant=True), 4) == (3, 24)
    assert resolve_batch(_args(global_batch_size=16), 4) == (2, 16)
    assert resolve_batch(_args(global_batch_size=16, update_freq=2), 4) == (2, 16)
    with pytest.raises(GlobalBatchError, match=r"^--update-freq 1 conflicts with --global-batch-size 16, which gives "
                                               r"16 / \(--batch-size 2 x 4 ranks\) = 2 micro-batches"):
        resolve_batch(_args(global_batch_size=16, update_freq=1), 4)


def test_config_is_derived_again_at_the_ranks_world_size():
    cfg = TrainConfig(data_dir="d", arch="transformer_lm_gpt_mini", max_positions=ARCHS["transformer_lm_gpt_mini"]
                      .max_positions, vocab_size=97, batch_size=2, global_batch_size=16, update_freq=2,
                      world_size_invariant=True)
    assert cfg.at_world_size(4) is cfg
    assert cfg.at_world_size(2).update_freq == 4 and cfg.at_world_size(1).update_freq == 8
    with pytest.raises(GlobalBatchError, match="not divisible by --batch-size 2 x 3 ranks"):
        cfg.at_world_size(3)
    plain = TrainConfig(data_dir="d", max_positions=16, vocab_size=97)
    assert plain.update_freq == 1 and plain.at_world_size(3) is plain  # no global batch: nothing derived


def test_world_size_invariant_flag_is_negatable():
    p = OneLineArgumentParser(prog="fullshard train")
    add_train_args(p)
    assert p.parse_args(["D"]).world_size_invariant is False
    assert p.parse_args(["D", "--world-size-invariant"]).world_size_invariant is True
    assert p.parse_args(["D", "--world-size-invariant", "--no-world-size-invariant"]).world_size_invariant is False
    assert p.parse_args(["D", "--threads-per-rank", "3"]).threads_per_rank == 3


@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_global_micro_batch_is_computed_once_and_the_same_at_every_world_size(batch_size):
    n_per_update, updates = 12, 3
    items = updates * n_per_update * batch_size + 2 * batch_size + 1  # an incomplete 4th update
    by_world = {}
    for world in (1, 2, 3, 4):
        steps = n_per_update // world
        seen = {}  # global index -> (items, rank, update, step)
        for rank in range(world):
            sampler = GlobalBatchSampler(items, batch_size, n_per_update * batch_size, rank, world, seed=5, epoch=2)
            assert len(sampler) == updates  # the incomplete last update is dropped
            for u, update in enumerate(sampler):
                assert len(update) == steps
                for j, (m, indices) in enumerate(update):
                    expected = u * n_per_update + j * world + rank
                    assert m == global_micro_batch(u, j, rank, world, n_per_update) == expected
                    assert m not in seen and len(indices) == batch_size
                    seen[m] = (tuple(indices), u)
        assert sorted(seen) == list(range(updates * n_per_update))  # each exactly once
        assert all(u == m // n_per_update for m, (_, u) in seen.items())  # in its own update
        by_world[world] = {m: v[0] for m, v in seen.items()}
        # the same items as ShardedBatchSampler's batches (what the default path trains on)
        for rank in range(world):
            plain = list(ShardedBatchSampler(items, batch_size, rank, world, seed=5, epoch=2))
            for b, indices in enumerate(plain[:updates * steps]):
                assert tuple(indices) == by_world[world][b * world + rank]
    assert all(by_world[w] == by_world[1] for w in (2, 3, 4))
    flat = list(itertools.chain.from_iterable(by_world[1][m] for m in sorted(by_world[1])))
    assert len(set(flat)) == len(flat)  # no item twice in an epoch
    next_epoch = next(iter(GlobalBatchSampler(items, batch_size, n_per_update * batch_size, 0, 1, seed=5, epoch=3)))
    assert [tuple(indices) for _, indices in next_epoch] != [by_world[1][m] for m in range(n_per_update)]


def test_sampler_and_schedule_errors():
    with pytest.raises(ValueError, match="not divisible"):
        GlobalBatchSampler(100, 2, 12, 0, 4, seed=0, epoch=1)
    with pytest.raises(ValueError, match="no full global batch"):
        GlobalBatchSampler(11, 1, 12, 0, 2, seed=0, epoch=1)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        GlobalBatchSampler(100, 1, 12, 2, 2, seed=0, epoch=1)
    with pytest.raises(ValueError, match="does not divide"):
        global_micro_batch(0, 0, 0, 5, 12)
    invariance.check_schedule([(1, 13), (1, 15), (1, 17)], rank=1, world_size=2, micro_batches_per_update=6)
    for wrong in ([(1, 13), (1, 17), (1, 15)], [(1, 12), (1, 14), (1, 16)], [(1, 13), (1, 15)],
                  [(1, 13), (2, 15), (1, 17)], []):
        with pytest.raises(ValueError, match=r"^\[rank 1\] --world-size-invariant: this update's micro-batches"):
            invariance.check_schedule(wrong, rank=1, world_size=2, micro_batches_per_update=6)


def test_micro_batch_seeds_key_dropout_by_global_micro_batch():
    seeds = {invariance.micro_batch_seed(1, e, m) for e in (1, 2) for m in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert invariance.micro_batch_seed(1, 1, 7) == invariance.micro_batch_seed(1, 1, 7)
    assert invariance.micro_batch_seed(2, 1, 7) != invariance.micro_batch_seed(1, 1, 7)

    def mask(key):
        torch.manual_seed(1234)  # whatever came before
        torch.rand(5)
        invariance.seed_micro_batch(1, key)
        return torch.nn.functional.dropout(torch.ones(64), 0.5)

    assert torch.equal(mask((1, 7)), mask((1, 7)))
    assert not torch.equal(mask((1, 7)), mask((1, 8)))


def test_sums_in_global_order_are_the_same_for_every_split():
    """Rows whose sum depends on the order (large and small magnitudes): the interleaved sum of any
    split over 1..4 ranks equals the sum in global order; a rank-major sum would differ."""
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(12, 3, generator=gen, dtype=torch.float64) * torch.tensor([1e16, 1.0, 1e-3]).double()
            + torch.randn(12, 3, generator=gen, dtype=torch.float64))
    want = [0.0] * 3
    for row in rows.tolist():
        want = [w + v for w, v in zip(want, row)]
    rank_major_differs = False
    for world in (1, 2, 3, 4):
        k = 12 // world
        # rank r holds global rows r, r + W, ... in step order
        gathered = torch.stack([rows[r::world] for r in range(world)])
        assert gathered.shape == (world, k, 3)
        assert invariance.sum_interleaved(gathered) == want
        rank_major = [0.0] * 3
        for row in gathered.reshape(-1, 3).tolist():
            rank_major = [w + v for w, v in zip(rank_major, row)]
        rank_major_differs |= rank_major != want
    assert rank_major_differs  # the order matters for these rows
    # blocks of 2 rows (validation: a rank's batch of 2 sequences is one block)
    for world in (1, 2, 3):
        blocks = rows.view(6, 2, 3)
        gathered = torch.stack([blocks[r::world].reshape(-1, 3) for r in range(world)])
        assert invariance.sum_interleaved(gathered, block=2) == want
