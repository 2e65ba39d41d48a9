"""The unit-side halves of the collectives a unit's communication settings
change (``FSDPModule.set_custom_all_gather``, ``set_custom_reduce_scatter``,
``set_all_reduce_hook``, ``set_force_sum_reduction_for_comms``,
``set_separate_reduce_scatter_group``, ``set_reduce_scatter_unused_params``,
``set_reduce_scatter_max_input_buffers`` and the NCCL memory strategies),
whose values live on the unit's :class:`~fullshard.core.settings.UnitSettings`.
The collectives themselves are issued by core/collectives.py; a user's
collective object is called through :func:`collectives.call_custom`.

[Note: custom collectives]
A custom all-gather or reduce-scatter object follows torch FSDP2's protocol
(``torch.distributed.fsdp._fully_shard._fsdp_api``): ``allocate(size, *,
dtype, device)`` returns the buffers the collective reads or writes, and
``__call__(output_tensor, input_tensor, group, [op,] async_op)`` runs it.
It carries the unit's traffic in place of ours, with torch's buffers: the
all-gather's input is this rank's slot of the output (in place), the
reduce-scatter's input holds ``group_size`` rank-major blocks of padded
gradient shards and nothing else. It is called with ``async_op=False``, as
torch FSDP2 calls it by default, and never for a one-rank group (nothing
travels; torch skips it there too). Our own reduce-scatter appends one used
flag per parameter to each block (core/reduce.py); with a custom one the
flags travel in a small all-reduce of our own instead, so a parameter no
rank used still keeps ``grad None``. The reduce-scatter gets
``ReduceOp.SUM`` on a pre-divided input (DDP's order), never ``AVG`` or
``PREMUL_SUM``; with ``force_sum`` the input is summed undivided and the
division comes after the all-reduce hook, as torch does.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import collectives, flat, torch_private, used_flags
from .buffers import POOL


class _Allocator:
    """Where our own collectives' buffers come from under a memory strategy."""

    pooled = False

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, t: torch.Tensor, group) -> None:
        """Called on a buffer before the collective that uses it."""


class _FreshAllocator(_Allocator):
    """A new tensor per buffer, never pooled: for a buffer that outlives its
    collective (the one-rank reduce input, which becomes the gradient; core/reduce.py)."""

    def allocate(self, numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)


FRESH = _FreshAllocator()


class ProcessGroupAllocator(_Allocator):
    """Buffers from the process group's own allocator (NCCL: memory it can
    register for zero-copy transfers). Backends without one (gloo) keep
    fullshard's buffer pool, as torch FSDP2 falls back to ``torch.empty``."""

    def __init__(self, group, device: torch.device):
        self.backend = torch_private.process_group_backend(collectives.pg_of(group), device)
        self.pooled = not self.backend.supports_tensor_alloc(device)

    def allocate(self, numel, dtype, device):
        if self.pooled:
            return POOL.take(numel, dtype, device)
        return self.backend.allocate_tensor(numel, dtype=dtype, device=device)


class SymmMemAllocator(_Allocator):
    """Buffers from the symmetric-memory pool of ``backend``, registered
    with the group before each collective (NCCL copy-engine and symmetric
    kernels). CUDA with NCCL only."""

    def __init__(self, group, backend: str):
        self.group = collectives.pg_of(group)
        torch_private.symm_mem_set_backend(backend)
        collectives.barrier(group, tag="symmetric memory setup")  # the communicator exists before rendezvous

    def allocate(self, numel, dtype, device):
        return torch_private.symm_mem_empty(numel, dtype, device)

    def prepare(self, t, group):
        torch_private.symm_mem_rendezvous(t, collectives.pg_of(group))


class _Foreign(_Allocator):
    """A buffer a custom collective object allocated: never pooled."""


FOREIGN = _Foreign()


