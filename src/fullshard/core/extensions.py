"""All-gather extensions: parameters gathered in their own format.

[Note: all-gather extensions]
torch FSDP2's contract (used by torchao's float8 and NF4 weights): when a
parameter's local tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``, each unshard calls
``local.fsdp_pre_all_gather(mesh, orig_size, orig_stride, module,
mp_policy)`` (or ``(mesh)``, the older one-argument form) on this rank's
shard, which returns ``(inputs, metadata)``; every input is all-gathered
over the 1-D shard mesh (dim-0 concatenation of the ranks' inputs, which
must have equal shapes); then ``local.fsdp_post_all_gather(outputs,
metadata, param_dtype)`` returns ``(tensor, inner_tensors)``. Modules
compute with ``tensor`` cut to the parameter's shape. On every later
unshard the hook gets ``out=`` that same tensor and refills it in place
(returning None); the all-gather outputs are the same tensors each time.
Resharding frees the storage of the outputs and of ``inner_tensors``.

How the engine holds such a parameter (core/unit.py):
- Its local tensor is what the registered DTensor holds. A plain tensor
  (hooks set on the object after ``fully_shard``) stays a view of the flat
  shard. A tensor subclass whose class defines the hooks cannot view a
  plain buffer, so it is kept apart (``ParamSlot.own_local``): built from
  the original with ``torch.chunk`` rows, as torch does; optimizers step on
  it through the subclass's own ops. Its flat-shard region is refreshed
  from it (``copy_``) before each gather, so ``summon_full_params`` and full
  state dicts read its plain value.
- The unit's flat all-gather still carries every parameter's region (the
  extension one's is simply not read): one extra all-gather per input of
  each extension parameter, issued with the unit's.
- Its gradient is that of the flat region: a small autograd function hands
  the gradient w.r.t. the tensor modules read, as a plain tensor of the
  unit's compute dtype, to the parameter's view of the unsharded flat, so
  the unit's one reduce-scatter (and ``no_sync``, HSDP, clipping) covers it.
  torch does the same (float8 weights' gradients are plain tensors).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..api import MixedPrecisionPolicy
from . import collectives, flat, tree
from .buffers import POOL

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def defines(obj) -> bool:
    """Whether ``obj`` (a tensor or a tensor class) defines either hook."""
    return hasattr(obj, PRE) or hasattr(obj, POST)


def refuse(params, where: str) -> None:
    """Raise if any of ``params`` (tensors) defines an extension hook
    (``FullyShardedDataParallel``, whose flat parameters cannot honour it).

    Raises:
        ValueError: naming the first such parameter.
    """
    for name, p in params:
        if defines(p):
            raise ValueError(
                f"{where}: parameter '{name}' ({type(p).__name__}) defines fsdp_pre_all_gather/"
                "fsdp_post_all_gather, which FullyShardedDataParallel cannot honour (it would gather plain "
                "values); shard this model with fullshard.fully_shard, which supports the extension")


def check_new(fqn: str, param: torch.Tensor, where: str) -> None:
    """Refuse extension parameters ``fully_shard`` cannot take: hooks set on
    the parameter object (its shard is a new tensor without them; set them
    on ``param._local_tensor`` after ``fully_shard``, or define them on a
    subclass), or a subclass on the meta device.

    Raises:
        ValueError: naming the parameter.
    """
    if not defines(param):
        return
    if not defines(type(param)):
        raise ValueError(f"{where}: parameter '{fqn}' has fsdp_pre_all_gather/fsdp_post_all_gather set on the "
                         "object, which its shard would not keep; set them on the sharded parameter's _local_tensor "
                         "after fully_shard, or define them on a tensor subclass")
    if param.is_meta:
        raise ValueError(f"{where}: parameter '{fqn}' is a {type(param).__name__} (all-gather extension) on the "
                         "meta device; fully_shard takes extension subclasses materialized (build the model on the "
                         "device, then wrap its weights)")


def local_shard(param: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` rows of a subclass parameter, as a
    contiguous tensor of the same subclass (dim-0 shape ``local rows``)."""
    data = param.detach()
    chunks = torch.chunk(data, world, dim=0)
    rows = chunks[rank].size(0) if rank < len(chunks) else 0
    padded = data.new_zeros(chunks[0].size())
    if rows:
        padded.narrow(0, 0, rows).copy_(chunks[rank])
    return padded.narrow(0, 0, rows).requires_grad_(param.requires_grad)


