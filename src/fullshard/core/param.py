"""Parameter-level helpers used at construction and by the public methods:
deferred (meta) materialization, cross-rank consistency, gradient norms over
shards, and full-parameter summoning.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
from . import collectives as C
from . import flat as F
from .tree import map_tensors, tensors_in


def _has_meta(m: nn.Module) -> bool:
    tensors = list(m._parameters.values()) + list(m._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


def has_meta_buffers(m: nn.Module) -> bool:
    return any(b is not None and b.is_meta for b in m._buffers.values())


def rowwise_init(param_init_fn) -> bool:
    """Whether ``param_init_fn`` can initialize row ranges of a parameter
    (``param_init_fn.init_rows(param, row_start, row_end, device)``), so each
    rank materializes only its own shard."""
    return param_init_fn is not None and callable(getattr(param_init_fn, "init_rows", None))


def materialize(modules: list[nn.Module], param_init_fn: Optional[Callable[[nn.Module], None]],
                device: torch.device) -> None:
    """Materialize the meta parameters/buffers that ``modules`` own directly.

    Each module is handled alone (``recurse=False``) so peak memory is one
    unit's full parameters. Tied parameters stay tied: once one owner is
    materialized, every other owner of the same meta tensor gets the new one.

    Raises:
        ValueError: a meta module with neither ``param_init_fn`` nor
            ``reset_parameters``, or meta tensors left after ``param_init_fn``.
    """
    ties: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for attr, p in m._parameters.items():
            if p is not None and p.is_meta:
                ties.setdefault(id(p), []).append((m, attr))
    for m in modules:
        if not _has_meta(m):
            continue
        before = {attr: id(p) for attr, p in m._parameters.items() if p is not None}
        if param_init_fn is not None:
            param_init_fn(m)
        elif hasattr(m, "reset_parameters"):
            m.to_empty(device=device, recurse=False)
            with torch.no_grad():
                m.reset_parameters()
        else:
            raise ValueError(
                f"module {type(m).__name__} has meta-device parameters but no reset_parameters(); "
                "pass param_init_fn=fn(module) to FullyShardedDataParallel to materialize it")
        if _has_meta(m):
            raise ValueError(f"param_init_fn left meta-device tensors on {type(m).__name__}; it must "
                             "materialize the module's own parameters and buffers")
        for attr, old in before.items():
            for other, other_attr in ties.get(old, ()):
                if other is not m or other_attr != attr:
                    other._parameters[other_attr] = m._parameters[attr]


def buffers_of(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [b for m in modules for b in m._buffers.values() if b is not None]


def move_buffers(modules: Iterable[nn.Module], device: torch.device,
                 dtype: Optional[torch.dtype] = None) -> None:
    """Move buffers to ``device``; cast floating-point ones to ``dtype`` if given."""
    for m in modules:
        for name, b in m._buffers.items():
            if b is None:
                continue
            to_dtype = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if b.device != device or b.dtype != to_dtype:
                m._buffers[name] = b.to(device, to_dtype)


class _InputCaster:
    """Casts floating-point tensors in a unit's forward inputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return map_tensors(self._cast, args), map_tensors(self._cast, kwargs)


def input_caster(mp) -> Optional[_InputCaster]:
    """The forward-input caster for a MixedPrecision policy, or None."""
    if mp.param_dtype is None or not mp.cast_forward_inputs:
        return None
    return _InputCaster(mp.param_dtype)


class FullPrecisionRun:
    """Runs a full-precision unit inside a low-precision model: inputs cast up
    to ``dtype``, floating-point outputs cast back to the dtype of the first
    floating-point input (see ``MixedPrecision.full_precision_module_classes``)."""

    def __init__(self, dtype: torch.dtype):
        self.up = _InputCaster(dtype)

    def __call__(self, fn, args: tuple, kwargs: dict):
        dtypes = [t.dtype for t in tensors_in((args, kwargs)) if t.is_floating_point()]
        args, kwargs = self.up(args, kwargs)
        out = fn(*args, **kwargs)
        if not dtypes or dtypes[0] == self.up.dtype:
            return out
        return map_tensors(_InputCaster(dtypes[0])._cast, out)


