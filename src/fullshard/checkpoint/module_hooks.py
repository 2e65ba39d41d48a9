"""Model state dicts through ``nn.Module.state_dict`` / ``load_state_dict``.

[Note: state dicts through nn.Module]
A unit does not build its state dict itself. ``nn.Module.state_dict`` and
``load_state_dict`` walk the model as for a plain one, so every module's
``get_extra_state`` / ``set_extra_state``, every state-dict hook a user or a
library registered, ``keep_vars`` and ``strict`` behave as on the plain
model, and a plain root holding units works like a unit root. Each unit
takes part through four hooks registered at construction:

* save pre-hook: registers, on every module that owns one of the unit's
  parameters, the value the state-dict type asks for (``Unit.install_params``):
  the full tensor gathered by ``core.gather.gather_full`` (FULL), a
  ``DTensor`` view of the shard (SHARDED), or None (LOCAL, where one
  ``_flat_param`` entry stands for all of them);
* save post-hook: registers the sharded parameters again and drops the
  unit's ``_fsdp_wrapped_module.`` segment from the keys below it (torch
  FSDP1's names); FULL with ``rank0_only`` empties the subtree on ranks > 0;
* load pre-hook: adds the segment back to the incoming keys and registers
  load targets: full-shape tensors (FULL), ``DTensor`` copies of this rank's
  rows (SHARDED; a plain full tensor in the incoming dict is first cut to
  this rank's rows), or None (LOCAL, whose ``_flat_param`` it takes out of
  the dict and checks);
* load post-hook: copies into the shard this rank's rows of every target
  the module's own loading wrote (a target counts as written when the
  version counter or storage of its memory changed, so a module's load hooks
  that rename or transform entries are respected) and a LOCAL flat shard,
  registers the sharded parameters again and removes wrapper segments from
  reported key names.

When the load runs through a unit's ``load_state_dict`` those copies wait
until the whole load succeeded, so a load that raises (missing keys, a
shape mismatch) leaves every shard as it was, for each state-dict type.
Where some module has a load post-hook of its own, the copies run at once
instead (such a hook may edit the loaded parameters in place, and a copy
run after it would undo the edit), each unit's flat shards first copied
aside and put back if the load raises. A state-dict call that raised
half-way leaves targets registered only until the next forward (the root's
pre-forward restores them, ``core/state.py`` ``start_iteration``) or the
next state-dict call of that unit.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..api import StateDictType
from ..construct import WRAPPER_SEGMENTS, clean_name
from ..core import collectives, flat as flat_layout, mixed, stale_graph, torch_private
from ..core.gather import gather_full
from . import state_dict as state_dicts

SEGMENT = "_fsdp_wrapped_module."
FLAT_PARAM_KEY = "_flat_param"
"""LOCAL_STATE_DICT key of a unit's flat shard (torch FSDP1's name)."""


def _clean_message(message: str) -> str:
    """``nn.Module.load_state_dict``'s error text with the keys in it cleaned."""
    for seg in WRAPPER_SEGMENTS:
        message = message.replace(seg + ".", "")
    return message


@dataclasses.dataclass
class _LoadTargets:
    """What a unit's load pre-hook registered, for its post-hook."""

    targets: list[Optional[torch.Tensor]]
    marks: list[Optional[tuple[int, int, int]]]  # _mark() at registration; None: no target
    error_msgs: list
    local_flat: Optional[torch.Tensor] = None  # LOCAL_STATE_DICT: this rank's flat shard to copy in


# Unit module -> its pending load; row copies deferred by a unit's load_state_dict.
_LOADS: dict[int, list[tuple[object, _LoadTargets]]] = {}  # one (part, targets) per dtype part
_DEFERRED: list = [None]  # per load: a list of deferred copies, a _Restorer (copies run at once), or None


