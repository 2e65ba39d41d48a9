"""The trainer's side of ``--world-size-invariant``: micro-batch keyed randomness, the update's
schedule check, and logged sums added in global micro-batch order.

[Note: world-size-invariant training]
With ``--world-size-invariant`` and a fixed ``--global-batch-size`` G, ``--batch-size`` B and
``--threads-per-rank``, a run gives bitwise the same per-update losses, gradient norms and
parameters at every world size W dividing G / B. What each piece does:

* Data: the epoch's permutation depends on (seed, epoch) only. Global micro-batch m of the epoch
  is ``order[m*B:(m+1)*B]``; update u is micro-batches ``u*N .. u*N+N-1`` (N = G / B), and rank
  r's j-th micro-batch of it is ``u*N + j*W + r`` (`fullshard.data.global_micro_batch`), the
  order in which the engine folds gradients. An incomplete last update of an epoch is dropped.
  The checkpoint position (epoch, updates into it) means the same samples at every W.
* Loss: each micro-batch's backward is on ``loss_sum / (B*T*N)`` (the global token count, the
  same float operation at every W) and the engine SUMS gradients over ranks
  (``world_size_invariant=True``: divide factor 1, folded in global micro-batch order).
* Randomness: before each micro-batch's forward the default generator (CPU, and every CUDA
  device) is seeded from (seed, epoch, m) (`micro_batch_seed`), so dropout masks do not depend on
  the rank or W. Activation checkpointing's recomputation replays that state
  (``preserve_rng_state=True``). Nothing else is restored: after a micro-batch the generator holds
  whatever its forward and backward left, and anything drawn outside a micro-batch's forward and
  backward (nothing in the trainer today) is not keyed.
* Logged sums: each rank's per-micro-batch (loss_sum, ntokens, nsentences) are all-gathered and
  added as Python floats in global micro-batch order; validation's per-sequence losses likewise
  in global sequence order.
* Gradient norm: ``sharding.clip_grad_norm_``, which the engine sums exactly on such a model.
* Threads: a CPU kernel's sums depend on its intra-op thread count, so the count is fixed
  (``--threads-per-rank``, default 1 under invariance on a CPU). On CUDA,
  ``torch.use_deterministic_algorithms(True)`` with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``.

Not invariant: a different ``--batch-size`` (micro-batch shapes change kernels' sums), thread
count, precision, seed, or dataset; and ``--update-freq`` without ``--global-batch-size`` fixes the
global batch at the world size the run was launched with.
"""
from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Sequence, Tuple

import torch

from fullshard.core import collectives
from fullshard.train.config import GlobalBatchError, derive_update_freq

MicroBatchId = Tuple[int, int]
"""(epoch, global micro-batch index within the epoch)."""


def micro_batch_seed(seed: int, epoch: int, index: int, stage: Optional[int] = None) -> int:
    """The generator seed of global micro-batch ``index`` of ``epoch``: the first 63 bits of
    SHA-256 over the three numbers (independent streams for neighbouring keys, unlike ``seed + i``);
    ``stage``: a pipeline stage's stream for that micro-batch (each stage's forward draws its own)."""
    text = f"fullshard micro-batch seed={seed} epoch={epoch} index={index}"
    if stage is not None:
        text += f" stage={stage}"
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_micro_batch(seed: int, micro_batch: MicroBatchId, stage: Optional[int] = None) -> None:
    """Seed torch's default CPU generator and every CUDA device's for ``micro_batch`` (of pipeline
    ``stage``, when given)."""
    torch.manual_seed(micro_batch_seed(seed, *micro_batch, stage=stage))


def check_schedule(ids: Sequence[MicroBatchId], rank: int, world_size: int, micro_batches_per_update: int) -> None:
    """Check that ``ids`` are this rank's micro-batches of one update in the order the engine folds
    gradients: ``(e, u*N + j*W + rank)`` for j = 0 .. N/W - 1, one epoch ``e``.

    Raises:
        ValueError: another count or order (one line naming the rank and what to pass).
    """
    steps = micro_batches_per_update // world_size
    first = ids[0][1] if ids else 0
    update = first // micro_batches_per_update
    want = [(ids[0][0] if ids else 0, update * micro_batches_per_update + j * world_size + rank) for j in range(steps)]
    if list(map(tuple, ids)) != want:
        raise ValueError(f"[rank {rank}] --world-size-invariant: this update's micro-batches are {list(ids)}; at "
                         f"world size {world_size} with {micro_batches_per_update} micro-batches per update this "
                         f"rank must compute {want} (fullshard.data.global_micro_batch); take them from "
                         "GlobalBatchSampler")


def gather_rows(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's ``local`` (K, F) float64, as (world, K, F) float64 on the host (one all-gather)."""
    flat = local.reshape(-1).to(device)
    out = torch.empty(collectives.world_size() * flat.numel(), dtype=flat.dtype, device=device)
    collectives.all_gather(out, flat, collectives.world_group(), async_op=False, tag="world-size-invariant sums")
    return out.cpu().view(-1, *local.shape)


def sum_interleaved(gathered: torch.Tensor, block: int = 1) -> List[float]:
    """Column sums of gathered rows, added as Python floats in global order, so the result is the
    same for any split of the same rows over ranks.

    Args:
        gathered: (W, K * block, F): rank r's rows in its order. Global order takes blocks of
            ``block`` rows round robin over ranks: block j of rank 0, block j of rank 1, ...,
            block j + 1 of rank 0 (global block index j*W + r, as `fullshard.data.global_micro_batch`
            for block 1, and the validation sampler's sequences for block = batch size).

    Returns:
        F Python floats.
    """
    world, rows_per_rank, width = gathered.shape
    blocks = gathered.view(world, rows_per_rank // block, block, width).transpose(0, 1)
    rows = blocks.reshape(-1, width).tolist()
    totals = [0.0] * width
    for row in rows:
        for f, value in enumerate(row):
            totals[f] += value
    return totals


def make_deterministic(device: torch.device) -> None:
    """On CUDA: deterministic kernels (cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` before its first
    use). Call before any CUDA work. On a CPU nothing (threads are fixed by the caller)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def resolve_batch(args, world_size: int) -> tuple[int, Optional[int]]:
    """``(update_freq, global_batch_size)`` of parsed arguments at ``world_size`` ranks.

    With --global-batch-size, update_freq is derived from it; an explicit --update-freq must equal
    the derived value. Without it, update_freq is --update-freq (default 1) and the global batch is
    recorded only under --world-size-invariant (``batch_size * update_freq * world_size``), so ranks
    restarted at another world size keep it.

    Raises:
        GlobalBatchError: one line: the global batch is not divisible, < 1, or conflicts with
            --update-freq.
    """
    if args.global_batch_size is None:
        k = 1 if args.update_freq is None else args.update_freq
        return k, (args.batch_size * k * world_size if args.world_size_invariant else None)
    k = derive_update_freq(args.global_batch_size, args.batch_size, world_size)
    if args.update_freq is not None and args.update_freq != k:
        raise GlobalBatchError(
            f"--update-freq {args.update_freq} conflicts with --global-batch-size {args.global_batch_size}, which "
            f"gives {args.global_batch_size} / (--batch-size {args.batch_size} x {world_size} ranks) = {k} "
            "micro-batches per update; drop --update-freq (it is derived from --global-batch-size)")
    return k, args.global_batch_size
