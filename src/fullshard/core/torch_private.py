"""Every use of a private torch API in fullshard, one small function each.

A private name (a leading underscore, ``torch._C``) may change or vanish in
any torch release; keeping them here makes an upgrade one file to read. Each
function says why no public API does the job in torch 2.13. Where a public
replacement exists it is used at the call site instead (``sparse.values()``,
``torch.nn.utils.clip_grads_with_norm_``, the public norm classes of
``MixedPrecision.full_precision_module_classes``).

Not routed through here: ``nn.Module``'s own bookkeeping (``_parameters``,
``_buffers``, ``_modules``, ``_non_persistent_buffers_set``, and overriding
``_apply``), which the engine reads and writes to swap parameters without
``register_parameter``'s checks, as torch's own FSDP and ``nn.utils``
do. These are nn.Module's documented-enough internals, used throughout the
library and by most wrappers of modules.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


# ---------------------------------------------------------------- storages
def can_swap_storages() -> bool:
    """Whether :func:`swap_storages` is available (``UntypedStorage._swap_data_ptr_``)."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (data pointers and sizes) of two storages in place.

    No public API moves memory into an existing storage object, which a
    unit's unsharded flat parameter needs (autograd's saved views point at
    it); see core/buffers.py [Note: buffer reuse].
    """
    a._swap_data_ptr_(b)


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter (``t._version``): bumped by every in-place write.

    No public API tells that a tensor was written in place (``zero_()`` by
    ``optimizer.zero_grad(set_to_none=False)``, ``copy_()`` by a load).
    """
    return t._version


def storage_users(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) share ``t``'s memory, ``t``
    included (``torch._C._storage_Use_Count``, less the storage object this
    call makes). 1: nothing else can read or write it.

    No public API tells whether a buffer the engine reuses is still held
    elsewhere (a ``.grad`` view the user kept).
    """
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1


# ---------------------------------------------------------------- autograd
def in_backward_pass() -> bool:
    """Whether the autograd engine is executing a backward on this thread
    (``torch._C._current_graph_task_id() != -1``; torch FSDP2 uses the same
    test; no public equivalent)."""
    return torch._C._current_graph_task_id() != -1


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward finishes
    (``Variable._execution_engine.queue_callback``; must be called during a
    backward; no public equivalent, torch FSDP1 and DDP use it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def post_accumulate_grad_hooks(param: torch.Tensor) -> list[Callable]:
    """The hooks ``param.register_post_accumulate_grad_hook`` registered, in
    registration order (``param._post_accumulate_grad_hooks``, an
    OrderedDict or None; torch FSDP2 reads it the same way). No public API
    runs them: autograd does only for a gradient it accumulated itself, and
    a sharded parameter's gradient is written by the reduce-scatter."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def gradient_hooks(param: torch.Tensor) -> list[Callable]:
    """The hooks ``param.register_hook`` registered on a leaf, in registration
    order (``param._backward_hooks``, an OrderedDict or None). No public API
    runs them: autograd does only for a gradient that reaches ``param`` in the
    graph, and a sharded parameter is not in it (its unit's full parameters
    are)."""
    hooks = getattr(param, "_backward_hooks", None)
    return list(hooks.values()) if hooks else []


