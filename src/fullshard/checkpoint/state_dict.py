"""Model state dicts of a wrapped model, torch FSDP1's contract: the
state-dict type and configs of each unit, and the values a unit registers
(``module_hooks.py`` runs them through ``nn.Module.state_dict``, see its
[Note: state dicts through nn.Module]).

FULL_STATE_DICT (the default): full tensors under the original names, the
same keys, order and shapes as the plain model's ``state_dict()``, each unit
gathered by ``core.gather.gather_full`` when ``nn.Module``'s walk reaches it
(the tensors are copied out, the gathered buffer freed). SHARDED_STATE_DICT: each managed
parameter is a ``DTensor`` placed ``Shard(0)`` on a 1-D mesh over the unit's
shard group whose local tensor is this rank's shard view (no copy), so
``torch.distributed.checkpoint`` writes, reads and reshards it.

[Note: state-dict values]
* Buffers and parameters no unit manages (``ignored_modules``) are plain,
  replicated tensors in both forms.
* 0-dim parameters are stored whole by shard-group rank 0 (``torch.chunk``
  gives every other rank zero rows); the sharded form broadcasts them and
  uses a plain (replicated) tensor, as DTensor cannot shard a 0-dim tensor.
* NO_SHARD units (one-rank shard groups) hold whole parameters: plain tensors.
* HYBRID_SHARD is not supported by SHARDED_STATE_DICT (a clear error); the
  full form works for every strategy.
"""
from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Iterator, Optional

import torch
import torch.nn as nn

from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from ..construct import WRAPPER_SEGMENTS
from ..core import collectives, placement, state
from ..core.module import unit_modules


@dataclasses.dataclass(frozen=True)
class Settings:
    """The state-dict type of one unit and its two configs."""

    type: StateDictType = StateDictType.FULL_STATE_DICT
    config: object = FullStateDictConfig()
    optim_config: object = FullOptimStateDictConfig()


# State-dict type -> (its config class, its optimizer config class).
_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}

# Unit -> Settings; kept here, never as attributes on the user's modules.
_SETTINGS: "weakref.WeakKeyDictionary[nn.Module, Settings]" = weakref.WeakKeyDictionary()
# shard group (held weakly: a destroyed group's entry goes with it) -> device
# type -> its 1-D DeviceMesh: a unit's DTensors live on a mesh over its own group.
_MESHES: "weakref.WeakKeyDictionary[object, dict[str, object]]" = weakref.WeakKeyDictionary()


def settings(model: nn.Module) -> Settings:
    return _SETTINGS.get(model, Settings())


def set_state_dict_type(model: nn.Module, sd_type: StateDictType, config=None, optim_config=None) -> Settings:
    """Set the state-dict type of every unit in ``model``; returns the previous one (of the first unit).

    Raises:
        RuntimeError: a config of another state-dict type (torch FSDP1's type).
        ValueError: ``sd_type`` is not a StateDictType, ``model`` holds no
            FullyShardedDataParallel unit, or a ``fully_shard`` unit (see
            :func:`refuse_fully_shard`).
    """
    if not isinstance(sd_type, StateDictType):
        raise ValueError(f"state_dict_type must be a fullshard.StateDictType, got {sd_type!r}")
    want = _CONFIGS[sd_type]
    config = config if config is not None else want[0]()
    optim_config = optim_config if optim_config is not None else want[1]()
    if not isinstance(config, want[0]) or not isinstance(optim_config, want[1]):
        raise RuntimeError(f"{sd_type.value} takes {want[0].__name__} and {want[1].__name__}; got "
                           f"{type(config).__name__} and {type(optim_config).__name__}")
    units = unit_modules(model)
    if not units:
        raise ValueError("set_state_dict_type: the module holds no FullyShardedDataParallel unit")
    refuse_fully_shard(model, "FSDP.state_dict_type()")
    prev = settings(units[0])
    for u in units:
        _SETTINGS[u] = Settings(sd_type, config, optim_config)
    return prev


def refuse_fully_shard(model: nn.Module, what: str) -> None:
    """The FSDP1 state-dict helpers on a model made by ``fully_shard``: its
    ``state_dict()`` is always DTensor shards (torch FSDP2's contract, which
    a state-dict type cannot change) and its optimizer state is DTensors, so
    these helpers would hand back the sharded form under a name promising
    another (torch FSDP1's helpers do nothing there at all).

    Raises:
        ValueError: ``model`` holds a ``fully_shard`` unit; names it and
            ``torch.distributed.checkpoint.state_dict``'s equivalents.
    """
    for u in unit_modules(model):
        if u.dtensor_params:
            raise ValueError(
                f"[rank {collectives.rank()}] {what}: unit '{u.unit.name}' was made by fully_shard, whose state "
                "dicts follow torch FSDP2 (model.state_dict() is DTensor shards); use "
                "torch.distributed.checkpoint.state_dict: get_state_dict / set_state_dict, get_optimizer_state_dict "
                "/ set_optimizer_state_dict with StateDictOptions(full_state_dict=True) for full tensors")