def register(unit_module: nn.Module) -> None:
    """Install the four state-dict hooks on a unit (see the module Note)."""
    unit_module.register_state_dict_pre_hook(_save_pre)
    unit_module.register_state_dict_post_hook(_save_post)
    unit_module.register_load_state_dict_pre_hook(_load_pre)
    unit_module.register_load_state_dict_post_hook(_load_post)


def _check_usable(unit_module: nn.Module, what: str) -> None:
    """Raises RuntimeError during forward or backward; undoes what an earlier
    state-dict call that raised left registered."""
    state_dicts.check_idle(unit_module, what)
    unit_module.unit.restore_all_params()


# ----------------------------------------------------------------------- save
def _no_local_mixed(unit, st) -> None:
    """Raises ValueError for LOCAL_STATE_DICT of a unit that mixes dtypes (one
    ``_flat_param`` cannot hold them; core/mixed.py [Note: units that mix dtypes])."""
    if st.type is StateDictType.LOCAL_STATE_DICT and unit.side:
        raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': LOCAL_STATE_DICT holds one flat shard "
                         "of one dtype, and this unit mixes dtypes; use FULL_STATE_DICT or SHARDED_STATE_DICT")


def _save_values(unit_module: nn.Module, unit) -> Optional[list]:
    """The values the save pre-hook registers for ``unit`` (the module's unit
    or one of its dtype parts), or None to register nothing."""
    st = state_dicts.settings(unit_module)
    offload = st.config.offload_to_cpu
    if st.type is StateDictType.LOCAL_STATE_DICT:
        return [None] * len(unit.slots)
    if st.type is StateDictType.SHARDED_STATE_DICT:
        state_dicts.check_shardable(unit)
        views = flat_layout.shard_views(unit.flat_shard, unit.layout, unit.rank)
        return [nn.Parameter(state_dicts.shard_value(unit, slot, v, offload), requires_grad=slot.layout.requires_grad)
                for slot, v in zip(unit.slots, views)]
    if unit.summoned:  # summon_full_params already registered full parameters: no gather
        _check_summoned(unit)
        return None
    full = gather_full(unit)
    if st.config.rank0_only and not state_dicts.first_rank(unit_module):
        return [None] * len(unit.slots)
    # One storage per value (not views of the unit's buffer): safetensors and
    # torch.save of a single entry must not see the others.
    return [nn.Parameter(state_dicts.copy_value(v, offload), requires_grad=slot.layout.requires_grad)
            for slot, v in zip(unit.slots, full)]


def _check_summoned(unit) -> None:
    """Raises RuntimeError when ``summon_full_params(rank0_only=True)`` left this
    rank without full parameters."""
    for slot in unit.slots:
        module, attr = slot.owners[0]
        if tuple(module._parameters[attr].shape) != tuple(slot.layout.shape):
            raise RuntimeError(f"[rank {collectives.rank()}] state_dict() inside summon_full_params(rank0_only=True): "
                               f"unit '{unit.name}' holds no full parameters on this rank; call it on rank 0 only "
                               "(group rank 0 of the unit's process group)")