def _multi_rank(shard_group, replicate_group) -> list:
    """The unit's groups that span more than one rank, replicate group first."""
    return [g for g in (replicate_group, shard_group) if g is not None and C.group_size(g) > 1]


@torch.no_grad()
def broadcast_from_first(tensors: list[torch.Tensor], shard_group, replicate_group) -> None:
    """Overwrite every rank's tensors with those of the unit's first rank
    (``sync_module_states``; see ``collectives.is_first_rank``): over the
    replicate group from its rank 0, then over the shard group from its rank 0.

    Replicate group first, as torch FSDP1 does: in a HYBRID_SHARD layout
    (replicas hold the same shard rank) the shard groups' rank-0 ranks form
    one replicate group, so after the first broadcast they all hold its rank
    0's values, and the second spreads exactly those. Only the unit's ranks
    take part: units on other groups construct independently.
    """
    for group in _multi_rank(shard_group, replicate_group):
        for t in tensors:
            C.broadcast(t.data, 0, group, tag="sync_module_states")


@torch.no_grad()
def check_same_across_ranks(named: list[tuple[str, torch.Tensor]], shard_group, replicate_group,
                            unit: str) -> None:
    """Compare three strided fp64 checksums per parameter across the ranks
    that hold the unit with one small all-reduce (max of [v, -v]) per group
    (replicate, then shard: the maximum over a HYBRID_SHARD layout). Every
    such rank reaches the same verdict.

    Raises:
        ValueError: naming the first parameter whose checksums differ.
    """
    groups = _multi_rank(shard_group, replicate_group)
    if not named or not groups:
        return
    sums = []
    for _, p in named:
        # Strided sums: position-sensitive without allocating a copy.
        t = p.detach().reshape(-1)
        sums += [t.sum(dtype=torch.float64), t[::7].sum(dtype=torch.float64),
                 t[1::3].sum(dtype=torch.float64)]
    v = torch.stack(sums).cpu()
    both = torch.cat([v, -v])
    for group in groups:
        C.all_reduce(both, group, "max", tag=f"unit '{unit}' construction check")
    hi, lo = both[:v.numel()], -both[v.numel():]
    bad = (hi != lo).nonzero()
    if bad.numel():
        name = named[int(bad[0]) // 3][0]
        ranks = sorted({r for g in groups for r in C.group_ranks(g)})
        raise ValueError(
            f"[rank {C.rank()}] unit '{unit}': parameter '{name}' differs across ranks {ranks} (the unit's "
            "process group) at construction; initialize with the same seed on each of them or pass "
            "sync_module_states=True")


def grads_by_kind(units, params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                    list[torch.Tensor]]:
    """(gradients of sharded parameters this rank counts in the norm, those
    a replica with replicate-group rank 0 counts instead, gradients of
    unmanaged parameters)."""
    sharded_ids, counted, replica = set(), [], []
    for rt in units:
        rep = rt.unit.cfg.replicate_group
        mine = rep is None or C.group_rank(rep) == 0
        for sp in rt.unit.sharded_params:
            sharded_ids.add(id(sp))
            if sp.grad is not None:
                (counted if mine else replica).append(sp.grad)
    local = [p.grad for p in params if id(p) not in sharded_ids and p.grad is not None]
    return counted, replica, local


def _norm_part(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type).cpu() for g in grads])
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def global_norm(counted: list[torch.Tensor], local: list[torch.Tensor], shard_group, replicate_group,
                norm_type: float) -> torch.Tensor:
    """Total ``norm_type`` norm of all gradients of a model whose root unit is
    on ``shard_group`` / ``replicate_group``: the ``counted`` shard
    contributions (each gradient element held by exactly one rank; see
    :func:`grads_by_kind`) are summed (max for inf) over the root's ranks,
    replicate group then shard group; unmanaged gradients are replicated and
    added once."""
    is_inf = norm_type == float("inf")
    part = _norm_part(counted, norm_type)
    for group in _multi_rank(shard_group, replicate_group):
        C.all_reduce(part, group, "max" if is_inf else "sum", tag="gradient norm")
    rest = _norm_part(local, norm_type)
    if is_inf:
        return torch.maximum(part, rest)
    return (part + rest).pow(1.0 / norm_type)


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the 0-dim fp32 ``coef``, one foreach
    call per device; a low-precision gradient is multiplied in fp32 and
    rounded once (as ``torch.nn.utils.clip_grad_norm_`` does)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