def take(alloc: Optional[_Allocator], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer from ``alloc`` (None: the pool)."""
    return POOL.take(numel, dtype, device) if alloc is None else alloc.allocate(numel, dtype, device)


def give(alloc: Optional[_Allocator], t: Optional[torch.Tensor]) -> None:
    """Return ``t`` to the pool when it came from there; others are freed with their last reference."""
    if t is not None and (alloc is None or alloc.pooled):
        POOL.give(t)


def custom_all_gather(comm, send: torch.Tensor, group, numel: int, dtype: torch.dtype,
                      device: torch.device, rank: int, tag: str) -> torch.Tensor:
    """All-gather ``send`` (this rank's flat shard) with the user's ``comm``
    into a buffer of ``numel`` elements it allocates; this rank's slot of
    the output is the input (in place, as torch FSDP2 calls it).

    Returns:
        The all-gather output (rank-major flat shards), complete.
    Raises:
        ValueError: ``comm.allocate`` returned a tensor of the wrong size, dtype or device.
    """
    out = comm.allocate((numel,), dtype=dtype, device=device)
    _check_buffer(out, numel, dtype, device, "all-gather output")
    inp = out.narrow(0, rank * send.numel(), send.numel())
    inp.copy_(send)
    collectives.call_custom("all_gather(custom)", tag, group, inp,
                            lambda pg, _sum: comm(output_tensor=out, input_tensor=inp, group=pg, async_op=False))
    return out


def custom_reduce_scatter(unit, full_grad: Optional[torch.Tensor], used: list[bool], group,
                          pre: float, tag: str) -> torch.Tensor:
    """Reduce-scatter ``unit``'s full gradient (param-major; None = zeros)
    with the user's object ``unit.settings.custom_reduce_scatter`` (see [Note: custom
    collectives]); the used flags are summed over ``group`` separately.

    Returns:
        Our reduce output: the gradient shard followed by the summed used
        flags (core/reduce.py's layout).
    """
    comm, world = unit.settings.custom_reduce_scatter, unit.world
    n_grad, dtype, device = unit.layout.grad_shard_numel, unit.reduce_dtype, unit.cfg.compute_device
    inp = comm.allocate((world * n_grad,), dtype=dtype, device=device)
    _check_buffer(inp, world * n_grad, dtype, device, "reduce-scatter input")
    if full_grad is None:
        inp.zero_()
    else:
        flat.copy_in(inp, full_grad, unit.layout, block_numel=n_grad)
    if pre != 1:
        inp.div_(pre)
    shard = comm.allocate((n_grad,), dtype=dtype, device=device)
    _check_buffer(shard, n_grad, dtype, device, "reduce-scatter output")
    collectives.call_custom("reduce_scatter(custom)", tag, group, inp,
                            lambda pg, op: comm(output_tensor=shard, input_tensor=inp, group=pg, op=op,
                                                async_op=False))
    flags = torch.empty(len(used), dtype=dtype, device=device)
    used_flags.fill(flags.view(1, -1), used)  # no host-to-device copy of a Python list
    collectives.all_reduce(flags, group, "sum", tag=tag + " used flags")
    return torch.cat([shard.reshape(-1), flags])


def _check_buffer(t, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> None:
    # Contiguous: the collectives and the fused copies on CUDA write densely from the data pointer.
    if not torch.is_tensor(t) or t.numel() != numel or t.dtype != dtype or t.device != device \
            or not t.is_contiguous():
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if torch.is_tensor(t) else type(t).__name__
        got += "" if not torch.is_tensor(t) or t.is_contiguous() else f" with strides {t.stride()}"
        raise ValueError(f"custom collective: allocate() for the {what} returned {got}, expected {numel} "
                         f"contiguous {dtype} elements on {device}")


def run_hook(unit, grad_shard: torch.Tensor) -> None:
    """Call the unit's all-reduce hook on its reduced gradient shard (1-D,
    reduce dtype, in place)."""
    hook = unit.settings.all_reduce_hook
    if hook is not None:
        hook(grad_shard)
