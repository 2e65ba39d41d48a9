"""The global gradient norm of a sharded model (``clip_grad_norm_``): which
gradients each rank counts, and their norm over the root unit's groups.

One clipping (:func:`clip_`) behind every caller: ``fullshard.clip_grad_norm_``
(parameters one by one, or a root module), ``FullyShardedDataParallel.clip_grad_norm_``
and the trainer (through the public function). They differ only in which
gradient elements each rank counts and over which groups they are summed
(the parts of :func:`reduced_norm`). The scaling is
``torch.nn.utils.clip_grads_with_norm_``'s: each gradient times the 0-dim fp32
coefficient, so a low-precision gradient is multiplied in fp32 and rounded once.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import collectives, invariant, registry, state, torch_private
from .module import UnitModule
from .params import local_of


def counted_grads(unit) -> list[torch.Tensor]:
    """This rank's gradient shards of ``unit`` that the norm counts (plain
    tensors, slot order): all of them, or none at a replicate-group rank
    other than 0 (a replica holds the same rows)."""
    rep = unit.cfg.replicate_group
    if rep is not None and collectives.group_rank(rep) != 0:
        return []
    return [g for g in (slot.grad() for slot in unit.slots) if g is not None]


def grads_by_kind(runtimes, params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients of sharded parameters this rank counts in the norm
    (:func:`counted_grads`, unit by unit); gradients of unmanaged parameters)."""
    sharded_ids, counted = set(), []
    for rt in runtimes:
        sharded_ids.update(id(slot.sharded) for slot in rt.unit.slots)
        counted += counted_grads(rt.unit)
    local = [p.grad for p in params if id(p) not in sharded_ids and p.grad is not None]
    return counted, local


