"""Model state dicts of a wrapped model, torch FSDP1's contract.

FULL_STATE_DICT (the default): full tensors under the original names, the
same keys, order and shapes as the plain model's ``state_dict()``, gathered
one unit at a time (all-gather the unit's flat shard, copy each parameter out,
free the unit's buffer before the next one). SHARDED_STATE_DICT: each managed
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
import weakref
from typing import Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from ..api import FullStateDictConfig, ShardedStateDictConfig, StateDictType
from ..api import FullOptimStateDictConfig, ShardedOptimStateDictConfig
from ..core import collectives as C
from ..core import flat as F

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The state-dict type of one unit and its two configs."""

    type: StateDictType = StateDictType.FULL_STATE_DICT
    config: object = FullStateDictConfig()
    optim_config: object = FullOptimStateDictConfig()


# Unit -> Settings; kept here, never as attributes on the user's modules.
_SETTINGS: "weakref.WeakKeyDictionary[nn.Module, Settings]" = weakref.WeakKeyDictionary()
# (id(shard group), device type) -> (the group, its 1-D DeviceMesh): a unit's
# DTensors live on a mesh over the unit's own shard group.
_MESHES: dict = {}


def _units_of(model: nn.Module) -> list:
    from ..fsdp import FullyShardedDataParallel

    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def settings(model: nn.Module) -> Settings:
    return _SETTINGS.get(model, Settings())


def set_state_dict_type(model: nn.Module, sd_type: StateDictType, config=None, optim_config=None) -> Settings:
    """Set the state-dict type of every unit in ``model``; returns the previous one (of the first unit).

    Raises:
        ValueError: ``sd_type`` is not a StateDictType, a config of the wrong
            kind, or ``model`` holds no FullyShardedDataParallel unit.
    """
    if not isinstance(sd_type, StateDictType):
        raise ValueError(f"state_dict_type must be a fullshard.StateDictType, got {sd_type!r}")
    full = sd_type is StateDictType.FULL_STATE_DICT
    config = config if config is not None else (FullStateDictConfig() if full else ShardedStateDictConfig())
    optim_config = optim_config if optim_config is not None else (
        FullOptimStateDictConfig() if full else ShardedOptimStateDictConfig())
    want = (FullStateDictConfig, FullOptimStateDictConfig) if full else (ShardedStateDictConfig,
                                                                        ShardedOptimStateDictConfig)
    if not isinstance(config, want[0]) or not isinstance(optim_config, want[1]):
        raise ValueError(f"{sd_type.value} takes {want[0].__name__} and {want[1].__name__}; got "
                         f"{type(config).__name__} and {type(optim_config).__name__}")
    units = _units_of(model)
    if not units:
        raise ValueError("set_state_dict_type: the module holds no FullyShardedDataParallel unit")
    prev = settings(units[0])
    for u in units:
        _SETTINGS[u] = Settings(sd_type, config, optim_config)
    return prev


def restore(model: nn.Module, prev: Settings) -> None:
    for u in _units_of(model):
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
    """One state-dict key: a managed parameter (``unit``, ``slot``), or a plain tensor."""

    key: str
    is_buffer: bool
    unit: Optional[int] = None
    slot: Optional[int] = None
    tensor: Optional[torch.Tensor] = None


def entries(root: nn.Module) -> tuple[list, list[Entry]]:
    """(Unit objects under ``root`` in module order, every state-dict entry in order)."""
    units = [u.unit for u in _units_of(root)]
    owner = {}
    for ui, unit in enumerate(units):
        for si, slot in enumerate(unit.slots):
            for module, attr in slot.owners:
                owner[(id(module), attr)] = (ui, si)
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
    return C.is_first_rank(cfg.shard_group, cfg.replicate_group)


