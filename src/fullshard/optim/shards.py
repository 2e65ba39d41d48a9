"""What a ``fullshard.optim`` step needs to know about a parameter's rows,
and the batched cross-rank sums of its statistics.

[Note: optimizers on shards]
Every optimizer here computes on ``local_of(p)`` and ``local_of(p.grad)``:
this rank's rows ``[lo, hi)`` of dim 0 (Lamb, which only sums whole-tensor
norms, also takes ``fully_shard``'s ``Shard(d)`` chunks; Muon and Adafactor
refuse a parameter split on another dim) (all of them on one device, or for a
parameter fullshard does not shard). :func:`fullshard.core.placement.shard_info`
says where the other rows are. A parameter is *split* when some rank of its
shard group holds a proper, non-empty part of its rows; otherwise one rank
holds it whole (``Owned``, or a row-sharded parameter too short to reach a
second rank) and the others hold zero rows. Statistics over a whole tensor
(a norm, a column mean) are partial sums on each rank of a split
parameter; :class:`GroupSums` adds them over the shard group with one
all-reduce per group for all parameters of a step. HSDP replicas hold the
same rows and the same (already averaged) gradient, so they compute the
same step without talking to each other.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..core import collectives
from ..core.optim_guard import describe
from ..core.placement import ShardInfo, shard_info

ROWS = "rows"
"""``state_kind``: a state value whose dim 0 is the parameter's local rows (any trailing shape)."""
REPLICATED = "replicated"
"""``state_kind``: a state value identical on every rank of the parameter's shard group."""


def full_rows(info: ShardInfo) -> int:
    """Rows of the full parameter along its sharded dim (1 for a 0-dim one)."""
    return info.rows


def is_split(info: Optional[ShardInfo]) -> bool:
    """Whether some rank of the shard group holds a proper, non-empty part
    of the parameter's rows (the same answer on every rank)."""
    if info is None or info.world == 1:
        return False
    rows = full_rows(info)
    return any(0 < hi - lo < rows for lo, hi in zip(info.bounds, info.bounds[1:]))


@dataclasses.dataclass(frozen=True)
class Where:
    """One parameter as an optimizer step sees it.

    Attributes:
        name: ``'<name>' of unit '<unit>'`` (``#i`` in optimizer order when
            fullshard does not shard it), for messages.
        info: its :class:`~fullshard.core.placement.ShardInfo`, or None.
        shape: the full shape.
    """

    name: str
    info: Optional[ShardInfo]
    shape: torch.Size

    @property
    def split(self) -> bool:
        return is_split(self.info)

    @property
    def holds_all(self) -> bool:
        """This rank holds every row."""
        return self.info is None or self.info.whole

    @property
    def group(self):
        """The shard group to sum over, or None when one rank holds everything (world 1)."""
        return None if self.info is None else self.info.group

    @property
    def numel(self) -> int:
        return self.shape.numel()


def where(param: torch.Tensor, index: int, owner: str, any_dim: bool = False) -> Where:
    """The :class:`Where` of ``param`` (#``index`` in ``owner``'s order).

    Args:
        any_dim: the optimizer only sums whole-tensor statistics, so a
            parameter split on a dim other than 0 (``Shard(d)``) is fine.

    Raises:
        ValueError: ``param`` is a DTensor fullshard does not shard, or a
            tensor-parallel one (its local rows are not dim-0 rows of the
            whole parameter; the step would be silently wrong), or (without
            ``any_dim``) one split on a dim other than 0.
    """
    info = shard_info(param)
    if not any_dim and info is not None and info.dim and is_split(info):
        raise ValueError(f"[rank {collectives.rank()}] {owner}: parameter {describe(param, info)} (shape "
                         f"{tuple(info.shape)}) is sharded on dim {info.dim} (Shard({info.dim})), but {owner} steps "
                         "on dim-0 rows; return Shard(0) (or None) from shard_placement_fn for it, or use "
                         "fullshard.optim.Lamb or an element-wise optimizer")
    if isinstance(param, DTensor):
        if info is None:
            raise ValueError(f"[rank {collectives.rank()}] {owner}: parameter #{index} (shape {tuple(param.shape)}) "
                             "is a DTensor that fullshard does not shard; fullshard.optim steps on fullshard's "
                             "shards, plain tensors or fully_shard parameters only")
        if tuple(param.shape) != tuple(info.shape):
            raise ValueError(f"[rank {collectives.rank()}] {owner}: parameter {describe(param, info)} is tensor-"
                             f"parallel (global shape {tuple(param.shape)}, data-parallel rows of "
                             f"{tuple(info.shape)}); "
                             "fullshard.optim does not support tensor parallelism: use an element-wise optimizer")
    if info is None:
        return Where(f"#{index}", None, param.shape)
    return Where(describe(param, info), info, torch.Size(info.shape))


