"""Optimizer state dicts keyed by original parameter names (torch FSDP1's
``optim_state_dict`` / ``optim_state_dict_to_load``).

Format: ``{"state": {name: {key: value}}, "param_groups": [{..., "params":
[names]}]}``. A state value is *per-row* when it is a tensor with the
parameter's local shard shape (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's
``momentum_buffer``; under ``fully_shard`` a DTensor whose local tensor has
it, loaded back as such a DTensor); per-row values are full tensors (FULL_STATE_DICT,
gathered one unit and one key at a time) or ``DTensor(Shard(0))`` views
(SHARDED_STATE_DICT), as for parameters (see ``state_dict.py`` [Note:
state-dict values]). Anything else (the scalar ``step``) is kept as is.

[Note: declared state layouts]
The shape rule cannot tell every optimizer's state apart: Adafactor's row
statistics of an ``(R, C)`` matrix are ``(local rows, 1)`` (per-row, other
trailing shape) and its column statistics ``(1, C)`` are the same on every
rank (kept as is, although they have a shard's shape when a rank holds one
row). An optimizer may declare each value: ``optimizer.state_kind(param,
key)`` returning ``"rows"`` (dim 0 is the parameter's local rows; any
trailing shape), ``"replicated"`` (identical on every rank of the shard
group: kept as is) or None (the shape rule). ``fullshard.optim``'s
optimizers do. A ``"rows"`` value with other trailing dimensions is
gathered in columns packed into the parameter's rows (one all-gather per
``ceil(row elements / parameter row elements)``) and saved sharded as a
``DTensor(Shard(0))`` of its own full shape ``(R, *trailing)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..api import StateDictType
from ..core import collectives, flat, placement
from ..core.gather import gather_full
from ..core.params import local_of
from . import state_dict as state_dicts


def _param_info(ents) -> dict:
    """id(parameter the optimizer sees) -> (name, Unit or None, ParamSlot or None)."""
    info = {}
    for e in ents:
        if e.is_buffer:
            continue
        p = e.tensor if e.tensor is not None else e.slot.sharded
        info.setdefault(id(p), (e.key, e.unit, e.slot))
    return info


def _optim_params(optim: torch.optim.Optimizer, info: dict) -> list:
    order = [p for g in optim.param_groups for p in g["params"]]
    for i, p in enumerate(order):
        if id(p) not in info:
            raise ValueError(f"[rank {collectives.rank()}] optimizer parameter #{i} (shape {tuple(p.shape)}) is not a "
                             "parameter of the model; build the optimizer from model.parameters() after wrapping")
    return order


def _per_row(v, shape: torch.Size) -> bool:
    """A per-row value: its local rows (a DTensor's, under ``fully_shard``) have the shard's shape."""
    return torch.is_tensor(v) and v.dim() > 0 and local_of(v).shape == shape


ROWS = "rows"
REPLICATED = "replicated"


def _is_rows(optim: torch.optim.Optimizer, param, key: str, v, shape: torch.Size) -> bool:
    """Whether state ``key`` (value ``v``) of ``param`` (local shape ``shape``)
    is per-row: as the optimizer declares (see [Note: declared state
    layouts]), else by shape.

    Raises:
        ValueError: a declared per-row value whose dim 0 is not the local
            rows, or a declaration other than "rows", "replicated" or None.
    """
    if not torch.is_tensor(v) or v.dim() == 0:
        return False
    declare = getattr(optim, "state_kind", None)
    kind = declare(param, key) if callable(declare) else None
    if kind is None:
        return _per_row(v, shape)
    if kind == REPLICATED:
        return False
    if kind != ROWS:
        raise ValueError(f"[rank {collectives.rank()}] {type(optim).__name__}.state_kind returned {kind!r} for "
                         f"'{key}'; return {ROWS!r}, {REPLICATED!r} or None")
    if local_of(v).shape[:1] != shape[:1]:
        raise ValueError(f"[rank {collectives.rank()}] {type(optim).__name__} declares state '{key}' per-row, but "
                         f"its local shape {tuple(local_of(v).shape)} does not start with the parameter's "
                         f"{shape[0]} local rows")
    return True


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (zeros) for every parameter it holds that has none, by one step with zero
    gradients at learning rate 0, so a load has templates to load into: frozen parameters too, whose state a
    checkpoint may hold (frozen since it was saved), and parameters not used yet when others have state. The
    step sees only those parameters (the others' gradients are None during it): parameters and existing state
    are unchanged (the update and decoupled weight decay scale with lr), and every ``.grad`` is as before."""
    params = [p for g in optim.param_groups for p in g["params"]]
    todo = {id(p) for p in params if not optim.state.get(p)}
    if not todo:
        return
    lrs, grads = [g["lr"] for g in optim.param_groups], [p.grad for p in params]
    try:
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in todo else None
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _agree_keys(units, mine: dict) -> dict:
    """{unit: {per-row key: (dtype, {slot: trailing shape})}} as the union
    over each unit's shard group (a rank may hold no state). One object
    all-gather per run of consecutive units on the same group: the units'
    collectives that follow run over that group, and units on other groups
    (another model's, a per-rank expert's) must not wait for each other.
    On the wire a run is one entry per unit and a unit's trailing shapes
    one per slot (None: none here), in order, as objects cannot travel."""
    keys: dict = {}
    start = 0
    while start < len(units):
        group = units[start].cfg.shard_group
        end = start + 1
        while end < len(units) and units[end].cfg.shard_group is group:
            end += 1
        run = units[start:end]
        sent = [{k: (dtype, [trailing.get(slot) for slot in unit.slots])
                 for k, (dtype, trailing) in mine.get(unit, {}).items()} for unit in run]
        for theirs in collectives.all_gather_object(sent, group, tag="optimizer state keys"):
            for unit, kd in zip(run, theirs):
                for k, (dtype, tails) in kd.items():
                    got = keys.setdefault(unit, {}).setdefault(k, (dtype, {}))[1]
                    got.update((slot, tail) for slot, tail in zip(unit.slots, tails) if tail is not None)
        start = end
    return keys


def _gather_rows(unit, have: dict, trailing: dict, dtype: torch.dtype) -> dict:
    """Full tensors of per-row values (``have``: slot -> this rank's rows;
    ``trailing``: slot -> trailing shape, known on every rank), gathered
    over the unit's shard group: columns packed into the parameter's rows,
    one :func:`gather_full` per pass (one pass when a value's rows are no
    longer than the parameter's)."""
    widths = {}
    for slot, tail in trailing.items():
        p = slot.layout
        widths[slot] = (math.prod(tail), p.row_numel)
        if p.row_numel == 0 and widths[slot][0]:
            raise ValueError(f"[rank {collectives.rank()}] unit '{unit.name}': per-row optimizer state of "
                             f"'{p.fqn}' has {widths[slot][0]} elements per row, the parameter none")
    passes = max([-(-mv // mp) for mv, mp in widths.values() if mp] or [1])
    pieces = {slot: [] for slot in trailing}
    for j in range(passes):
        buf = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.flat_shard.device)
        views = dict(zip(unit.slots, flat.shard_views(buf, unit.layout, unit.rank)))
        for slot, v in have.items():
            (mv, mp), lo = widths[slot], j * widths[slot][1]
            hi = min(lo + mp, mv)
            if hi > lo:
                views[slot].reshape(-1, mp)[:, :hi - lo].copy_(v.reshape(-1, mv)[:, lo:hi])
        gathered = dict(zip(unit.slots, gather_full(unit, buf)))
        for slot in trailing:
            (mv, mp), lo = widths[slot], j * widths[slot][1]
            hi = min(lo + mp, mv)
            if hi > lo:
                pieces[slot].append(gathered[slot].reshape(slot.layout.rows, mp)[:, :hi - lo])
    out = {}
    for slot, tail in trailing.items():
        p = slot.layout
        shape = p.shape if tail == tuple(p.shape[1:]) else (p.rows, *tail)
        out[slot] = (torch.cat(pieces[slot], dim=1) if pieces[slot] else
                     torch.zeros(p.rows, 0, dtype=dtype)).reshape(shape)
    return out


@torch.no_grad()
def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """The optimizer's state by original parameter name, full or sharded per
    the model's state-dict type (``FSDP.state_dict_type``).

    Every rank must call it (full per-row state is all-gathered per unit).

    Raises:
        ValueError: the optimizer holds a parameter the model does not own;
            LOCAL_STATE_DICT (use ``optimizer.state_dict()``); a model made by
            ``fully_shard`` (use ``torch.distributed.checkpoint.state_dict``).
    """
    state_dicts.refuse_fully_shard(model, "FSDP.optim_state_dict()")
    state_dicts.check_idle(model, "optim_state_dict()")
    st = state_dicts.settings(model)
    if st.type is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(f"[rank {collectives.rank()}] optim_state_dict() under LOCAL_STATE_DICT: the optimizer's own "
                         "state_dict() already holds this rank's shards; save optimizer.state_dict() instead")
    full = st.type is StateDictType.FULL_STATE_DICT
    offload = st.optim_config.offload_to_cpu
    keep = not (full and st.optim_config.rank0_only) or state_dicts.first_rank(model)
    units, ents = state_dicts.entries(model)
    info = _param_info(ents)
    order = _optim_params(optim, info)
    osd = optim.state_dict()
    groups = [dict(g, params=[info[id(order[i])][0] for i in g["params"]]) for g in osd["param_groups"]]
    by_slot = {}  # ParamSlot -> its per-row state
    slot_unit = {}
    out = {}
    for i, s in osd["state"].items():
        name, unit, slot = info[id(order[i])]
        if unit is None:
            out[name] = {k: state_dicts.copy_value(v, offload) if torch.is_tensor(v) else v for k, v in s.items()}
            continue
        shape = slot.layout.local_shape(unit.rank)
        rows = {k for k, v in s.items() if _is_rows(optim, order[i], k, v, shape)}
        by_slot[slot] = {k: s[k] for k in rows}
        slot_unit[slot] = unit
        out[name] = {k: (state_dicts.copy_value(v, offload) if torch.is_tensor(v) else v)
                     for k, v in s.items() if k not in rows}
    # Per-row keys, dtypes and trailing shapes of each unit, the same on every rank (collectives follow them).
    mine = {}
    for slot, s in by_slot.items():
        for k, v in s.items():
            mine.setdefault(slot_unit[slot], {}).setdefault(k, (v.dtype, {}))[1][slot] = tuple(local_of(v).shape[1:])
    keys = _agree_keys(units, mine)
    for unit in units:
        if not full:
            state_dicts.check_shardable(unit)
        for k, (dtype, trailing) in sorted(keys.get(unit, {}).items()):
            have = {slot: local_of(by_slot[slot][k]) for slot in unit.slots if k in by_slot.get(slot, {})}
            if full:
                views = _gather_rows(unit, have, trailing, dtype)
                if keep:
                    for slot in have:
                        out[info[id(slot.sharded)][0]][k] = state_dicts.copy_value(views[slot], offload)
                del views
                continue
            for slot in unit.slots:
                lay = slot.layout
                collective = unit.world > 1 and (len(lay.shape) == 0 or lay.bounds != placement.row_bounds(
                    placement.RowShard(), lay.rows, unit.world))
                if slot not in have and not collective:
                    continue  # 0-dim slots broadcast, and block/owned rows re-chunk, on every rank, held or not
                local = have.get(slot)
                tail = trailing.get(slot, tuple(lay.shape[1:]))
                if local is None:
                    local = torch.zeros((lay.local_rows(unit.rank), *tail) if len(lay.shape) else
                                        lay.local_shape(unit.rank), dtype=dtype, device=unit.flat_shard.device)
                full_shape = None if tail == tuple(lay.shape[1:]) else (lay.rows, *tail)
                v = state_dicts.shard_value(unit, slot, local, offload, full_shape)
                if slot in have:
                    out[info[id(slot.sharded)][0]][k] = v
    if not keep:
        return {}
    return {"state": out, "param_groups": groups}


@torch.no_grad()
def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: dict) -> dict:
    """Turn a by-name optimizer state dict (full or sharded, of any world
    size) into ``optim.load_state_dict``'s form for this rank's shards.

    No collectives, except under ``FullOptimStateDictConfig(rank0_only=True)``: then only the model's first
    rank needs ``osd`` (the others may pass ``{}``, as torch FSDP1 allows) and it is broadcast from there.
    Creates the optimizer's state first for parameters that have none (see :func:`init_optim_state`), to
    learn which values are per-row.

    Raises:
        ValueError: a different number of parameter groups, a group whose
            parameter names differ (both sides listed), or state for a
            parameter the optimizer does not hold; a model made by
            ``fully_shard`` (use ``torch.distributed.checkpoint.state_dict``).
    """
    state_dicts.refuse_fully_shard(model, "FSDP.optim_state_dict_to_load()")
    state_dicts.check_idle(model, "optim_state_dict_to_load()")
    st = state_dicts.settings(model)
    if st.type is StateDictType.FULL_STATE_DICT and getattr(st.optim_config, "rank0_only", False):
        cfg = model.unit.cfg
        osd = collectives.broadcast_object(osd if state_dicts.first_rank(model) else None,
                                           collectives.holding_group(cfg.shard_group, cfg.replicate_group),
                                           tag="rank0_only optimizer state dict")
    _, ents = state_dicts.entries(model)
    info = _param_info(ents)
    order = _optim_params(optim, info)
    init_optim_state(optim)
    cur = optim.state_dict()
    index = {info[id(p)][0]: i for i, p in enumerate(order)}
    saved = osd["param_groups"]
    if len(saved) != len(cur["param_groups"]):
        raise ValueError(f"[rank {collectives.rank()}] optimizer state has {len(saved)} parameter groups, the "
                         "optimizer "
                         f"{len(cur['param_groups'])}; build the optimizer with the same groups")
    groups = []
    for gi, (sg, cg) in enumerate(zip(saved, cur["param_groups"])):
        names = {info[id(order[i])][0] for i in cg["params"]}
        if set(sg["params"]) != names:
            raise ValueError(f"[rank {collectives.rank()}] parameter group {gi}: missing "
                             f"{sorted(names - set(sg['params']))}, "
                             f"unexpected {sorted(set(sg['params']) - names)}")
        groups.append(dict(sg, params=list(cg["params"])))
    state = {}
    for name, s in osd["state"].items():
        if name not in index:
            raise ValueError(f"[rank {collectives.rank()}] optimizer state for '{name}', which the optimizer does "
                             "not hold")
        i = index[name]
        _, unit, slot = info[id(order[i])]
        template = cur["state"].get(i, {})
        new = {}
        for k, v in s.items():
            t = template.get(k)
            if unit is not None and _is_rows(optim, order[i], k, t, slot.layout.local_shape(unit.rank)):
                rows = state_dicts.local_rows(unit, slot, v, f"{name}/{k}").clone()
                # In the parameter's form (a DTensor under fully_shard), as the optimizer's own state.
                new[k] = slot.grad_like(rows)
            else:
                new[k] = v.clone() if torch.is_tensor(v) else v
        state[i] = new
    return {"state": state, "param_groups": groups}


def _plain_names(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[list, list[str]]:
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    order = [p for g in optim.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(f"[rank {collectives.rank()}] optimizer parameters #{missing} are not parameters of the model")
    return order, [names[id(p)] for p in order]


def plain_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """A plain (unwrapped or DDP's inner) model's optimizer state by parameter
    name, in the format of :func:`optim_state_dict` (values are not copied)."""
    order, names = _plain_names(model, optim)
    osd = optim.state_dict()
    return {"state": {names[i]: dict(s) for i, s in osd["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]}


def plain_optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: dict) -> dict:
    """Inverse of :func:`plain_optim_state_dict` for a full by-name state dict.

    Raises:
        ValueError: groups or names that differ from the optimizer's (listed).
    """
    order, names = _plain_names(model, optim)
    index = {n: i for i, n in enumerate(names)}
    cur = optim.state_dict()["param_groups"]
    if len(osd["param_groups"]) != len(cur):
        raise ValueError(f"[rank {collectives.rank()}] optimizer state has {len(osd['param_groups'])} parameter "
                         "groups, "
                         f"the optimizer {len(cur)}; build the optimizer with the same groups")
    groups = []
    for gi, (sg, cg) in enumerate(zip(osd["param_groups"], cur)):
        want = {names[i] for i in cg["params"]}
        if set(sg["params"]) != want:
            raise ValueError(f"[rank {collectives.rank()}] parameter group {gi}: missing "
                             f"{sorted(want - set(sg['params']))}, "
                             f"unexpected {sorted(set(sg['params']) - want)}")
        groups.append(dict(sg, params=list(cg["params"])))
    unknown = [n for n in osd["state"] if n not in index]
    if unknown:
        raise ValueError(f"[rank {collectives.rank()}] optimizer state for parameters the optimizer does not hold: "
                         f"{unknown}")
    state = {index[n]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for n, s in osd["state"].items()}
    return {"state": state, "param_groups": groups}
