"""The communication half of :class:`fullshard.fsdp2.FSDPModule`: torch
FSDP2's methods that choose how a unit's collectives run (custom
all-gather / reduce-scatter objects, the all-reduce hook, sum-only
reductions, a separate reduce-scatter group, unused parameters, in-flight
reduce-scatter buffers, NCCL memory strategies), the post-optimizer event
and ``reset_iter_state``. The settings live on each unit's
:class:`fullshard.core.settings.UnitSettings`; core/comm.py and core/reduce.py
use them.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from .core import collectives, comm, state
from .core.torch_private import in_backward_pass


class CommMethods:
    """Mixed into ``FSDPModule``; uses its ``_runtime``, ``_lazy_init`` and ``_targets``."""

    def reset_iter_state(self) -> None:
        """Clear this iteration's state after an exception aborted a forward
        or backward: in-flight collectives are waited on and their results
        dropped, every unit is resharded and idle, and accumulations in
        progress (``set_requires_gradient_sync(False)`` micro-batches, HSDP
        sums kept by ``set_requires_all_reduce(False)``) are discarded, so
        restart the micro-batch sequence. Call on the root (the outermost
        ``fully_shard`` module). fullshard also clears an interrupted
        iteration by itself at the next forward; this call additionally
        drops the accumulations.

        Raises:
            RuntimeError: not the root, or called inside a backward.
        """
        self._lazy_init()
        rt = self._runtime
        if not rt.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module (the outermost fully_shard "
                               "module, which runs forward first)")
        if in_backward_pass():
            raise RuntimeError("reset_iter_state() cannot run inside a backward; call it after the exception "
                               "has left backward()")
        state.start_iteration(rt.root, discard=True)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Wait on ``event`` (recorded after the optimizer step) before the
        root's next forward issues its all-gathers; the event is then
        dropped, so pass a new one each iteration. fullshard's all-gathers
        (on a side stream, core/streams.py) wait for the current stream's
        work queued before each is issued, so they already follow the queued
        optimizer step: the wait keeps that guarantee and cannot remove the
        dependence on unrelated work queued after the step (torch FSDP2's
        all-gather streams wait on the event instead). On CPU (gloo) every
        step has finished before the forward starts and events cannot be
        recorded; an unrecorded ``torch.Event()`` is accepted and its wait
        returns at once. Call on the root.

        Raises:
            RuntimeError: not the root.
            TypeError: ``event`` has no ``wait()``.
        """
        if not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event takes a torch.Event, got {type(event).__name__}")
        self._lazy_init()
        if not self._runtime.is_root:
            raise RuntimeError("set_post_optim_event() must be called on the root module (the outermost "
                               "fully_shard module, which runs forward first)")
        self._runtime.root.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in torch)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_custom_all_gather(self, comm_obj) -> None:
        """Run this unit's all-gathers through ``comm_obj`` (torch FSDP2's
        ``AllGather`` protocol: ``allocate((numel,), dtype=, device=)`` and
        ``comm_obj(output_tensor=, input_tensor=, group=, async_op=)``);
        see core/comm.py [Note: custom collectives]. Not recursive. None
        restores fullshard's own. ``allocate`` must return a contiguous
        tensor of that numel, dtype and device; anything else raises
        ValueError at the all-gather that asked for it.

        Raises:
            TypeError: ``comm_obj`` lacks ``allocate`` or is not callable.
        """
        self._runtime.settings.custom_all_gather = _checked_comm(comm_obj, "set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm_obj) -> None:
        """Run this unit's gradient reduce-scatters through ``comm_obj``
        (torch FSDP2's ``ReduceScatter`` protocol: ``allocate`` and
        ``comm_obj(output_tensor=, input_tensor=, group=, op=, async_op=)``,
        ``op`` always ``ReduceOp.SUM`` on a pre-divided input); see
        core/comm.py [Note: custom collectives]. Not recursive. None
        restores fullshard's own. ``allocate`` must return contiguous
        buffers, as for :meth:`set_custom_all_gather`.

        Raises:
            TypeError: ``comm_obj`` lacks ``allocate`` or is not callable.
            ValueError: a ``world_size_invariant`` unit (its ordered fold
                replaces the reduce-scatter).
        """
        if comm_obj is not None:
            _not_invariant(self, "set_custom_reduce_scatter")
        self._runtime.settings.custom_reduce_scatter = _checked_comm(comm_obj, "set_custom_reduce_scatter")

    def set_all_reduce_hook(self, hook: Optional[Callable[[torch.Tensor], None]], *, stream=None) -> None:
        """Call ``hook(reduce_output)`` on each reduced gradient shard of this
        unit before it reaches ``.grad``: the reduce-scatter output (1-D,
        reduce dtype: the padded shards of the unit's parameters, in the
        order of fullshard's flat layout, which may differ from torch's), or
        with HSDP the all-reduce output; the hook may change it in place.
        It runs when the reduce finishes, before the division
        ``set_force_sum_reduction_for_comms`` defers, and not for a backward
        under ``set_requires_all_reduce(False)`` (as torch). ``stream``: a
        CUDA stream to run it on (not with HSDP). Not recursive.

        Raises:
            ValueError: ``stream`` with HSDP; a ``world_size_invariant`` unit.
            TypeError: ``hook`` is not callable.
        """
        unit = self._runtime.unit
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable, got {type(hook).__name__}")
        if hook is not None:
            _not_invariant(self, "set_all_reduce_hook")
        if stream is not None and unit.cfg.replicate_group is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (the hook runs where the "
                             "replicas' all-reduce finishes)")
        unit.settings.all_reduce_hook = hook if stream is None or hook is None else _on_stream(hook, stream)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``ReduceOp.SUM`` only and divide separately: with True
        gradients are summed undivided (fp32/bf16; about sqrt(factor) is
        divided first for other dtypes, as torch) and the division comes
        after the all-reduce hook. fullshard's collectives sum in either case
        (the default pre-divides, DDP's order); this moves the division.
        Not recursive.

        Raises:
            ValueError: a ``world_size_invariant`` unit.
        """
        if enable:
            _not_invariant(self, "set_force_sum_reduction_for_comms")
        self._runtime.settings.force_sum = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Whether a parameter no rank used in backward gets a zero gradient
        (True, torch's result) or keeps ``grad None`` (False, the default:
        DDP's with ``find_unused_parameters``). fullshard reduces every
        parameter of a unit either way, so ranks that use different
        parameters (MoE, conditional branches) never issue mismatched
        collectives. A unit whose output no loss used runs no backward and
        keeps ``grad None`` either way (torch FSDP2 gives it zeros when it
        stayed gathered after forward, ``reshard_after_forward=False``)."""
        for m in self._targets(recurse):
            m._runtime.settings.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (each holding a unit-sized input buffer)
        may be in flight once this unit's is issued; older ones are finished
        first. fullshard's default is 2 (torch's is 1). More overlaps more
        backward with communication at the cost of peak memory.

        Raises:
            TypeError: not an int (a bool is refused).
            ValueError: below 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for m in self._targets(recurse):
            m._runtime.settings.max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run gradient reduce-scatters on a process group of their own (one
        per set of shard ranks, made with ``use_local_synchronization``), so
        they progress concurrently with the backward's all-gathers; False
        returns them to the shard group. Collective: every rank of the shard
        groups calls it alike. On gloo the group is its own set of
        connections and threads, so the overlap is real on CPU too.
        Results are unchanged."""
        made: dict[tuple, object] = {}
        for m in self._targets(recurse):
            unit = m._runtime.unit
            group = unit.cfg.shard_group
            if not enable or collectives.group_size(group) == 1:
                unit.settings.reduce_scatter_group = None
                continue
            ranks = tuple(collectives.group_ranks(group))
            if ranks not in made:
                made[ranks] = unit.settings.reduce_scatter_group or collectives.new_group(list(ranks), local=True)
            unit.settings.reduce_scatter_group = made[ranks]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this unit's all-gather and reduce-scatter buffers with the
        process group's own allocator (NCCL: memory it can register for
        zero-copy transfers, e.g. over SHARP). A backend without one keeps
        fullshard's buffer pool, as torch falls back to ``torch.empty``:
        gloo has none, so on CPU this changes nothing. Not recursive.

        Raises:
            ValueError: a custom all-gather or reduce-scatter is set (it
                allocates its own buffers).
        """
        unit = self._runtime.unit
        _no_custom(unit, "set_allocate_memory_from_process_group_for_comm")
        group = unit.cfg.shard_group
        if not enable or collectives.group_size(group) == 1:
            unit.settings.allocator = None
            return
        unit.settings.allocator = comm.ProcessGroupAllocator(group, unit.cfg.compute_device)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Allocate this unit's all-gather buffers (and, with
        ``set_force_sum_reduction_for_comms(True)``, its reduce-scatter
        buffers: NCCL's symmetric reduce-scatter only sums) from symmetric
        memory and register them with the group before each collective, so
        NCCL can use copy-engine or symmetric-kernel collectives. CUDA with
        an NCCL process group only: gloo and CPU tensors have no symmetric
        memory, and the call raises there. Collective on first use (a
        barrier over the shard group). Not recursive.

        Raises:
            ValueError: ``backend`` is not "NCCL"; the unit is not on CUDA
                over NCCL; a custom all-gather or reduce-scatter is set.
        """
        unit = self._runtime.unit
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: only backend='NCCL' is supported, got {backend!r}")
        _no_custom(unit, "set_symm_mem_for_comm")
        group, device = unit.cfg.shard_group, unit.cfg.compute_device
        if collectives.group_size(group) == 1:
            return
        pg_backend = collectives.backend(group)
        if device.type != "cuda" or pg_backend != "nccl":
            raise ValueError(f"set_symm_mem_for_comm: unit '{unit.name}' runs on {device.type} over {pg_backend}; "
                             "symmetric memory needs CUDA tensors and an NCCL process group")
        unit.settings.allocator = comm.SymmMemAllocator(group, backend)


def _checked_comm(comm_obj, what: str):
    if comm_obj is not None and not (callable(comm_obj) and callable(getattr(comm_obj, "allocate", None))):
        raise TypeError(f"{what}: takes an object with allocate(size, *, dtype, device) and __call__ (torch "
                        f"FSDP2's AllGather/ReduceScatter protocol), got {type(comm_obj).__name__}")
    return comm_obj


def _not_invariant(module, what: str) -> None:
    unit = module._runtime.unit
    if unit.cfg.invariant_layout is not None:
        raise ValueError(f"{what}: unit '{unit.name}' uses world_size_invariant=True, whose ordered fold "
                         "replaces the reduce-scatter; drop one of the two")


def _no_custom(unit, what: str) -> None:
    if unit.settings.custom_all_gather is not None or unit.settings.custom_reduce_scatter is not None:
        raise ValueError(f"{what}: unit '{unit.name}' has a custom all-gather or reduce-scatter, which allocates "
                         "its own buffers; use one or the other")


def _on_stream(hook: Callable[[torch.Tensor], None], stream) -> Callable[[torch.Tensor], None]:
    """``hook`` run on ``stream`` (ordered after the current stream's work, and before its later work)."""

    def run(t: torch.Tensor) -> None:
        current = torch.cuda.current_stream(t.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            hook(t)
        current.wait_stream(stream)

    return run