class _Gathered:
    """One extension parameter's gather state, kept across unshards for the
    ``out=`` reuse (a new local tensor object starts afresh)."""

    def __init__(self, local: torch.Tensor):
        self.local = local
        self.sig: Optional[tuple] = None  # input (shape, dtype)s all ranks agreed on
        self.outputs: list[torch.Tensor] = []  # 1-D, world * input numel each
        self.metadata = None
        self.works: list = []
        self.full: Optional[torch.Tensor] = None  # what modules read (the parameter's shape)
        self.storages: list[tuple[torch.UntypedStorage, int]] = []  # freed at reshard

    def realloc(self) -> None:
        for storage, nbytes in self.storages:
            if storage.nbytes() == 0:
                POOL.lend(storage, nbytes)

    def free(self) -> None:
        for storage, _ in self.storages:
            POOL.reclaim(storage)


def start(unit) -> None:
    """Run the pre-hook of each extension parameter of ``unit`` and issue
    the all-gathers of its inputs (asynchronous, over the shard group).

    Raises:
        ValueError: under ``FullyShardedDataParallel`` or tensor
            parallelism; only one of the two hooks defined; the ranks'
            inputs differ in shape or dtype, or changed since the first
            gather (the all-gather outputs are reused).
    """
    kept, unit.ext = unit.ext, {}
    pending = {}
    for i, slot in enumerate(unit.slots):
        local = slot.registered_local()
        if not defines(local):
            continue
        _check_usable(unit, slot, local)
        state = kept.get(i)
        if state is None or state.local is not local:
            state = _Gathered(local)
        if slot.own_local and not getattr(unit, "packed", False):  # keep the flat region's plain value current
            with torch.no_grad():
                flat.shard_views(unit.flat_shard, unit.layout, unit.rank)[i].copy_(local)
        inputs, state.metadata = _pre(unit, i, local)
        inputs = [t.to(unit.cfg.compute_device).contiguous() for t in inputs]
        sig = tuple((tuple(t.shape), str(t.dtype)) for t in inputs)
        if state.sig is None:
            pending[i] = sig
        elif sig != state.sig:
            raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': fsdp_pre_all_gather of '{slot.fqn}' "
                             f"returned inputs {sig}, not {state.sig} as before; keep their shapes and dtypes fixed")
        unit.ext[i] = state
        state.inputs = inputs
    if pending:
        _agree(unit, pending)
    for i, state in unit.ext.items():
        if not state.outputs:
            state.outputs = [torch.empty(unit.world * t.numel(), dtype=t.dtype, device=t.device)
                             for t in state.inputs]
            state.storages = [(o.untyped_storage(), o.untyped_storage().nbytes()) for o in state.outputs]
            for storage, _ in state.storages:  # realloc() lends them pooled memory, counted as in use
                storage.resize_(0)
        state.realloc()
        state.works = [collectives.all_gather(o, t.view(-1), unit.cfg.shard_group, async_op=True,
                                              tag=f"unit '{unit.name}' extension '{unit.slots[i].fqn}'")
                       for o, t in zip(state.outputs, state.inputs)]
        state.inputs = None


def finish(unit) -> None:
    """Wait for the all-gathers and run each post-hook: the first time it
    returns the tensor modules read; later ones refill it (``out=``).

    Raises:
        ValueError: the post-hook's tensor has fewer elements than the parameter.
    """
    for i, state in unit.ext.items():
        for work in state.works:
            if work is not None:
                work.wait()
        state.works = []
        outs = tuple(o.view(-1, *shape[1:]) for o, (shape, _) in zip(state.outputs, state.sig))
        post = getattr(state.local, POST)
        if state.full is not None:
            post(outs, state.metadata, unit.compute_dtype, out=state.full)
        else:
            tensor, inner = post(outs, state.metadata, unit.compute_dtype)
            slot = unit.slots[i]
            shape = slot.layout.shape
            if tensor.numel() < shape.numel():
                raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': fsdp_post_all_gather of "
                                 f"'{slot.fqn}' returned {tuple(tensor.shape)}, fewer elements than the "
                                 f"parameter's {tuple(shape)}")
            state.full = torch.as_strided(tensor.detach(), shape, flat.contiguous_stride(shape), 0)
            for t in tree.plain_tensors(list(inner)):
                storage = t.untyped_storage()
                if storage.nbytes() and not any(s._cdata == storage._cdata for s, _ in state.storages):
                    state.storages.append((storage, storage.nbytes()))
                    POOL.adopt(storage.nbytes())  # the hook's memory: the pool takes it in at free()
        state.metadata = None