def carry_gradient_hooks(new: torch.Tensor, old: torch.Tensor) -> None:
    """Give ``new`` (a sharded parameter) the gradient hooks registered on ``old`` (the parameter it
    replaces) with ``register_hook`` and ``register_post_accumulate_grad_hook``: the same dicts, so a
    handle made on ``old`` still removes its hook. No public API moves hooks between tensors."""
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(old, name, None)
        if hooks:
            setattr(new, name, hooks)


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (``CommDebugMode``, a user's op
    counter) is active on this thread
    (``torch.utils._python_dispatch._get_current_dispatch_mode_stack``; no
    public query)."""
    return bool(_get_current_dispatch_mode_stack())


# --------------------------------------------------------- foreach kernels
def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i in one fused call (``torch._foreach_copy_``)."""
    torch._foreach_copy_(dst, src)


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Row r of ``out`` (contiguous, ``num_chunks`` rows) := the concatenation
    of row r of each 2-D ``tensors[i]`` (``num_chunks`` rows each), cast to
    ``out``'s dtype (``torch._chunk_cat``: one kernel on CUDA, with bf16 → fp32
    in the same pass; torch FSDP2's reduce-scatter copy-in). No public op
    gathers and casts many tensors into one buffer in one call."""
    torch._chunk_cat(tensors, 0, num_chunks, out=out)


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """Zero every tensor in one fused call (``torch._foreach_zero_``)."""
    torch._foreach_zero_(tensors)


def foreach_mul_(tensors: list[torch.Tensor], scalar) -> None:
    """Multiply every tensor in place by ``scalar`` (a number or 0-dim tensor)
    in one fused call (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalar)


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (same device and dtype) by ``inv_scale`` in place and
    set ``found_inf`` (1-element fp32) to 1.0 if any element was inf or NaN
    (``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel behind
    ``torch.amp.GradScaler.unscale_``, which has no public per-tensor form).

    Raises:
        RuntimeError, NotImplementedError: the backend or dtype has no kernel.
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# ------------------------------------------------------------- distributed
def default_store() -> dist.Store:
    """The default process group's key-value store
    (``distributed_c10d._get_default_store``; no public accessor). Used only
    to post and read what each rank was waiting in after a collective failed.

    Raises:
        ValueError, RuntimeError: no default process group.
    """
    return dist.distributed_c10d._get_default_store()


@contextlib.contextmanager
def forward_actions_only(schedule) -> Iterator[None]:
    """While the block runs, a runtime pipeline schedule (``ZBVZeroBubble``, ``DualPipeV``) keeps only
    its forward actions, their sends and receives, and its unshards and reshards (an ``OVERLAP_F_B``
    action gives its forward part), for evaluation.

    torch 2.13's ``eval()`` of these schedules replays their backward actions as well, and the
    hand-off of a gradient between a rank's two stages then fails (``can't steal_bwd_input if this
    stage doesn't have backward``). No public API runs a schedule's forward actions alone; the
    runtime's lowered action lists (``pipeline_order_with_comms``) are private.
    """
    from torch.distributed.pipelining import schedules as sch

    keep = {sch.FORWARD, sch.SEND_F, sch.RECV_F, sch.UNSHARD, sch.RESHARD}

    def forward_part(actions):
        for action in actions:
            for part in (action.sub_actions or ()) if action.computation_type == sch.OVERLAP_F_B else (action,):
                if part.computation_type in keep:
                    yield part
    whole = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: list(forward_part(actions)) for rank, actions in whole.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = whole


# ---------------------------------------------------------------- profiler
def profiler_allocations(prof) -> list[tuple[int, int]]:
    """``(start time in ns, bytes)`` of every allocator event of a finished
    ``torch.profiler.profile(profile_memory=True)`` (frees have negative
    bytes), from the experimental event tree
    (``prof.profiler.kineto_results.experimental_event_tree``,
    ``torch._C._profiler._EventType``): the public ``key_averages()`` has no
    per-event timeline."""
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return events


# ---------------------------------------------------------------- DTensor
def local_tensor(dtensor) -> torch.Tensor:
    """The local tensor object of a DTensor itself (``_local_tensor``).

    ``DTensor.to_local()`` returns a new view per call (an autograd op); the
    engine needs the object, to compare memory and to write in place.
    """
    return dtensor._local_tensor


def set_local_tensor(dtensor, tensor: torch.Tensor) -> None:
    """Point a DTensor parameter at new local memory, keeping the object.

    ``p.data = DTensor(...)`` leaves a DTensor's local tensor unchanged in
    torch 2.13 and no public API rebinds it; torch FSDP2 assigns
    ``_local_tensor`` the same way after ``nn.Module._apply``.
    """
    dtensor._local_tensor = tensor


def strided_shard(dim: int, split_factor: int):
    """``_StridedShard(dim, split_factor=...)``: the placement of a data-parallel
    shard of a tensor-parallel part that TP already sharded on ``dim``
    (``split_factor`` TP chunks). No public placement describes dp chunks
    interleaved with TP chunks; torch FSDP2 uses this one for FSDP + TP."""
    return _StridedShard(dim, split_factor=split_factor)