def _save_pre(unit_module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _check_usable(unit_module, "state_dict()")
    _no_local_mixed(unit_module.unit, state_dicts.settings(unit_module))
    parts = mixed.parts(unit_module.unit)
    values = [_save_values(unit_module, part) for part in parts]
    unit_module._sd_installed = values[0] is not None
    if unit_module._sd_installed:
        for part, v in zip(parts, values):
            part.install_params(v)


def _save_post(unit_module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    unit, st = unit_module.unit, state_dicts.settings(unit_module)
    if unit_module._sd_installed:
        for part in mixed.parts(unit):
            part.restore_params()
        unit_module._sd_installed = False
    _clean_metadata(state_dict, prefix)
    mine = [k for k in state_dict if k.startswith(prefix)]
    drop = st.type is StateDictType.FULL_STATE_DICT and st.config.rank0_only and not state_dicts.first_rank(unit_module)
    for k in mine:  # re-inserted in order: they are the dict's last entries
        v = state_dict.pop(k)
        if not drop:
            state_dict[prefix + k[len(prefix):].removeprefix(SEGMENT)] = v
    if st.type is StateDictType.LOCAL_STATE_DICT and unit.slots:
        flat = unit.flat_shard.detach()
        state_dict[prefix + FLAT_PARAM_KEY] = flat.to("cpu", copy=True) if st.config.offload_to_cpu else flat
    elif not drop:
        _buffers_in_saved_dtype(unit_module, state_dict, prefix)


def _clean_metadata(state_dict: dict, prefix: str) -> None:
    """The state dict's ``_metadata`` (each module's ``_version``, by module name) under the plain
    model's names, as its keys: the wrapped module's entry in place of its unit's. Without this a
    module's version is not found when the state dict loads into the plain model (its
    ``_load_from_state_dict`` then takes it for a version-less one)."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    inner = prefix + SEGMENT[:-1]
    for key in [k for k in metadata if k == inner or k.startswith(inner + ".")]:
        metadata[prefix[:-1] + key[len(inner):] if key == inner else prefix + key[len(inner) + 1:]] = \
            metadata.pop(key)


def _alias_metadata(unit_module: nn.Module, state_dict: dict, prefix: str) -> None:
    """At the start of a load: each module's ``_metadata`` entry of the plain model's names also under
    its name in the wrapped model, where ``nn.Module.load_state_dict`` looks it up."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for name, _ in unit_module.named_modules():
        plain = clean_name(name)
        if name != plain and (prefix + plain).rstrip(".") in metadata:
            metadata[(prefix + name).rstrip(".")] = metadata[(prefix + plain).rstrip(".")]


def _buffers_in_saved_dtype(unit_module: nn.Module, state_dict: dict, prefix: str) -> None:
    """Full and sharded state dicts hold the unit's buffers in their dtypes
    before ``MixedPrecision.buffer_dtype`` cast them (copies, as torch FSDP1
    makes them), so a checkpoint loads into the plain model without loss.
    Without ``buffer_dtype``, and for ignored modules, the entries stay the
    buffers themselves."""
    dtypes = unit_module._orig_buffer_dtypes
    if not dtypes:
        return
    own = {id(m) for m in unit_module._own_modules}
    for mprefix, m in state_dicts.walk(unit_module._fsdp_wrapped_module, prefix):
        if id(m) not in own:
            continue
        for name in m._buffers:
            key, dtype = mprefix + name, dtypes.get((id(m), name))
            if dtype is not None and torch.is_tensor(state_dict.get(key)):
                state_dict[key] = state_dict[key].to(dtype, copy=True)


# ----------------------------------------------------------------------- load
def _owner_keys(unit_module: nn.Module, prefix: str) -> dict:
    """Incoming key (segment added, deeper wrapper segments not yet) -> (its
    unit or dtype part, its ``ParamSlot``)."""
    owner = {(id(m), a): (part, slot) for part in mixed.parts(unit_module.unit)
             for slot in part.slots for m, a in slot.owners}
    out = {}
    for mprefix, m in state_dicts.walk(unit_module._fsdp_wrapped_module, prefix + SEGMENT):
        for attr in m._parameters:
            slot = owner.get((id(m), attr))
            if slot is not None:
                out[mprefix + attr] = slot
    return out


def _load_pre(unit_module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    _check_usable(unit_module, "load_state_dict()")
    unit, st = unit_module.unit, state_dicts.settings(unit_module)
    stale_graph.updated(unit)  # a graph of an earlier forward must not backpropagate through the new values
    _alias_metadata(unit_module, state_dict, prefix)
    where = f"[rank {collectives.rank()}] unit '{unit.name}'"
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(f"{where}: load_state_dict(assign=True) is not supported (values are copied into "
                         "the shards); call it without assign")
    if unit.summoned:
        raise RuntimeError(f"{where}: load_state_dict() inside summon_full_params(); leave the context first "
                           "(its writeback would overwrite what was loaded)")
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + SEGMENT)]:
        state_dict[prefix + SEGMENT + k[len(prefix):]] = state_dict.pop(k)
    from torch.distributed.tensor import DTensor

    _no_local_mixed(unit, st)
    local_flat = None
    if st.type is StateDictType.LOCAL_STATE_DICT:
        local_flat = _local_flat(unit, state_dict.pop(prefix + SEGMENT + FLAT_PARAM_KEY, None), prefix, missing_keys)
    elif st.type is StateDictType.SHARDED_STATE_DICT:
        state_dicts.check_shardable(unit)
        for key, (part, slot) in _owner_keys(unit_module, prefix).items():
            v, shape = state_dict.get(key), slot.layout.shape
            if torch.is_tensor(v) and part.world > 1 and len(shape) > 0 and \
                    not isinstance(v, DTensor) and v.shape == shape:
                rows = state_dicts.local_rows(part, slot, v, clean_name(key))
                state_dict[key] = state_dicts.shard_value(part, slot, rows, False)
            elif isinstance(v, DTensor):
                state_dicts.local_rows(part, slot, v, clean_name(key))  # raises on a local shard laid out otherwise
    loads = []
    for part in mixed.parts(unit):
        targets = _load_targets(part, st.type)
        marks = [None if t is None else _mark(t) for t in targets]
        loads.append((part, _LoadTargets(targets, marks, error_msgs, local_flat if part is unit else None)))
    _LOADS[id(unit_module)] = loads
    for part, pending in loads:
        part.install_params(pending.targets)


def _load_targets(unit, kind: StateDictType) -> list[Optional[nn.Parameter]]:
    """The load targets of ``unit`` (a unit or one of its dtype parts) for a state-dict type."""
    if kind is StateDictType.LOCAL_STATE_DICT:
        return [None] * len(unit.slots)
    if kind is StateDictType.SHARDED_STATE_DICT:
        # Targets hold copies of this rank's rows (a 0-dim parameter: a whole
        # value), so nothing reaches the shard before the load succeeded.
        views = flat_layout.shard_views(unit.flat_shard, unit.layout, unit.rank)
        targets = []
        for slot, view in zip(unit.slots, views):
            lay = slot.layout
            if unit.world == 1 or len(lay.shape) > 0:
                value = state_dicts.shard_value(unit, slot, view.clone(), False)
            else:
                value = torch.zeros(lay.shape, dtype=view.dtype, device=view.device)
            targets.append(nn.Parameter(value, requires_grad=lay.requires_grad))
        return targets
    # Full targets hold the current full values (one all-gather of the unit, as state_dict() makes): a
    # _load_from_state_dict that writes only some rows (a vocabulary grown since the save) or a load hook
    # that reads the parameter sees what the plain model would.
    dev = unit.flat_shard.device
    full = gather_full(unit)
    return [nn.Parameter(value.to(dev) if value is not None else
                         torch.empty(slot.layout.shape, dtype=unit.flat_shard.dtype, device=dev),
                         requires_grad=slot.layout.requires_grad)
            for slot, value in itertools.zip_longest(unit.slots, full)]


def _local_flat(unit, flat: Optional[torch.Tensor], prefix: str, missing_keys: list) -> Optional[torch.Tensor]:
    """A LOCAL_STATE_DICT ``_flat_param``, checked, to copy into the unit's
    flat shard once the load succeeded (None: nothing to copy).

    Raises:
        ValueError: a flat shard of another size (another world size or model).
    """
    if not unit.slots:
        return None
    if flat is None:
        missing_keys.append(prefix + SEGMENT + FLAT_PARAM_KEY)
        return None
    if flat.numel() != unit.flat_shard.numel():
        raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': LOCAL_STATE_DICT "
                         f"'{prefix}{FLAT_PARAM_KEY}' has "
                         f"{flat.numel()} elements, this rank's flat shard {unit.flat_shard.numel()}; a local state "
                         "dict loads only at the world size and model it was saved with (use FULL or SHARDED)")
    return flat.reshape(-1)