def free(unit) -> None:
    """Reshard: free the all-gather outputs and the post-hook's inner tensors."""
    for state in unit.ext.values():
        state.free()


def module_views(unit, views: list[torch.Tensor], grad: bool) -> list[torch.Tensor]:
    """``views`` (full views of the unsharded flat, layout order) with each
    extension parameter's replaced by the post-hook's tensor; with ``grad``
    its gradient flows into the flat view (see [Note: all-gather extensions])."""
    if not unit.ext:
        return views
    views = list(views)
    for i, state in unit.ext.items():
        live = views[i]
        views[i] = _GradToFlat.apply(live, state.full) if grad and live.requires_grad else state.full
    return views


class _GradToFlat(torch.autograd.Function):
    """Forward: the post-hook's tensor; backward: its gradient, as a plain
    tensor of the flat view's shape and dtype, to the flat view."""

    @staticmethod
    def forward(ctx, flat_view: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        ctx.like = (flat_view.shape, flat_view.dtype)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype = ctx.like
        if type(grad) is torch.Tensor:
            return grad.to(dtype).reshape(shape), None
        plain = torch.empty(shape, dtype=dtype, device=grad.device)
        plain.copy_(grad)  # a subclass gradient: its plain value
        return plain, None


# ----------------------------------------------------------------- helpers
def _check_usable(unit, slot, local) -> None:
    where = f"[rank {collectives.rank()}] unit '{unit.name}': parameter '{slot.fqn}'"
    if hasattr(local, PRE) != hasattr(local, POST):
        raise ValueError(f"{where} defines only one of fsdp_pre_all_gather/fsdp_post_all_gather; define both")
    if slot.spec is None:
        raise ValueError(f"{where} defines fsdp_pre_all_gather/fsdp_post_all_gather, which "
                         "FullyShardedDataParallel cannot honour; shard the model with fullshard.fully_shard")
    if slot.spec.full_mesh is not None:
        raise ValueError(f"{where} is tensor-parallel and defines fsdp_pre_all_gather; fully_shard gathers "
                         "extension parameters over data-parallel meshes only")


def _pre(unit, i: int, local) -> tuple[list[torch.Tensor], object]:
    slot = unit.slots[i]
    hook = getattr(local, PRE)
    mesh = _shard_mesh(unit, slot)
    nargs = len(inspect.signature(hook).parameters)
    if nargs == 1:
        inputs, metadata = hook(mesh)
    elif nargs == 5:
        shape = slot.layout.shape
        inputs, metadata = hook(mesh, shape, flat.contiguous_stride(shape), slot.owners[0][0], _mp_policy(unit))
    else:
        raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': fsdp_pre_all_gather of '{slot.fqn}' "
                         f"has signature {inspect.signature(hook)}; expected (mesh) or (mesh, outer_size, "
                         "outer_stride, module, mp_policy)")
    if torch.is_tensor(inputs):
        inputs = (inputs,)
    return list(inputs), metadata


def _shard_mesh(unit, slot):
    """The 1-D mesh of the shard group (an HSDP mesh's shard dimension)."""
    mesh = slot.spec.mesh
    if mesh.ndim == 1:
        return mesh
    if getattr(unit, "_ext_mesh", None) is None:
        unit._ext_mesh = collectives.device_mesh(unit.cfg.shard_group, mesh.device_type)
    return unit._ext_mesh


def _mp_policy(unit):
    cfg = unit.cfg
    return cfg.mp_policy if cfg.mp_policy is not None else MixedPrecisionPolicy(cfg.param_dtype, cfg.reduce_dtype)


def _agree(unit, pending: dict) -> None:
    """Check every rank of the shard group got inputs of the same shapes and
    dtypes (one object all-gather, the first time a parameter is gathered)."""
    mine = sorted(pending.items())
    every = collectives.all_gather_object(mine, unit.cfg.shard_group, tag=f"unit '{unit.name}' extension inputs")
    for r, theirs in enumerate(every):
        if theirs != mine:
            raise ValueError(
                f"[rank {collectives.rank()}] unit '{unit.name}': the ranks' fsdp_pre_all_gather inputs differ "
                f"(this rank: {mine}; shard rank {r}: {theirs}); return inputs of the padded shard's shape on every "
                "rank (ceil(rows / shard size) rows), as torch FSDP2 requires")
    for i, sig in pending.items():
        unit.ext[i].sig = sig
