"""Deterministic sharded batch sampling for data-parallel training.

`ShardedBatchSampler` cuts an epoch into each rank's batches; `GlobalBatchSampler` cuts it into
global micro-batches with world-size-independent indices, for world-size-invariant training.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

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
        order = epoch_order(self.num_items, self.seed, self.epoch, self.shuffle)
        global_batch = self.batch_size * self.world_size
        total = len(self) * global_batch
        if total > self.num_items:  # drop_last=False: wrap around to fill the last batch
            order = order.repeat(-(-total // self.num_items))
        order = order[:total].tolist()
        for start in range(0, total, global_batch):
            begin = start + self.rank * self.batch_size
            yield order[begin:begin + self.batch_size]


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's order of the items, the same on every rank and at every world size.

    Returns:
        (num_items,) int64: a permutation from a ``torch.Generator`` seeded with ``seed + epoch``,
        or ``arange`` when not ``shuffle``.
    """
    if not shuffle:
        return torch.arange(num_items)
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_items, generator=gen)


def global_micro_batch(update: int, step: int, rank: int, world_size: int, micro_batches_per_update: int) -> int:
    """Index in its epoch of the global micro-batch that ``rank`` computes as its ``step``-th
    micro-batch of ``update``: ``update * N + step * world_size + rank`` (N = micro_batches_per_update).

    Ranks take an update's N global micro-batches interleaved (rank r: r, r + W, r + 2W, ...): the
    order in which the world-size-invariant engine folds each micro-batch's gradient. The update's
    N indices are the same set at every world size dividing N.

    Raises:
        ValueError: ``world_size`` not dividing N, or ``rank`` / ``step`` out of range.
    """
    if world_size < 1 or micro_batches_per_update % world_size:
        raise ValueError(f"world size {world_size} does not divide the {micro_batches_per_update} micro-batches "
                         "of an update")
    if not 0 <= rank < world_size or not 0 <= step < micro_batches_per_update // world_size:
        raise ValueError(f"rank {rank} / step {step} out of range for world size {world_size} and "
                         f"{micro_batches_per_update} micro-batches per update")
    return update * micro_batches_per_update + step * world_size + rank


class GlobalBatchSampler:
    """Yields one rank's micro-batches of each update of one epoch, keyed by global index.

    The epoch's order (`epoch_order`) is cut into global micro-batches of ``batch_size`` items:
    micro-batch ``m`` is ``order[m * batch_size:(m + 1) * batch_size]``, whatever the world size.
    An update takes ``N = global_batch_size / batch_size`` consecutive ones; this rank computes
    those `global_micro_batch` assigns it. A trailing incomplete update (fewer than
    ``global_batch_size`` items left) is dropped, so every update has the same global batch.

    Which items a rank sees per micro-batch equals `ShardedBatchSampler`'s batches grouped by
    ``N / world_size``, except that this drops the incomplete last update.

    Args:
        num_items: dataset length.
        batch_size: items per micro-batch.
        global_batch_size: items per update over all ranks, a multiple of ``batch_size * world_size``.
        rank, world_size: this rank and the number of data-parallel ranks.
        seed, epoch: the epoch's permutation (`epoch_order`).

    Raises:
        ValueError: a size < 1, ``batch_size * world_size`` not dividing ``global_batch_size``,
            ``rank`` out of range, or fewer items than one global batch.
    """

    def __init__(self, num_items: int, batch_size: int, global_batch_size: int, rank: int, world_size: int,
                 seed: int, epoch: int) -> None:
        if min(num_items, batch_size, global_batch_size, world_size) < 1:
            raise ValueError(f"num_items, batch_size, global_batch_size and world_size must be >= 1, got "
                             f"{num_items}, {batch_size}, {global_batch_size}, {world_size}")
        if global_batch_size % (batch_size * world_size):
            raise ValueError(f"global batch {global_batch_size} is not divisible by batch size {batch_size} x "
                             f"{world_size} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if num_items < global_batch_size:
            raise ValueError(f"{num_items} items make no full global batch of {global_batch_size}; lower "
                             "--global-batch-size or add data")
        self.num_items, self.batch_size, self.global_batch_size = num_items, batch_size, global_batch_size
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch

    def __len__(self) -> int:
        """Updates in the epoch."""
        return self.num_items // self.global_batch_size

    def __iter__(self) -> Iterator[List[Tuple[int, List[int]]]]:
        """Per update, this rank's ``[(global micro-batch index, item indices), ...]`` in step order."""
        order = epoch_order(self.num_items, self.seed, self.epoch).tolist()
        per_update = self.global_batch_size // self.batch_size
        steps = per_update // self.world_size
        for update in range(len(self)):
            ids = [global_micro_batch(update, j, self.rank, self.world_size, per_update) for j in range(steps)]
            yield [(m, order[m * self.batch_size:(m + 1) * self.batch_size]) for m in ids]