def gather_full(unit, flat: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """All-gather ``flat`` (default: the unit's master flat shard; any tensor
    laid out like it, e.g. an optimizer-state flat) over the unit's shard group.

    The one "gather one unit" of the library: ``summon_full_params``, the full
    model state dict and the full optimizer state dict all use it.

    Returns:
        Full-shape views, one per parameter in layout order, of one new
        param-major buffer (``N·S`` elements, ``flat``'s dtype, on the
        compute device). Empty for a unit without parameters (no collective).
    """
    if not unit.layout.params:
        return []
    lay, dev = unit.layout, unit.cfg.compute_device
    src = unit.flat_shard if flat is None else flat
    buf = torch.empty(lay.unsharded_numel, dtype=src.dtype, device=dev)
    C.all_gather(buf, src.to(dev), unit.cfg.shard_group, async_op=False, tag=f"unit '{unit.name}' full gather")
    full = torch.empty_like(buf)
    F.copy_out(full, buf, lay)
    return F.unsharded_views(full, lay)


def _gather_grads(unit) -> list[Optional[torch.Tensor]]:
    """Full gradients of the unit's parameters (None where no rank has one)."""
    lay = unit.layout
    flat = torch.zeros_like(unit.flat_shard)
    has = torch.tensor([float(sp.grad is not None) for sp in unit.sharded_params])
    for view, sp in zip(F.shard_views(flat, lay, unit.rank), unit.sharded_params):
        if sp.grad is not None:
            view.copy_(sp.grad)
    C.all_reduce(has, unit.cfg.shard_group, "max", tag=f"unit '{unit.name}' summon grads")
    full = gather_full(unit, flat)
    return [g if h else None for g, h in zip(full, has.tolist())]


@contextlib.contextmanager
def full_params(units: list, writeback: bool = True, rank0_only: bool = False,
                offload_to_cpu: bool = False, with_grads: bool = False):
    """Gather every unit's full-precision parameters and register them on
    their modules for the duration of the context (see
    ``FullyShardedDataParallel.summon_full_params``). Units an enclosing
    call already summoned are left to it, so nested calls compose."""
    if writeback and rank0_only:
        raise ValueError("summon_full_params: writeback=True with rank0_only=True is not supported (the "
                         "other ranks hold no full parameters to write back); pass writeback=False")
    todo = [u for u in units if not u.summoned]
    gathered = []
    try:
        with torch.no_grad():
            for unit in todo:
                unit.summoned = True
                if not unit.slots:
                    continue
                views = gather_full(unit)
                grads = _gather_grads(unit) if with_grads else [None] * len(unit.slots)
                if rank0_only and not C.is_first_rank(unit.cfg.shard_group, unit.cfg.replicate_group):
                    continue
                if offload_to_cpu:
                    views = [v.cpu() for v in views]
                    grads = [None if g is None else g.cpu() for g in grads]
                unit.hide_full_params()
                full = []
                for view, grad, lay in zip(views, grads, unit.layout.params):
                    full.append(nn.Parameter(view, requires_grad=lay.requires_grad))
                    full[-1].grad = grad
                unit.install_params(full)
                gathered.append((unit, views))
        yield
    finally:
        with torch.no_grad():
            for unit, views in gathered:
                if writeback:
                    F.shard_into(unit.flat_shard, unit.layout, views, unit.rank)
                unit.restore_params()
        for unit in todo:
            unit.summoned = False