class WhereCache:
    """``Where`` of every parameter of an optimizer, rebuilt when its groups change."""

    def __init__(self, any_dim: bool = False):
        self.any_dim = any_dim
        self._key = None
        self._by_id: dict[int, Where] = {}

    def get(self, optimizer: torch.optim.Optimizer) -> dict[int, Where]:
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        if key != self._key:
            order = [p for g in optimizer.param_groups for p in g["params"]]
            owner = type(optimizer).__name__
            self._by_id = {id(p): where(p, i, f"fullshard.optim.{owner}", self.any_dim) for i, p in enumerate(order)}
            self._key = key
        return self._by_id


class GroupSums:
    """Tensors summed over process groups, one all-reduce per (group, device,
    dtype) for all of them.

    Every rank of a group must :meth:`add` the same shapes in the same order
    (parameters in optimizer order do). Values are summed in at least fp32.
    """

    def __init__(self, tag: str):
        self.tag = tag
        self._parts: dict[tuple, list[torch.Tensor]] = {}
        self._out: dict[tuple, list[torch.Tensor]] = {}

    def add(self, group, value: torch.Tensor) -> tuple:
        """Queue ``value`` to be summed over ``group``; returns its ticket for :meth:`get`."""
        dtype = torch.promote_types(value.dtype, torch.float32)
        key = (group, value.device, dtype)
        parts = self._parts.setdefault(key, [])
        parts.append(value.detach().to(dtype))
        return key, len(parts) - 1

    def __bool__(self) -> bool:
        return bool(self._parts)

    def reduce(self) -> None:
        """All-reduce every queued value (no collective when none is queued)."""
        for key, parts in self._parts.items():
            group = key[0]
            flat = torch.cat([p.reshape(-1) for p in parts])
            if flat.device.type == "cpu" and collectives.backend(group) == "nccl":  # offloaded parameters
                flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
                collectives.all_reduce(flat, group, "sum", tag=self.tag)
                flat = flat.cpu()
            else:
                collectives.all_reduce(flat, group, "sum", tag=self.tag)
            self._out[key] = [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in parts]), parts)]
        self._parts = {}

    def get(self, ticket: tuple) -> torch.Tensor:
        """The summed value of a ticket (after :meth:`reduce`)."""
        key, i = ticket
        return self._out[key][i]


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||_2^2`` as a 1-element tensor, computed in at least fp32 (0 for an empty ``t``)."""
    return torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)).square().reshape(1)


def check_grad(param: torch.Tensor, name: str, owner: str) -> None:
    """torch's checks before a step.

    Raises:
        RuntimeError: complex parameters or sparse gradients (as torch's optimizers).
    """
    if torch.is_complex(param):
        raise RuntimeError(f"{owner} does not support complex parameters ({name})")
    if param.grad.is_sparse:
        raise RuntimeError(f"{owner} does not support sparse gradients ({name})")


def like_param(param: torch.Tensor, local: torch.Tensor, shape, replicated: bool = False) -> torch.Tensor:
    """``local`` (state of this rank's rows) in ``param``'s form: itself for a
    plain parameter; under ``fully_shard`` a DTensor on the parameter's mesh,
    placed like it (dim-0 rows, global ``shape``) or, with ``replicated``,
    the same on every rank."""
    if not isinstance(param, DTensor):
        return local
    mesh = param.device_mesh
    if replicated:
        return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False, shape=local.shape,
                                  stride=local.stride())
    shape = torch.Size(shape)
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def gather_rows(local: torch.Tensor, info: ShardInfo, owner: str) -> torch.Tensor:
    """The whole parameter-shaped tensor whose rows ``info.row_range`` this
    rank holds as ``local`` (``collectives.all_gather_rows`` over the shard
    group; every rank of the group calls it for the same parameter).

    Returns:
        A new tensor of shape ``info.shape``, ``local``'s dtype and device.
    """
    return collectives.all_gather_rows(local, info.bounds, info.group, tag=f"{owner} rows")


def run_closure(closure) -> Optional[torch.Tensor]:
    """``closure()`` under grad mode (an optimizer's ``step`` runs under
    ``no_grad``), or None without one: what ``torch.optim`` steps do first."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
