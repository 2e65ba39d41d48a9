"""The loud error for an optimizer that cannot step on fullshard's shards.

[Note: optimizers that see whole tensors]
A parameter sharded by fullshard is, on each rank, some of its dim-0 rows.
An element-wise optimizer (each element's update depends on that element's
gradient and state only: SGD, Adam, AdamW, ...) gives the same step on the
rows as on the whole tensor. Any other (Muon orthogonalizes the matrix,
Adafactor keeps row and column means, LAMB and LARS scale by a tensor norm,
LBFGS takes dot products over all parameters) silently gives another model.
A pre-step callback (core/optim_hooks.py, [Note: optimizer step hooks]),
added when the first unit is built, checks every ``optimizer.step()``: an
optimizer whose exact class is not on :data:`ELEMENTWISE` nor allowed
(``fullshard.optim``'s classes, :func:`allow_elementwise`) raises
:class:`ShardedOptimizerError` at its first step if one of its parameters
is spread over ranks (some rank of its shard group holds fewer than all of
its rows). The verdict is
computed from the layout, so it is the same on every rank, and cached per
optimizer until its parameter groups change.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from . import collectives, optim_hooks, registry
from .placement import ShardInfo, shard_info

ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop, torch.optim.SparseAdam,
})
"""torch's element-wise optimizers (exact classes; ``foreach`` and ``fused`` variants included)."""

_ALLOWED: set = set()
# optimizer -> (its parameter groups' structure, the error message or None): optim_hooks.per_optimizer
_VERDICTS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
# Replacements by optimizer class name.
_REPLACEMENTS = {"muon": "fullshard.optim.Muon (with shard_placement_fn=fullshard.optim.muon_placement_fn(model))",
                 "adafactor": "fullshard.optim.Adafactor", "lamb": "fullshard.optim.Lamb"}


class ShardedOptimizerError(RuntimeError):
    """An optimizer that needs whole tensors stepped on parameters spread over ranks."""


def allow_elementwise(cls: type) -> type:
    """Let optimizer class ``cls`` step on fullshard's shards (exact class,
    not its subclasses). Use it for an optimizer whose update of each
    element depends only on that element's gradient and state, or whose
    parameters you placed so it sees what it needs. Returns ``cls``, so it
    works as a class decorator.

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"allow_elementwise takes a torch.optim.Optimizer subclass, got {cls!r}")
    _ALLOWED.add(cls)
    _VERDICTS.clear()
    return cls


def shard_aware(cls: type) -> type:
    """Mark ``cls`` (a ``fullshard.optim`` class) as stepping correctly on shards; returns it."""
    _ALLOWED.add(cls)
    _VERDICTS.clear()
    return cls


def disallow(cls: type) -> None:
    """Undo :func:`allow_elementwise` for ``cls``."""
    _ALLOWED.discard(cls)
    _VERDICTS.clear()


def install() -> None:
    """Add the step checks to the optimizer pre-step callbacks (idempotent)."""
    optim_hooks.add_pre_step("replaced parameters", _check_replaced)
    optim_hooks.add_pre_step("sharded optimizer", _check_step)
    optim_hooks.add_pre_step("torch grad scaler", _check_scaler)


def describe(param: torch.Tensor, info: ShardInfo) -> str:
    """``'<name>' of unit '<unit>'`` for messages (``info.fqn`` is relative to its unit)."""
    unit = registry.holder(param)
    return f"'{info.fqn}' of unit '{unit}'" if unit is not None else f"'{info.fqn}'"


def _spread(info) -> bool:
    """Some rank of the shard group holds fewer than all rows (rank-independent)."""
    if info is None or info.world == 1:
        return False
    rows = info.rows
    return any(hi - lo != rows for lo, hi in zip(info.bounds, info.bounds[1:]))


def _problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The error message for ``optimizer``, or None when it may step."""
    spread = [(p, info) for g in optimizer.param_groups for p in g["params"]
              for info in [shard_info(p)] if _spread(info)]
    if not spread:
        return None
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    name = f"torch.optim.{cls.__qualname__}" if cls.__module__.startswith("torch.optim") else name
    param, first = spread[0]
    lo, hi = first.row_range
    more = f" and {len(spread) - 1} more" if len(spread) > 1 else ""
    fix = next((f"use {r}" for k, r in _REPLACEMENTS.items() if k in cls.__qualname__.lower()), None)
    if fix is None:
        fix = ("use an element-wise optimizer (torch.optim.SGD, Adam, AdamW, ...) or one of fullshard.optim "
               "(Muon, Adafactor, Lamb)")
    return (f"[rank {collectives.rank()}] {name} is not element-wise and steps on parameters sharded by fullshard: "
            f"{describe(param, first)} (shape {tuple(first.shape)}) is sharded over {first.world} ranks (this rank "
            f"holds rows [{lo}, {hi}) of {first.rows} along dim {first.dim})"
            f"{more}, so its step would differ from one device's; {fix}; if {cls.__qualname__} updates each element "
            f"from that element's gradient and state only, call fullshard.optim.allow_elementwise({name})")


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    cls = type(optimizer)
    if cls in ELEMENTWISE or cls in _ALLOWED:
        return None
    problem = optim_hooks.per_optimizer(_VERDICTS, optimizer, _problem)
    if problem is not None:
        raise ShardedOptimizerError(problem)
    return None


