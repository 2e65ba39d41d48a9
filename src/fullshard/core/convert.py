"""Replacing a unit's values after wrapping: dtype conversion
(``model.double()``, ``.half()``, ``.to(torch.bfloat16)``) with the checks
that make it safe, and :func:`adopt`, which takes back the values
``nn.Module._apply`` (``to_empty``, ``.to()``) or
``load_state_dict(assign=True)`` registered in place of the shards
(``fully_shard``).

[Note: conversion after wrapping]
A conversion applies the module function to each unit's master flat shard;
the sharded ``nn.Parameter`` objects stay the same (their ``.data`` becomes a
view of the new shard), so an optimizer made before keeps working, whatever
``torch.__future__`` says about swapping parameters. Dtypes that a
``MixedPrecision`` policy names explicitly (``param_dtype``, ``reduce_dtype``,
``buffer_dtype``) stay in force; those that default to the master dtype
follow it. Device moves are refused (the process groups and the compute
device were chosen for the old device), as is a conversion while a unit is
busy: during forward or backward, between a forward and its backward, inside
``summon_full_params`` and with a ``no_sync`` stash not yet reduced.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator

import torch

from . import collectives, flat, optim_hooks, state, torch_private
from .unit import ShardedState, Unit


def check_convertible(rts: list[state.UnitRuntime], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise unless ``fn`` may convert every unit of ``rts`` now.

    Raises:
        RuntimeError: ``fn`` moves parameters to another device, or a unit is
            busy (see [Note: conversion after wrapping]); one line naming the
            rank, the unit and what to do.
    """
    root = next((rt.root for rt in rts if rt.root is not None), None)
    if root is not None and not torch_private.in_backward_pass() and state.backward_broken(root):
        state.start_iteration(root)  # the last backward raised: start clean, as the next forward would
    for rt in rts:
        unit = rt.unit
        where = f"[rank {collectives.rank()}] unit '{unit.name}'"
        if rt.state is not state.TrainingState.IDLE:
            problem = f"cannot convert parameters during forward or backward (state {rt.state.value})"
            fix = "convert between iterations"
        elif unit.summoned:
            problem, fix = "cannot convert parameters inside summon_full_params()", "leave the context first"
        elif unit.stash.active:
            problem = "cannot convert parameters while gradients accumulated under no_sync() wait to be reduced"
            fix = "run the synchronizing backward (outside no_sync) or zero_grad() first"
        elif unit.state is not ShardedState.SHARDED:
            problem = "cannot convert parameters between a forward and its backward"
            fix = "run the backward first (a forward under torch.no_grad() needs none)"
        else:
            shard = unit.flat_shard
            probe = fn(torch.empty(0, dtype=shard.dtype, device=shard.device))
            if probe.device == shard.device:
                continue
            name = unit.slots[0].fqn if unit.slots else "(none)"
            problem = (f"moving parameters (first: '{name}') from {shard.device} to {probe.device} after "
                       "wrapping is not supported")
            fix = "move the model before FullyShardedDataParallel or pass device_id"
        raise RuntimeError(f"{where}: {problem}; {fix}")


