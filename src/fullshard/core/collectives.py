"""The only module that calls ``torch.distributed`` operations.

Every function takes an explicit process group, checks sizes in Python before
calling into the backend (so a mismatch reads clearly instead of a C++
``Check failed``), and returns the work handle (or ``None`` when the group has
one rank and nothing needs to travel). Backend quirks live here only.

``COUNTS`` counts issued collectives by name; tests use it to assert the
per-step choreography (e.g. two all-gathers and one reduce-scatter per unit
under FULL_SHARD).
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

COUNTS: collections.Counter = collections.Counter()
"""Collectives issued per op name since :func:`reset_counts` (one-rank groups, where
nothing travels, are not counted)."""
BYTES: collections.Counter = collections.Counter()
"""Bytes this rank put on the wire per op name (input bytes of each call)."""

# Newer torch renamed the tensor-in/tensor-out collectives; older ones only
# have the *_tensor names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _SelfGroup:
    """A group of just this rank: nothing travels (NO_SHARD's shard group)."""

    def __repr__(self) -> str:
        return "SELF_GROUP"


SELF_GROUP = _SelfGroup()


def world_group():
    return dist.group.WORLD


def reset_counts() -> None:
    COUNTS.clear()
    BYTES.clear()


def group_size(group) -> int:
    return 1 if group is SELF_GROUP else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is SELF_GROUP else dist.get_rank(group)


def _count(name: str, t: torch.Tensor) -> None:
    COUNTS[name] += 1
    BYTES[name] += t.numel() * t.element_size()


def _check_blocks(op: str, what: str, full: torch.Tensor, block: torch.Tensor, group) -> int:
    """Check ``full`` holds group-size blocks of ``block``'s numel and dtype; returns the group size."""
    n = group_size(group)
    if full.numel() != n * block.numel() or full.dtype != block.dtype:
        raise ValueError(f"{op}: {what} has {full.numel()} {full.dtype} elements, expected "
                         f"{n} x {block.numel()} {block.dtype}")
    return n


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True):
    """All-gather equal-size 1-D shards into ``output`` (rank-major).

    Args:
        output: 1-D tensor of ``group_size * shard.numel()`` elements.
        shard: 1-D tensor, this rank's shard; same dtype and device as output.
    Returns:
        The work handle, or None for a one-rank group (copied locally).
    Raises:
        ValueError: on a size or dtype mismatch.
    """
    n = _check_blocks("all_gather", "output", output, shard, group)
    if n == 1:
        output.copy_(shard)
        return None
    _count("all_gather", shard)
    return _ALL_GATHER(output, shard, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = True):
    """Sum ``full`` (rank-major, ``group_size`` equal blocks) over the group and
    leave block ``rank`` in ``output``.

    Callers pre-divide ``full`` for averaging: gloo has no ``PREMUL_SUM`` and
    pre-division is what DDP does, which keeps results bit-close to it.

    Raises:
        ValueError: on a size or dtype mismatch.
    """
    n = _check_blocks("reduce_scatter", "input", full, output, group)
    if n == 1:
        output.copy_(full)
        return None
    _count("reduce_scatter", full)
    return _REDUCE_SCATTER(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce with ``op`` in {"sum", "max", "min"}."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce: unknown op {op!r}; use one of {sorted(ops)}")
    if group_size(group) == 1:
        return None
    _count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=ops[op], group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group, async_op: bool = False):
    """In-place broadcast from the rank with group rank ``src_group_rank``."""
    if group_size(group) == 1:
        return None
    _count("broadcast", tensor)
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def barrier(group=None) -> None:
    """Block until every rank of ``group`` (None = the world) gets here."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def new_group(ranks: list[int]):
    """Create a process group over ``ranks``; every rank must call it in the same order."""
    return dist.new_group(ranks=ranks)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def backend(group=None) -> str:
    return dist.get_backend(group)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, by group rank (``[obj]`` for a one-rank group)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    COUNTS["all_gather_object"] += 1
    dist.all_gather_object(out, obj, group=group)
    return out


def device_mesh(group, device_type: str):
    """A 1-D ``DeviceMesh`` over ``group`` (None = the world) for DTensor values.

    Raises:
        ValueError: for :data:`SELF_GROUP`, which has no process group to span.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if group is SELF_GROUP:
        raise ValueError("device_mesh: SELF_GROUP (NO_SHARD's shard group) spans no process group")
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)