def grad_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One plain gradient's ``norm_type`` norm as :func:`reduced_norm` takes
    it (computed in fp32, 0-dim on the host); what ``known`` holds."""
    return torch.linalg.vector_norm(grad.float(), norm_type).cpu()


def _norm_part(grads: list[torch.Tensor], norm_type: float, known: Optional[dict] = None) -> torch.Tensor:
    # An empty shard (fewer rows than ranks) adds nothing; the inf norm of an
    # empty tensor is an error (no identity for max), which would leave the
    # other ranks waiting in the all-reduce.
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    known = known or {}
    norms = torch.stack([_known_or_norm(g, norm_type, known) for g in grads])
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _known_or_norm(grad: torch.Tensor, norm_type: float, known: dict) -> torch.Tensor:
    found = known.get(id(grad))
    return found[1] if found is not None and found[0] is grad else grad_norm(grad, norm_type)


def _powered(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """|g|**p of every element as one float64 vector (exact for p = 2 and
    fp32 / bf16 / fp16 gradients: the square of a 24-bit mantissa fits in 53)."""
    parts = [local_of(g).detach().reshape(-1).to("cpu", torch.float64).abs() for g in grads if g.numel()]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    cat = torch.cat(parts)
    return cat.square() if norm_type == 2.0 else cat.pow(norm_type)


def _exact_norm(grads: list[torch.Tensor], norm_type: float, groups: list) -> float:
    """The p-th power of the ``norm_type`` norm of ``grads`` summed over
    ``groups`` with :func:`~fullshard.core.invariant.exact_sum` (the same
    bits however the elements are split over ranks)."""
    return invariant.exact_sum(_powered(grads, norm_type), groups)


def reduced_norm(parts: list[tuple[tuple, list[torch.Tensor]]], norm_type: float,
                 exact: bool = False, known: Optional[dict] = None) -> torch.Tensor:
    """The ``norm_type`` norm of every gradient element of ``parts``: each
    part is (the groups its contribution is summed over, max for inf, in
    that order; this rank's plain gradient tensors). Parts add up in the
    order given, which every rank must share, with the same groups: a rank
    holding no gradient of a part still takes part in its reductions.
    Empty tensors contribute nothing (the inf norm of an empty tensor is an
    error, which would leave the other ranks waiting). ``known``: id(gradient)
    -> (that gradient, its :func:`grad_norm`) computed earlier (while backward
    ran), used for that very tensor; the result has the same bits.

    ``exact`` (``world_size_invariant`` units, p < inf): the p-th powers are
    summed exactly (core/invariant.py :func:`exact_sum`), so the norm does
    not depend on how the elements are split over ranks.

    Returns:
        0-dim fp32 tensor on the host, identical on every rank of the groups.
    """
    is_inf = norm_type == float("inf")
    if exact and not is_inf:
        value = sum(_exact_norm(grads, norm_type, list(groups)) for groups, grads in parts)
        return torch.tensor(value ** (1.0 / norm_type), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32)
    for groups, grads in parts:
        part = _norm_part(grads, norm_type, known)
        for group in groups:
            collectives.all_reduce(part, group, "max" if is_inf else "sum", tag="gradient norm")
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


def _shard_groups(t) -> list:
    """Process groups of the mesh dimensions a DTensor is sharded over (its
    norm contributions are summed over them; replicated dimensions hold
    copies and are not).

    Raises:
        ValueError: a ``Partial`` placement (a gradient not yet reduced).
    """
    groups = []
    for dim, dt_placement in enumerate(t.placements):
        if dt_placement.is_partial():
            raise ValueError(f"clip_grad_norm_: a gradient is a Partial DTensor ({t.placements}); reduce it "
                             "(redistribute to Shard or Replicate) before clipping")
        if not dt_placement.is_replicate():  # Shard, and _StridedShard (FSDP + TP), whose is_shard() is False
            groups.append(t.device_mesh.get_group(dim))
    return groups


def _plain_groups(param) -> tuple:
    """The shard group of a plain parameter a unit registered (the wrapper's
    shards; replicas of HSDP hold the same rows), else none."""
    if isinstance(param, DTensor):
        return ()
    found = registry.find(param)
    if found is None or found[0].world == 1:
        return ()
    return (found[0].cfg.shard_group,)


def _placement_parts(params: list[nn.Parameter]) -> list[tuple[tuple, list[torch.Tensor]]]:
    """:func:`reduced_norm`'s parts for parameters taken one by one: each
    DTensor gradient summed over the mesh dimensions it is sharded on, a
    plain one over :func:`_plain_groups`; grouped by those groups in order
    of first appearance (the same on every rank)."""
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = tuple(_shard_groups(g)) if isinstance(g, DTensor) else _plain_groups(p)
        by_groups.setdefault(key, []).append(local_of(g))
    return list(by_groups.items())


def _root_parts(rt, params: list[nn.Parameter]) -> list[tuple[tuple, list[torch.Tensor]]]:
    """:func:`reduced_norm`'s parts for a root unit's model: the shard
    gradients each rank counts (:func:`grads_by_kind`, in the root's unit
    order) summed over the root's groups, replicate group first, then the
    unmanaged (replicated) gradients once."""
    if any(slot.spec is not None and slot.spec.full_mesh is not None
           for r in rt.root.runtimes for slot in r.unit.slots):
        # Tensor-parallel parameters: a local gradient is also one TP part, to sum over the TP mesh dims too.
        return _placement_parts([p for p in params if p.grad is not None])
    counted, local = grads_by_kind(rt.root.runtimes, params)
    cfg = rt.unit.cfg
    return [(tuple(collectives.multi_rank_groups(cfg.shard_group, cfg.replicate_group)), counted), ((), local)]


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool) -> None:
    """Multiply every plain gradient in place by the 0-dim fp32 ``coef``:
    with ``foreach`` one fused call per (device, dtype), as
    ``torch.nn.utils.clip_grads_with_norm_`` does (on CPU it runs the same
    per-tensor ``mul_``), else gradient by gradient."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_kind.items():
        on_device = coef.to(device)
        if foreach:
            torch_private.foreach_mul_(group, on_device)
        else:
            for g in group:
                g.mul_(on_device)


def clip_(params: list[nn.Parameter], parts: list[tuple[tuple, list[torch.Tensor]]], max_norm: float,
          norm_type: float, exact: bool, error_if_nonfinite: bool = False, foreach: bool = False) -> torch.Tensor:
    """The one gradient clipping of fullshard: the :func:`reduced_norm` of
    ``parts`` (which gradient elements each rank counts, summed over which
    groups), then every gradient of ``params`` (its local tensor for a
    DTensor) multiplied by torch's coefficient ``min(1, max_norm / (norm +
    1e-6))``. ``foreach``: scale through fused calls (what
    ``FullyShardedDataParallel.clip_grad_norm_`` has always done, through
    ``torch.nn.utils.clip_grads_with_norm_``) rather than gradient by
    gradient (``fullshard.clip_grad_norm_``); kept per caller so each
    keeps its bits on every device.

    Returns:
        The total norm before clipping: 0-dim fp32 tensor on the host.
    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf
            (on every rank: the norm is the same on all).
    """
    total = reduced_norm(parts, norm_type, exact)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(f"[rank {collectives.rank()}] The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this error and scale the "
                           "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    scale_grads_(params, clip_coef(total, max_norm), foreach)
    return total


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip coefficient ``min(1, max_norm / (total + 1e-6))`` (0-dim
    fp32; nan for a nan norm, 0 for an inf one): exactly 1 leaves every
    gradient's bits as they are."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def scale_grads_(params: list[nn.Parameter], coef: torch.Tensor, foreach: bool = False) -> None:
    """Multiply every gradient of ``params`` (its local tensor) in place by ``coef`` (see :func:`clip_`)."""
    _scale_([local_of(p.grad) for p in params if p.grad is not None], coef, foreach)


def root_norm(rt, params: list[nn.Parameter], norm_type: float, known: Optional[dict] = None) -> torch.Tensor:
    """The norm :func:`clip_root_` clips by, without clipping (``known``: see :func:`reduced_norm`)."""
    return reduced_norm(_root_parts(rt, params), norm_type, rt.unit.cfg.invariant_layout is not None, known)


def clip_root_(rt, params: list[nn.Parameter], max_norm: float, norm_type: float,
               error_if_nonfinite: bool = False, foreach: bool = False) -> torch.Tensor:
    """:func:`clip_` of the model whose root unit's runtime is ``rt``
    (``params``: all of its parameters) by its global norm: each gradient
    element counted once, shards summed over the root's groups, so a
    nested unit on a smaller group (a per-rank expert) counts each
    instance once, as torch FSDP1 does; ``world_size_invariant`` roots sum
    exactly. The caller checks the model is idle."""
    return clip_(params, _root_parts(rt, params), max_norm, norm_type, rt.unit.cfg.invariant_layout is not None,
                 error_if_nonfinite, foreach)


def _idle_root(model: UnitModule, what: str):
    """``model``'s runtime after checking it is a root and idle.

    Raises:
        RuntimeError: ``model`` is a nested unit, or busy (forward/backward).
    """
    model._lazy_init()
    rt = model._runtime
    if not rt.is_root:
        raise RuntimeError(f"[rank {collectives.rank()}] {what} of a module must be called on the root module "
                           "(the outermost fully_shard / FullyShardedDataParallel one); pass parameters() to clip "
                           "only some")
    state.require_idle(rt.root, what)
    return rt


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models, returning the
    global norm as a plain tensor: every rank gets the same value (torch's
    returns a DTensor, ``Partial`` for the inf norm, whose ``.item()`` is
    the rank's local maximum), gradients on several meshes and plain ones
    (replicated, or ``FullyShardedDataParallel``'s shards, summed over their
    shard group) may be mixed, and empty shards are skipped; with
    parameters of ``world_size_invariant`` units the sum is exact
    (:func:`reduced_norm`). Each gradient is multiplied in place by
    ``min(1, max_norm / (norm + 1e-6))``, torch's coefficient.

    ``parameters`` may also be a root module (``fully_shard`` or
    ``FullyShardedDataParallel``; fullshard's extension): its gradients
    are clipped by the norm ``FullyShardedDataParallel.clip_grad_norm_``
    computes (the same summation order, so both front doors give the same
    bits), after checking the model is between iterations.

    Args:
        parameters: tensors or DTensors (e.g. ``model.parameters()``), or a
            root module.
        max_norm: the norm to clip to.
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise when the norm is nan or inf (torch's).
    Returns:
        The total norm before clipping: 0-dim fp32 tensor on the host.
    Raises:
        ValueError: a ``Partial`` DTensor gradient.
        RuntimeError: ``error_if_nonfinite`` and a non-finite norm; a
            module that is not a root, or is in forward or backward.
    """
    if isinstance(parameters, UnitModule):
        rt = _idle_root(parameters, "clip_grad_norm_()")
        return clip_root_(rt, list(parameters.parameters()), max_norm, float(norm_type), error_if_nonfinite)
    params = [p for p in parameters if p.grad is not None]
    exact = any(invariant.is_marked(p) for p in params)
    return clip_(params, _placement_parts(params), max_norm, float(norm_type), exact, error_if_nonfinite)