def convert(rt: state.UnitRuntime, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Convert one unit's master shard with ``fn`` (see :func:`convert_shard`)
    and move the post-backward hook to its new unsharded flat parameter.
    Returns True when the master dtype or storage changed."""
    with torch.no_grad():
        for part in rt.unit.side:  # a mixed unit's frozen dtype parts (core/mixed.py)
            convert_shard(part, fn)
        changed = convert_shard(rt.unit, fn)
    if changed:
        rt.rearm_grad_hook()
        for slot in rt.unit.slots:
            sp = slot.sharded
            _CONVERTED[id(sp)] = (weakref.ref(sp, functools.partial(_forget, id(sp))), slot.fqn)
        optim_hooks.add_pre_step("converted state dtype", _check_state_dtypes)
    return changed


def convert_shard(unit: Unit, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Apply an ``nn.Module._apply`` function (``.double()``, ``.half()``,
    ``.to(dtype)``) to ``unit``'s master shard: ``flat_shard`` becomes
    ``fn(flat_shard)``, each sharded parameter (the same ``nn.Parameter``
    object, so an optimizer holding it keeps working) a view of it, and
    gradients, the compute, reduce and gradient dtypes that default to the
    master dtype, and ``flat_full`` follow. The caller checks the unit is
    idle, resharded and holds no ``no_sync`` stash.

    Returns:
        True when ``flat_full`` was replaced (hooks on it must be re-armed).
    Raises:
        RuntimeError: ``fn`` moves the shard to another device, changes
            its shape, or makes it a non-floating-point dtype.
    """
    unit.check_sharded("convert its parameters")
    old = unit.flat_shard
    new = fn(old)
    if new is old:  # nothing to convert; share_memory_() may have moved the storage
        for slot in unit.slots:
            slot.record_view_ptr()
        return False
    if getattr(unit, "packed", False):  # core/packed.py: subclass shards, no flat values to convert
        unit.refuse(f"converting to {new.dtype}")
    if new.device != old.device or new.shape != old.shape or not new.is_floating_point():
        raise RuntimeError(
            f"[rank {collectives.rank()}] unit '{unit.name}': converting the parameters to "
            f"{new.dtype}/{new.device} (shape {tuple(new.shape)}) after wrapping is not supported; only a "
            "floating-point dtype change on the same device is (convert the model before "
            "FullyShardedDataParallel instead)")
    if old.is_pinned() and not new.is_pinned():
        new = new.pin_memory()
    unit.set_shard(new)
    for sp in unit.sharded_params:
        if sp.grad is not None and sp.grad.dtype != unit.grad_dtype:
            sp.grad.data = sp.grad.to(unit.grad_dtype)
    return True


def adopt(unit: Unit) -> bool:
    """Take back what ``nn.Module._apply`` (``to_empty``, ``.to(dtype)``)
    or ``load_state_dict(assign=True)`` registered in place of ``unit``'s
    sharded parameters (``fully_shard``, which lets both run on the model
    as torch FSDP2 does): each registered value is copied into the flat
    shard and the registered parameter made a view of it again. A meta
    shard (``fully_shard`` of a meta module) is allocated on the device the
    values now live on, in their dtype.

    The registered parameter objects stay: an object assigned in place of
    one gives it its value and dtype (``ParamSlot.take_back``), so an
    optimizer made before ``load_state_dict(assign=True)`` still holds the
    parameters the model trains.

    Returns:
        True when ``flat_full`` was replaced (hooks on it must be re-armed).
    Raises:
        ValueError: the new values of one unit differ in dtype or device;
            an assigned value is not this rank's shard.
    """
    if getattr(unit, "packed", False):  # core/packed.py: subclass shards, kept
        unit.adopt()
        return False
    unit.check_sharded("adopt new parameter values")
    for slot in unit.slots:
        wrong = slot.take_back()
        if wrong:
            raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': {wrong}")
    values = [slot.registered_local() for slot in unit.slots]
    if all(v is s.local for v, s in zip(values, unit.slots)):
        return False
    kinds = {(v.dtype, v.device) for v in values}
    if len(kinds) > 1:
        raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': its parameters now have different "
                         f"dtypes or devices {sorted(map(str, kinds))}; one unit needs one of each")
    cfg, shard = unit.cfg, unit.flat_shard
    dtype, device = kinds.pop() if kinds else (shard.dtype, shard.device)
    replace = shard.is_meta or dtype != shard.dtype or (device != shard.device and not cfg.offload_params)
    if device.type != "meta" and not cfg.offload_params and device != cfg.compute_device:
        raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': parameters moved to {device}, but the "
                         f"unit computes on {cfg.compute_device}; keep them on the mesh's device")
    target = unit.new_shard(dtype, torch.device("meta") if device.type == "meta" else None) if replace else shard
    if target.device.type != "meta":
        with torch.no_grad():
            for view, value in zip(flat.shard_views(target, unit.layout, unit.rank), values):
                if not value.is_meta and value is not view:
                    view.copy_(value)
    unit.set_shard(target)
    return True


# id(sharded parameter converted after wrapping) -> (weakref, name); an
# optimizer whose state was made before the conversion is refused at its next
# step. Keyed by id: tensors compare element-wise, so they cannot be dict keys.
_CONVERTED: dict[int, tuple[weakref.ref, str]] = {}


def _forget(key: int, _ref: weakref.ref) -> None:
    _CONVERTED.pop(key, None)


def _check_state_dtypes(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The optimizer pre-step callback added at the first conversion
    ([Note: optimizer step hooks]). Raises RuntimeError when a converted
    parameter's optimizer state (made before the conversion) has another
    floating dtype: torch's optimizers would fail with an opaque dtype error
    or mix precisions."""
    if not _CONVERTED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref, name = _CONVERTED.get(id(p), (None, None))
            if ref is None or ref() is not p:
                continue
            for key, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.is_floating_point() and v.dtype != p.dtype:
                    raise RuntimeError(
                        f"[rank {collectives.rank()}] {type(optimizer).__name__} state '{key}' of parameter "
                        f"'{name}' is {v.dtype}, the parameter was converted to {p.dtype} after the state was made; "
                        "create the optimizer after converting the model (or load its state dict into a new one)")


@contextlib.contextmanager
def sharded_params_hidden(rt: state.UnitRuntime) -> Iterator[None]:
    """Within the context the unit's sharded parameters are ``None`` in their
    owning modules' ``_parameters`` (``nn.Module._apply`` skips None), so
    the module function converts only what the unit does not manage (buffers,
    ignored parameters); positions in ``_parameters`` are kept."""
    unit = rt.unit
    owners = [(module, attr, slot.sharded) for part in (unit, *unit.side) for slot in part.slots
              for module, attr in slot.owners]
    for module, attr, _ in owners:
        module._parameters[attr] = None
    try:
        yield
    finally:
        for module, attr, sp in owners:
            module._parameters[attr] = sp