_DSD_MODULE = "torch.distributed.checkpoint.state_dict"


def refuse_torch_optimizer_api(unit_module: nn.Module) -> None:
    """Called from ``FullyShardedDataParallel._fqn_modifiers``, the hook
    through which ``torch.distributed.checkpoint.state_dict`` enters a model
    (its ``_verify_options`` walks the modules first). That API reads a
    wrapper's optimizer state as ``optimizer.state_dict()`` holds it: plain
    tensors of this rank's rows under full names, of which ``dcp.save``
    writes one rank's (the shape of a shard) as the whole state, without an
    error. Its model state is right (the wrapper's ``state_dict()``: full
    tensors), so only calls that take optimizers are refused.

    Raises:
        ValueError: called under a ``torch.distributed.checkpoint.state_dict``
            call that was given optimizers.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_verify_options" and frame.f_globals.get("__name__") == _DSD_MODULE:
            if frame.f_locals.get("optims"):
                raise ValueError(
                    f"[rank {collectives.rank()}] torch.distributed.checkpoint.state_dict with an optimizer on "
                    f"FullyShardedDataParallel (unit '{unit_module.unit.name}'): torch reads the optimizer's "
                    "per-rank shards as whole tensors and a checkpoint of them holds one rank's rows; use "
                    "fullshard.checkpoint.save / load, or FSDP.optim_state_dict / FSDP.optim_state_dict_to_load "
                    "(with FSDP.state_dict_type), or build the model with fullshard.fully_shard")
            return
        frame = frame.f_back


def restore(model: nn.Module, prev: Settings) -> None:
    for u in unit_modules(model):
        _SETTINGS[u] = prev


# ------------------------------------------------------------------ structure
def walk(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, module)`` in ``state_dict()`` order, wrapper segments dropped;
    shared modules appear under every name, as in ``nn.Module.state_dict``."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from walk(child, prefix if name in WRAPPER_SEGMENTS else f"{prefix}{name}.")


@dataclasses.dataclass
class Entry:
    """One state-dict key: a managed parameter (its ``Unit`` and
    ``ParamSlot``), or a plain tensor."""

    key: str
    is_buffer: bool
    unit: Optional[object] = None
    slot: Optional[object] = None
    tensor: Optional[torch.Tensor] = None


def entries(root: nn.Module) -> tuple[list, list[Entry]]:
    """(Unit objects under ``root`` in module order, each followed by its dtype
    parts (core/mixed.py), every state-dict entry in order)."""
    units = [part for u in unit_modules(root) for part in (u.unit, *u.unit.side)]
    owner = {}
    for unit in units:
        for slot in unit.slots:
            for module, attr in slot.owners:
                owner[(id(module), attr)] = (unit, slot)
    out = []
    for prefix, m in walk(root):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            ref = owner.get((id(m), attr))
            out.append(Entry(prefix + attr, False, *ref) if ref else Entry(prefix + attr, False, tensor=p))
        for attr, b in m._buffers.items():
            if b is not None and attr not in m._non_persistent_buffers_set:
                out.append(Entry(prefix + attr, True, tensor=b))
    return units, out


def first_rank(model: nn.Module) -> bool:
    """Whether this rank keeps ``rank0_only`` state dicts of ``model`` (a
    unit): the first rank of its groups (``collectives.is_first_rank``),
    global rank 0 for the world, rank 2 for a model on ranks {2, 3}."""
    cfg = model.unit.cfg
    return collectives.is_first_rank(cfg.shard_group, cfg.replicate_group)


def check_idle(model: nn.Module, what: str) -> None:
    """``core.state.require_idle`` for the units under ``model`` (a unit, or a
    plain module holding units); a root not yet initialized is idle.

    Raises:
        RuntimeError: a forward or backward is in flight.
    """
    for u in unit_modules(model, root_only=True):
        if u._runtime.root is not None:
            state.require_idle(u._runtime.root, what)


# ------------------------------------------------------------------- values
def copy_value(t: torch.Tensor, offload: bool) -> torch.Tensor:
    return t.detach().to("cpu", copy=True) if offload else t.detach().clone()


def check_shardable(unit) -> None:
    if unit.cfg.replicate_group is not None and unit.world > 1:
        raise NotImplementedError(
            f"[rank {collectives.rank()}] unit '{unit.name}': SHARDED_STATE_DICT does not support HYBRID_SHARD; "
            "use FULL_STATE_DICT, or FULL_SHARD / SHARD_GRAD_OP / NO_SHARD")


def shard_value(unit, slot, local: torch.Tensor, offload: bool, shape: Optional[torch.Size] = None) -> torch.Tensor:
    """The sharded-state-dict value of ``slot`` (a ``ParamSlot`` of ``unit``)
    whose local rows are ``local`` (shape ``slot.layout.local_shape(rank)``,
    or ``(local rows, *shape[1:])`` for a per-row value of another full
    ``shape``, e.g. Adafactor's ``(R, 1)`` row statistics): a ``DTensor(Shard(0))``, or a plain full tensor for
    NO_SHARD units and 0-dim parameters (see [Note: state-dict values])."""
    lay = slot.layout
    shape = lay.shape if shape is None else torch.Size(shape)
    if unit.world == 1:
        return (local.detach().to("cpu", copy=True) if offload else local.detach()).view(shape)
    if len(lay.shape) == 0:
        t = local.detach().reshape(-1)[:1].clone() if local.numel() else local.new_zeros(1)
        collectives.broadcast(t, 0, unit.cfg.shard_group, tag=f"unit '{unit.name}' state dict")
        return t.view(()).cpu() if offload else t.view(())
    from torch.distributed.tensor import DTensor, Shard

    chunk = placement.row_bounds(placement.RowShard(), lay.rows, unit.world)
    if lay.bounds != chunk:  # block or owned rows: the checkpoint holds torch.chunk rows, as for any other
        local = rechunk(unit, local.detach(), lay.bounds, chunk)
    local = local.detach().to("cpu", copy=True) if offload else local.detach()
    meshes = _MESHES.setdefault(unit.cfg.shard_group, {})
    if local.device.type not in meshes:
        meshes[local.device.type] = collectives.device_mesh(unit.cfg.shard_group, local.device.type)
    return DTensor.from_local(local, meshes[local.device.type], [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def local_rows(unit, slot, value: torch.Tensor, key: str) -> torch.Tensor:
    """This rank's rows of ``value`` (a full tensor, or a DTensor laid out as
    ours) of ``slot``'s parameter (a ``ParamSlot`` of ``unit``) or of a
    per-row value with other trailing dimensions (dim 0 is the parameter's
    rows).

    Raises:
        ValueError: a DTensor whose local shard is not this rank's ``torch.chunk`` rows.
    """
    lay = slot.layout
    trailing = tuple(value.shape[1:]) if len(lay.shape) else tuple(lay.shape[1:])
    want = torch.Size((lay.local_rows(unit.rank), *trailing))
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        chunk = placement.row_bounds(placement.RowShard(), lay.rows, unit.world)
        if lay.bounds != chunk and local.shape == (chunk[unit.rank + 1] - chunk[unit.rank], *trailing):
            return rechunk(unit, local, chunk, lay.bounds)
        if local.shape != want:
            raise ValueError(f"[rank {collectives.rank()}] '{key}': DTensor local shard {tuple(local.shape)} is not "
                             "this "
                             f"rank's torch.chunk rows {tuple(want)}; load it through fullshard.checkpoint.load "
                             "(torch.distributed.checkpoint reshards)")
        return local
    lo, hi = lay.local_row_range(unit.rank)
    rows = value.detach().reshape(lay.rows, -1 if value.numel() else 0)  # -1 is ambiguous for 0 elements
    return rows[lo:hi].reshape(want)


def rechunk(unit, local: torch.Tensor, src: tuple, dst: tuple) -> torch.Tensor:
    """One parameter's rows laid out by row bounds ``src`` (this rank holds
    ``local``, rows ``[src[r], src[r+1])``) as laid out by ``dst``: one
    all-gather of the padded local rows over the shard group (every rank of
    it calls this for the same parameter). Used to present block and owned
    placements as ``torch.chunk`` rows in state dicts and back. ``local``
    may have other trailing dimensions than the parameter (a per-row
    optimizer state)."""
    full = collectives.all_gather_rows(local, src, unit.cfg.shard_group, tag=f"unit '{unit.name}' state dict rows")
    rank = unit.rank
    return full[dst[rank]:dst[rank + 1]].clone()