def concatenate_meshes(meshes: list):
    """One ``DeviceMesh`` whose dims are those of ``meshes`` in order, all
    slices of one root mesh (``DeviceMesh._concatenate``, what torch FSDP2
    uses for its data-parallel + tensor-parallel mesh; no public API builds a
    mesh from disjoint slices).

    Raises:
        RuntimeError: the meshes come from different roots or overlap.
    """
    return DeviceMesh._concatenate(meshes)


def dtensor_spec(mesh: DeviceMesh, placements, shape, stride, dtype: torch.dtype) -> DTensorSpec:
    """The spec of a DTensor with global ``shape`` / ``stride`` and local tensors of ``dtype``;
    immutable, so one may serve every DTensor of a parameter and dtype (building one costs tens
    of microseconds of host time per gradient)."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def dtensor_of(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``local`` itself as the local tensor of a DTensor of ``spec`` (from :func:`dtensor_spec`
    for ``local.dtype``; no autograd edge). ``DTensor.from_local`` copies a tensor whose device
    type is not the mesh's (a CPU-offloaded shard on a CUDA mesh) to the mesh's device, so the
    parameter would no longer view the flat shard; torch FSDP2 builds its DTensors this way too
    (``_from_local_no_grad``)."""
    return DTensor(local, spec, requires_grad=local.requires_grad)


def process_group_backend(group, device: torch.device):
    """The backend object serving ``group`` on ``device``
    (``ProcessGroup._get_backend``); its ``supports_tensor_alloc(device)``
    and ``allocate_tensor(numel, dtype=, device=)`` are the process group's
    own allocator (what torch FSDP2's ``ProcessGroupAllocMixin`` uses)."""
    return group._get_backend(device)


def symm_mem_set_backend(backend: str) -> None:
    """Choose the symmetric-memory backend (``torch.distributed._symmetric_memory``)."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend(backend)


def symm_mem_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor from the symmetric-memory pool of ``device`` (CUDA)."""
    import torch.distributed._symmetric_memory as symm_mem

    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        return torch.empty(numel, dtype=dtype, device=device)


def symm_mem_rendezvous(t: torch.Tensor, group) -> None:
    """Register symmetric-memory tensor ``t`` with every rank of ``group``."""
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.rendezvous(t, group=group.group_name)


def stage_backward_input(stage_outputs, output_grads, input_values, weights):
    """The input pass of a pipeline stage's split backward, with ``weights`` the stage's graph
    leaves (``torch.distributed.pipelining._backward.stage_backward_input``). torch 2.13 has no
    public form: ``PipelineStage.backward_maybe_with_nosync`` calls it on
    ``submod.parameters()``, which are not the leaves of fullshard's units (fullshard/pipelining.py
    [Note: split backward of fullshard units]). Imported here, on first use, so that importing
    fullshard does not import ``torch.distributed.pipelining``."""
    from torch.distributed.pipelining._backward import stage_backward_input as backward_input

    return backward_input(stage_outputs, output_grads, input_values, weights)


def split_backward_problem(version: str = "") -> str:
    """Why ``torch.__version__`` (or ``version``) cannot split the backward of fullshard units ('' when it
    can): before 2.13, :func:`stage_backward_weight` sums the gradients saved at several graph nodes
    without removing what flows from one through another, so a unit's flat parameter, reached through
    nested views, gets wrong weight gradients (seen on torch 2.11: a gradient norm of 3.29 where one
    process has 2.87); torch 2.13 clamps those saved gradients."""
    version = version or torch.__version__
    if tuple(int(part) for part in version.split(".")[:2]) >= (2, 13):  # pre-releases of 2.13 included
        return ""
    return (f"torch {version}'s split backward (torch.distributed.pipelining's stage_backward_weight) gives "
            "fullshard units wrong weight gradients; it needs torch 2.13 or newer. Use GPipe, 1F1B, "
            "Interleaved1F1B or LoopedBFS, or a newer torch")


def stage_backward_weight(weights, param_groups):
    """The weight pass matching :func:`stage_backward_input` (same module, same reason)."""
    from torch.distributed.pipelining._backward import stage_backward_weight as backward_weight

    return backward_weight(weights, param_groups)