def check_idle(model: nn.Module, what: str) -> None:
    """Raises RuntimeError when a forward or backward is in flight."""
    root = model._runtime.root
    if root is None:
        return
    from ..api import TrainingState

    busy = [rt.unit.name for rt in root.units if rt.state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(f"[rank {C.rank()}] {what} cannot run during forward or backward "
                           f"(units busy: {busy}); call it between iterations")


# ------------------------------------------------------------------- values
def gather_full(unit, flat: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """All-gather ``flat`` (default: the unit's fp32 flat shard; any tensor laid
    out like it) and return full per-parameter views of one new buffer."""
    lay, dev = unit.layout, unit.cfg.compute_device
    src = unit.flat_shard if flat is None else flat
    buf = torch.empty(lay.unsharded_numel, dtype=src.dtype, device=dev)
    C.all_gather(buf, src.to(dev), unit.cfg.shard_group, async_op=False, tag=f"unit '{unit.name}' state dict")
    full = torch.empty_like(buf)
    F.copy_out(full, buf, lay)
    return F.unsharded_views(full, lay)


def summoned_full(unit) -> list[torch.Tensor]:
    """The full parameters ``summon_full_params`` registered on a summoned
    unit's modules (no collective), so a full state dict taken inside the
    context on some ranks only (``if rank == 0: model.save_pretrained(...)``)
    neither gathers nor hangs.

    Raises:
        RuntimeError: this rank holds no full parameters (``rank0_only=True``
            on a rank other than 0).
    """
    out = []
    for slot, lay in zip(unit.slots, unit.layout.params):
        module, attr = slot.owners[0]
        p = module._parameters[attr]
        if tuple(p.shape) != tuple(lay.shape):
            raise RuntimeError(f"[rank {C.rank()}] state_dict() inside summon_full_params(rank0_only=True): "
                               f"unit '{unit.name}' holds no full parameters on this rank; call it on rank 0 only "
                               "(group rank 0 of the unit's process group)")
        out.append(p.detach())
    return out


def copy_value(t: torch.Tensor, offload: bool) -> torch.Tensor:
    return t.detach().to("cpu", copy=True) if offload else t.detach().clone()


def check_shardable(unit) -> None:
    if unit.cfg.replicate_group is not None and unit.world > 1:
        raise NotImplementedError(
            f"[rank {C.rank()}] unit '{unit.name}': SHARDED_STATE_DICT does not support HYBRID_SHARD; "
            "use FULL_STATE_DICT, or FULL_SHARD / SHARD_GRAD_OP / NO_SHARD")


def shard_value(unit, si: int, local: torch.Tensor, offload: bool) -> torch.Tensor:
    """The sharded-state-dict value of slot ``si`` whose local rows are ``local``
    (shape ``layout.local_shape(rank)``): a ``DTensor(Shard(0))``, or a plain
    full tensor for NO_SHARD units and 0-dim parameters (see [Note: state-dict values])."""
    lay = unit.layout.params[si]
    if unit.world == 1:
        return (local.detach().to("cpu", copy=True) if offload else local.detach()).view(lay.shape)
    if len(lay.shape) == 0:
        t = local.detach().reshape(-1)[:1].clone() if local.numel() else local.new_zeros(1)
        C.broadcast(t, 0, unit.cfg.shard_group, tag=f"unit '{unit.name}' state dict")
        return t.view(()).cpu() if offload else t.view(())
    from torch.distributed.tensor import DTensor, Shard

    local = local.detach().to("cpu", copy=True) if offload else local.detach()
    group = unit.cfg.shard_group
    key = (id(group), local.device.type)
    if key not in _MESHES or _MESHES[key][0] is not group:
        # The group is held with its mesh, so its id cannot be reused by another group.
        _MESHES[key] = (group, C.device_mesh(group, local.device.type))
    return DTensor.from_local(local, _MESHES[key][1], [Shard(0)], run_check=False, shape=lay.shape,
                              stride=torch.empty(lay.shape, device="meta").stride())


def local_rows(unit, si: int, value: torch.Tensor, key: str) -> torch.Tensor:
    """This rank's rows of ``value`` (a full tensor, or a DTensor laid out as ours).

    Raises:
        ValueError: a DTensor whose local shard is not this rank's ``torch.chunk`` rows.
    """
    lay = unit.layout.params[si]
    want = lay.local_shape(unit.rank)
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        if local.shape != want:
            raise ValueError(f"[rank {C.rank()}] '{key}': DTensor local shard {tuple(local.shape)} is not this "
                             f"rank's torch.chunk rows {tuple(want)}; load it through fullshard.checkpoint.load "
                             "(torch.distributed.checkpoint reshards)")
        return local
    lo, hi = lay.local_row_range(unit.rank)
    return value.detach().reshape(lay.rows, lay.row_numel)[lo:hi].reshape(want)


# --------------------------------------------------------------- public API
@torch.no_grad()
def state_dict(model: nn.Module, destination: Optional[dict] = None, prefix: str = "") -> dict:
    """``model.state_dict()`` per the unit's state-dict type (see module docstring)."""
    check_idle(model, "state_dict()")
    st = settings(model)
    units, ents = entries(model)
    out = destination if destination is not None else {}
    offload = st.config.offload_to_cpu
    if st.type is StateDictType.SHARDED_STATE_DICT:
        for unit in units:
            check_shardable(unit)
        views = [F.shard_views(u.flat_shard, u.layout, u.rank) for u in units]
        for e in ents:
            out[prefix + e.key] = (copy_value(e.tensor, offload) if offload else e.tensor.detach()) \
                if e.tensor is not None else shard_value(units[e.unit], e.slot, views[e.unit][e.slot], offload)
        return out
    keep = not st.config.rank0_only or first_rank(model)
    values = {}
    for ui, unit in enumerate(units):  # one unit's full parameters alive at a time
        # Inside summon_full_params the full parameters are already on the modules: no gather.
        full = summoned_full(unit) if unit.summoned else gather_full(unit)
        if keep:
            for si, v in enumerate(full):
                values[(ui, si)] = copy_value(v, offload)
        del full
    if keep:
        for e in ents:
            out[prefix + e.key] = values[(e.unit, e.slot)] if e.tensor is None else (
                copy_value(e.tensor, True) if offload else e.tensor.detach())
    return out


@torch.no_grad()
def load_state_dict(model: nn.Module, sd: dict, strict: bool = True) -> _IncompatibleKeys:
    """Copy a full (plain model's) or sharded state dict into this rank's shards.

    No collectives: each rank copies its own rows out of full tensors, or the
    local shard out of DTensors laid out as ours.

    Raises:
        RuntimeError: with ``strict``, missing or unexpected keys (both listed);
            always, a value whose shape differs from the parameter's (named).
    """
    check_idle(model, "load_state_dict()")
    units, ents = entries(model)
    expected = {e.key for e in ents}
    missing = [e.key for e in ents if e.key not in sd]
    unexpected = [k for k in sd if k not in expected]
    bad = []
    for e in ents:
        if e.key in sd:
            want = e.tensor.shape if e.tensor is not None else units[e.unit].layout.params[e.slot].shape
            if torch.Size(sd[e.key].shape) != want:
                bad.append(f"'{e.key}': checkpoint {tuple(torch.Size(sd[e.key].shape))} vs model {tuple(want)}")
    errors = []
    if strict and missing:
        errors.append(f"missing key(s): {missing}")
    if strict and unexpected:
        errors.append(f"unexpected key(s): {unexpected}")
    if bad:
        errors.append(f"shape mismatch: {'; '.join(bad)}")
    if errors:
        raise RuntimeError(f"[rank {C.rank()}] error(s) loading state_dict for {type(model).__name__}: "
                           + " | ".join(errors) + "; load a state dict of this model (or pass strict=False "
                           "for missing/unexpected keys)")
    done = set()
    views = [F.shard_views(u.flat_shard, u.layout, u.rank) for u in units]
    for e in ents:
        if e.key not in sd:
            continue
        v = sd[e.key]
        if e.tensor is not None:
            e.tensor.copy_(v)
        elif (e.unit, e.slot) not in done:
            done.add((e.unit, e.slot))
            dst = views[e.unit][e.slot]
            src = local_rows(units[e.unit], e.slot, v, e.key)
            if src.data_ptr() != dst.data_ptr() or dst.numel() == 0:
                dst.copy_(src)
    return _IncompatibleKeys(missing, unexpected)
