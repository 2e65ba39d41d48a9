"""Deterministic sharded batch sampling for data-parallel training."""

from __future__ import annotations

from typing import Iterator

import torch


class ShardedBatchSampler:
    """Yields each rank's batches of dataset indices for one epoch.

    The epoch's order is a permutation from a ``torch.Generator`` seeded with
    ``seed + epoch`` (identity order if ``shuffle=False``), identical on every
    rank. It is cut into global batches of ``batch_size * world_size``
    indices; rank ``r`` takes the contiguous slice
    ``[r * batch_size, (r + 1) * batch_size)`` of each global batch, so ranks
    are disjoint and all get the same number of batches. With
    ``drop_last=True`` a trailing partial global batch is dropped; with
    ``drop_last=False`` it is completed by wrapping around to the start of the
    permutation (a few indices then appear twice, as with
    ``torch.utils.data.DistributedSampler``).

    Usable as ``DataLoader(dataset, batch_sampler=sampler)``.

    Args:
        num_items: Dataset length.
        batch_size: Items per rank per batch.
        rank: This rank, in [0, world_size).
        world_size: Number of data-parallel ranks N.
        seed: Base seed, the same on every rank.
        epoch: Epoch number (changes the permutation); see :meth:`set_epoch`.
        shuffle: Permute the items each epoch.
        drop_last: Drop a trailing partial global batch instead of padding it.

    Raises:
        ValueError: A non-positive size, ``rank`` out of range, or no full
            global batch while ``drop_last`` (num_items < batch_size * world_size).
    """

    def __init__(self, num_items: int, batch_size: int, rank: int, world_size: int,
                 seed: int, epoch: int, shuffle: bool = True, drop_last: bool = True) -> None:
        if num_items < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(f"num_items, batch_size and world_size must be >= 1, got "
                             f"{num_items}, {batch_size}, {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        global_batch = batch_size * world_size
        if drop_last and num_items < global_batch:
            raise ValueError(f"{num_items} items make no full global batch of {batch_size} x "
                             f"{world_size} ranks = {global_batch}; lower --batch-size or add data")
        self.num_items = num_items
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose permutation the next iteration uses."""
        self.epoch = epoch

    def __len__(self) -> int:
        global_batch = self.batch_size * self.world_size
        if self.drop_last:
            return self.num_items // global_batch
        return -(-self.num_items // global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_items, generator=gen)
        else:
            order = torch.arange(self.num_items)
        global_batch = self.batch_size * self.world_size
        total = len(self) * global_batch
        if total > self.num_items:  # drop_last=False: wrap around to fill the last batch
            order = order.repeat(-(-total // self.num_items))
        order = order[:total].tolist()
        for start in range(0, total, global_batch):
            begin = start + self.rank * self.batch_size
            yield order[begin:begin + self.batch_size]