# optimizer -> (its parameter groups' structure, the _replaced message or None): optim_hooks.per_optimizer
_REPLACED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def _replaced(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The error for an optimizer holding original parameters that sharding replaced, or None."""
    old = [hit for g in optimizer.param_groups for p in g["params"]
           for hit in [registry.taken(p)] if hit is not None and registry.find(p) is None]
    if not old:
        return None
    unit, fqn = old[0]
    more = f" and {len(old) - 1} more" if len(old) > 1 else ""
    return (f"[rank {collectives.rank()}] {type(optimizer).__name__} holds parameter '{fqn}' of unit '{unit}'{more} "
            "as it was before sharding: sharding replaced it, so it gets no gradient and the step would leave the "
            "model untrained; create the optimizer after FullyShardedDataParallel(...) / fully_shard(...), from "
            "model.parameters()")


def _check_replaced(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Refuse a step of an optimizer made before the model was sharded (DDP trains such a one).

    Raises:
        RuntimeError: the optimizer holds parameters a unit took and replaced.
    """
    problem = optim_hooks.per_optimizer(_REPLACED, optimizer, _replaced)
    if problem is not None:
        raise RuntimeError(problem)
    return None


# optimizer -> (its parameter groups' structure, _holds_plain_shards): optim_hooks.per_optimizer
_PLAIN_SHARDS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def _holds_plain_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps a plain (not DTensor) parameter sharded over more than one rank."""
    return any(found is not None and found[1].spec is None and collectives.group_size(found[0].cfg.shard_group) > 1
               for g in optimizer.param_groups for p in g["params"] for found in [registry.find(p)])


def _check_scaler(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Refuse a step that ``torch.amp.GradScaler.step`` drives over the wrapper's gradient shards.

    [Note: torch's GradScaler over plain shards]
    ``torch.amp.GradScaler`` looks for inf/NaN in the gradients this rank
    holds. Under ``FullyShardedDataParallel`` those are plain tensors holding
    this rank's shard, so an overflow in one rank's shard makes that rank
    skip the step and halve its scale while the others step: the ranks'
    models part (0.036 off DDP in an audit). Under ``fully_shard`` the
    gradients are DTensors and torch reduces the check over the mesh.
    ``fullshard.ShardedGradScaler`` all-reduces it. torch's scaler is found
    by its method's frame on the stack (``_maybe_opt_step`` calls
    ``optimizer.step``): it has no hook, and nothing on the optimizer names it. A rank whose
    scaler skipped the step never gets here, so the refusal comes at the
    first step any rank takes.

    Raises:
        RuntimeError: ``torch.amp.GradScaler`` steps an optimizer over plain gradient shards split over ranks.
    """
    if not optim_hooks.per_optimizer(_PLAIN_SHARDS, optimizer, _holds_plain_shards):
        return None
    from torch.amp.grad_scaler import GradScaler

    # By code object, not f_locals: reading a frame's locals caches them on the frame, which would keep
    # the caller's objects (the model) alive after the caller deleted them.
    scaler_code = (GradScaler._maybe_opt_step.__code__, GradScaler.step.__code__)
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code in scaler_code:
            raise RuntimeError(
                f"[rank {collectives.rank()}] torch.amp.GradScaler steps an optimizer over FullyShardedDataParallel's "
                "gradient shards: each rank checks only its own shard for inf/NaN, so ranks would disagree on "
                "skipping a step; use fullshard.ShardedGradScaler (the same interface)")
        frame = frame.f_back
    return None