def _mark(t: torch.Tensor) -> tuple[int, int, int]:
    """Version counters of a target and of its memory (a DTensor's local
    tensor: an in-place op bumps the wrapper's counter, not the local one's)
    and that memory's address."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return torch_private.version_counter(t), torch_private.version_counter(local), local.data_ptr()


def _written(target: torch.Tensor, now, mark) -> bool:
    return now is not target or _mark(target) != mark


def _load_post(unit_module: nn.Module, incompatible_keys) -> None:
    loads = _LOADS.pop(id(unit_module), None)
    if loads is None:
        return
    copies = [_load_post_part(part, pending) for part, pending in loads]
    for names in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        names[:] = [clean_name(n) for n in names]
    error_msgs = loads[0][1].error_msgs
    error_msgs[:] = [_clean_message(m) for m in error_msgs]

    def copy_rows():
        for fn in copies:
            fn()

    pending = _DEFERRED[-1]
    if isinstance(pending, list):
        pending.append(copy_rows)
    elif not error_msgs:
        if isinstance(pending, _Restorer):
            pending.keep([part for part, _ in loads])
        copy_rows()


def _load_post_part(unit, pending: _LoadTargets) -> Callable[[], None]:
    """Restore ``unit``'s (a unit's or dtype part's) parameters; returns the
    copy into its shard of the targets the load wrote."""
    writes = []
    for slot, target, mark in zip(unit.slots, pending.targets, pending.marks):
        module, attr = slot.owners[0]
        now = module._parameters[attr]
        if mark is not None and _written(target, now, mark):
            writes.append((slot, now))
    unit.restore_params()

    @torch.no_grad()
    def copy_rows():
        if pending.local_flat is not None:
            unit.flat_shard.copy_(pending.local_flat)
        views = dict(zip(unit.slots, flat_layout.shard_views(unit.flat_shard, unit.layout, unit.rank)))
        for slot, value in writes:
            views[slot].copy_(state_dicts.local_rows(unit, slot, value, slot.layout.fqn))

    return copy_rows


class _Restorer:
    """The flat shards of the units a load copied into at once, as they were, until the load ends."""

    def __init__(self):
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, parts) -> None:
        self.saved.extend((p.flat_shard, p.flat_shard.detach().clone()) for p in parts)

    @torch.no_grad()
    def restore(self) -> None:
        for flat, before in reversed(self.saved):
            flat.copy_(before)


class deferred_row_copies:
    """Context of a unit's ``load_state_dict``: the row copies of every unit
    below wait until the load returned without error, then run; with
    ``immediate`` (a module has a load post-hook of its own) they run at
    once and are undone if the load raises.

    Args:
        immediate: run the copies in the units' post-hooks.
    """

    def __init__(self, immediate: bool = False):
        self.immediate = immediate

    def __enter__(self):
        _DEFERRED.append(_Restorer() if self.immediate else [])
        return self

    def __exit__(self, exc_type, *exc) -> None:
        pending = _DEFERRED.pop()
        if isinstance(pending, _Restorer):
            if exc_type is not None:
                pending.restore()
        elif exc_type is None:
            for fn in pending:
                fn()


def has_own_load_post_hooks(module: nn.Module) -> bool:
    """Whether a module of ``module`` has a load post-hook other than a unit's."""
    return any(h is not _load_post for m in module.modules() for h in m._load_state_dict_post_hooks.values())


def forget_load(unit_module: nn.Module) -> None:
    """Drop a load that raised before its post-hook ran (targets are restored by the caller)."""
    _LOADS.pop(id(unit_module), None)
