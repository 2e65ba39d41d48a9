"""``save`` / ``load``: sharded checkpoints through ``torch.distributed.checkpoint``.

[Note: checkpoint layout]
A checkpoint is a directory::

    .metadata                DCP: every key's global shape, dtype and chunks
    __<rank>_0.distcp        DCP: the shards rank <rank> wrote (no gather)
    extra-rank<rank>.pt      each rank's ``extra`` dict (torch.save), if given
    fullshard.json           manifest: world size, keys, bytes and sha256 per file

Keys are ``model.<name>`` and ``optim.state.<name>.<key>`` /
``optim.param_groups.<i>.<key>`` under the plain model's names, so the same
checkpoint loads into FSDP (any world size; DCP reshards), DDP or a plain model.

[Note: one checkpoint format]
These keys, shapes and dtypes are exactly what ``dcp.save({"model": m,
"optim": o})`` writes for ``m, o = get_state_dict(model, optimizer)``
(``torch.distributed.checkpoint.state_dict``) of a torch FSDP2 or
``fully_shard`` model: parameters and per-parameter optimizer state are
``DTensor(Shard(0))`` in both, ``step`` a plain 0-dim tensor, param groups
name parameters. So :func:`load` also takes such a directory (it has no
manifest, so there are no file hashes to verify), ``fully_shard`` models are
saved and loaded here through ``get_state_dict`` / ``set_state_dict``, and a
torch FSDP2 / ``fully_shard`` script loads this module's checkpoints with
``dcp.load`` (tests/dist/test_fully_shard_checkpoint.py).

A checkpoint spans the ranks that hold the model (see :func:`_group`): the
world, or the process group of a model wrapped on one (two models on
disjoint groups save independently); "rank" below is the rank in that group.

Atomicity: every rank writes into ``<dir>.tmp``; after a barrier rank 0
hashes the files, writes the manifest last and renames ``<dir>.tmp`` to
``<dir>`` (an existing ``<dir>`` is first renamed to ``<dir>.old`` and
removed after). A process killed at any point leaves either the previous
checkpoint at ``<dir>`` (or ``<dir>.old``, which ``load`` and the next
``save`` recover) or the new one: never a half-written ``<dir>``.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fullshard.digest import file_sha256

from ..api import StateDictType
from ..core import collectives
from ..core.module import unit_modules
from . import optim as optim_state, state_dict as state_dicts
from .manifest import (  # noqa: F401 (CheckpointError, read_extra, resolve, verify: also imported from here)
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    CheckpointError,
    _rank,
    _world,
    read_extra,
    resolve,
    verify,
)


def _barrier(group=None) -> None:
    if _world(group) > 1:
        collectives.barrier(group)


def _unit_group(cfg):
    return collectives.holding_group(cfg.shard_group, cfg.replicate_group)


def _group(model: nn.Module):
    """The process group a checkpoint of ``model`` spans: a FullyShardedDataParallel
    root's ranks (its group), a DDP model's process group, else the world
    (None). No collectives, so every rank reaches the same verdict.

    Raises:
        CheckpointError: a unit on other ranks than the root's (a per-rank
            expert on a one-rank group): its instances share one name with
            different values, of which torch.distributed.checkpoint would keep one.
    """
    if not collectives.is_initialized():
        return None
    units = unit_modules(model)
    if not units:
        return getattr(model, "process_group", None) if isinstance(model, nn.parallel.DistributedDataParallel) \
            else None
    group = _unit_group(units[0].unit.cfg)
    ranks = collectives.group_ranks(group)
    for u in units[1:]:
        theirs = collectives.group_ranks(_unit_group(u.unit.cfg))
        if theirs != ranks:
            raise CheckpointError(
                f"[rank {collectives.rank()}] unit '{u.unit.name}' is held by ranks {theirs}, the model by ranks "
                f"{ranks}: "
                "the unit's instances on other ranks have the same names and different values, of which a "
                "torch.distributed.checkpoint checkpoint keeps one; save such a model per rank with torch.save of "
                "model.state_dict() and FSDP.optim_state_dict(model, optimizer)")
    return group


def _is_fsdp(model: nn.Module) -> bool:
    return bool(unit_modules(model))


def _is_fully_shard(model: nn.Module) -> bool:
    """Every unit made by ``fully_shard``: state through torch's state-dict API (see [Note: one checkpoint format])."""
    units = unit_modules(model)
    return bool(units) and all(u.dtensor_params for u in units)


def _plain(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _states(model: nn.Module, optimizer) -> dict:
    """The sharded (FSDP, fully_shard) or plain (DDP, unwrapped) state under ``model`` / ``optim`` keys."""
    if _is_fully_shard(model):
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_state, optim_state_ = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state_}
    if _is_fsdp(model):
        prev = state_dicts.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        try:
            state = {"model": model.state_dict()}
            if optimizer is not None:
                state["optim"] = optim_state.optim_state_dict(model, optimizer)
        finally:
            state_dicts.restore(model, prev)
        return state
    state = {"model": _plain(model).state_dict()}
    if optimizer is not None:
        state["optim"] = optim_state.plain_optim_state_dict(_plain(model), optimizer)
    return state


def _states_in_parts(model: nn.Module, optimizer, parts_group) -> dict:
    """:func:`_states`; for a model in parts over ``parts_group`` (pipeline stages) each optimizer
    param group names the parameters of all parts (one all-gather), so every rank saves the same
    list and a checkpoint of the whole model maps onto any split of it."""
    state = _states(model, optimizer)
    if parts_group is None or "optim" not in state:
        return state
    groups = state["optim"]["param_groups"]
    everyone = collectives.all_gather_object([list(g["params"]) for g in groups], parts_group,
                                             tag="optimizer parameter names")
    if len({len(names) for names in everyone}) != 1:
        raise CheckpointError(f"[rank {collectives.rank()}] the optimizers of the model's parts have different "
                              "numbers of parameter groups; build each part's optimizer with the same groups")
    for i, g in enumerate(groups):
        merged = {}
        for names in everyone:
            merged.update(dict.fromkeys(names[i]))
        g["params"] = list(merged)
    return state


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _recover(final: str) -> None:
    """Undo a save killed between its two renames (rank 0 only)."""
    old = final + ".old"
    if os.path.isdir(old):
        if os.path.isdir(final):
            shutil.rmtree(old)
        else:
            os.rename(old, final)


def save(checkpoint_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[dict] = None, after_write: Optional[Callable[[str], None]] = None,
         process_group=None) -> float:
    """Write a sharded checkpoint (see [Note: checkpoint layout]); every rank calls it.

    Args:
        checkpoint_dir: the directory to create or replace.
        model: a FullyShardedDataParallel root, a DDP model or a plain module;
            every rank of its process group calls ``save`` (see :func:`_group`).
        optimizer: its optimizer (state saved by parameter name), or None.
        extra: this rank's picklable dict (RNG states, data position, ...);
            each rank's is kept and :func:`load` returns it to the same rank.
        after_write: called with the temporary directory once this rank's
            files are written, before they are published (the trainer's fault
            injection passes one; an exception it raises fails the save like
            a write error).
        process_group: the ranks the checkpoint spans when ``model`` is one part of a model spread
            over them (a pipeline stage: each rank passes its stages' module, by the plain
            model's names, and the group of all stages' ranks); None: the model's own group.
    Returns:
        Seconds the save took on this rank.
    Raises:
        CheckpointError: on every rank when any rank failed to write (e.g. a full disk):
            ``<dir>.tmp`` is removed and ``<dir>`` keeps the previous checkpoint;
            before writing, a model holding a unit on other ranks than its root's.
    """
    start = time.perf_counter()
    final = os.path.abspath(checkpoint_dir)
    tmp = final + ".tmp"
    group = process_group if process_group is not None else _group(model)
    rank, world = _rank(group), _world(group)
    error = None
    if rank == 0:
        try:
            _recover(final)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(error, final, tmp, "creating", group)
    try:
        state = _states_in_parts(model, optimizer, process_group)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group,
                 no_dist=world == 1)
        if extra is not None:
            torch.save(extra, os.path.join(tmp, f"extra-rank{rank}.pt"))
        if after_write is not None:
            after_write(tmp)
        del state
    except (Exception, dcp.api.CheckpointException) as e:  # a full disk on any rank (DCP gathers them)
        error = e
    _agree(error, final, tmp, "writing", group)  # every rank's files are complete
    if rank == 0:
        try:
            _publish(tmp, final, world)
        except OSError as e:
            error = e
    _agree(error, final, tmp, "publishing", group)
    return time.perf_counter() - start


def _publish(tmp: str, final: str, world: int) -> None:
    """Rank 0: hash the files, write the manifest last, rename ``tmp`` over ``final``."""
    files = {n: {"bytes": os.path.getsize(os.path.join(tmp, n)), "sha256": file_sha256(os.path.join(tmp, n))}
             for n in sorted(os.listdir(tmp))}
    manifest = {"format": FORMAT, "world_size": world, "files": files, "time": time.time()}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.isdir(final):
        os.rename(final, final + ".old")
        os.rename(tmp, final)
        shutil.rmtree(final + ".old")
    else:
        os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def _one_line(error: BaseException, group) -> tuple[int, str]:
    """(failing global rank, ``Type: message`` on one line); DCP's CheckpointException (keyed by
    rank in ``group``) is unwrapped to the first failing rank's own exception."""
    rank = collectives.rank()
    if isinstance(error, dcp.api.CheckpointException) and error.failures:
        first = min(error.failures)
        error = error.failures[first][0]
        rank = collectives.group_ranks(group)[first] if collectives.is_initialized() else first
    return rank, " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _agree(error: Optional[BaseException], final: str, tmp: str, phase: str, group) -> None:
    """Barrier over ``group`` that also tells every rank whether any rank failed; on failure its
    rank 0 removes ``tmp`` (the previous checkpoint at ``final`` is untouched) and every rank raises.

    Raises:
        CheckpointError: one line naming the failing rank, the error, and what was kept.
    """
    mine = None if error is None else _one_line(error, group)
    every = collectives.all_gather_object(mine, group, tag="checkpoint save status") if _world(group) > 1 else [mine]
    failed = [m for m in every if m is not None]
    if not failed:
        return
    if _rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    kept = (f"the previous checkpoint {final} is intact" if os.path.isdir(final) or os.path.isdir(final + ".old")
            else f"no checkpoint was written at {final}")
    r, m = min(failed)
    hint = "free disk space" if "No space left" in m or "ENOSPC" in m or "Errno 28" in m else "check the path"
    raise CheckpointError(f"[rank {collectives.rank()}] saving {final} failed on rank {r} while {phase} files: {m}; "
                          f"{kept}; {hint} and save again")


def _flat_keys(state: dict, prefix: str = "") -> dict:
    """Leaves of nested dicts and lists (extra state) under dotted keys, as
    ``torch.distributed.checkpoint`` names them in its metadata."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_keys(v, key + "."))
        elif isinstance(v, (list, tuple)) and v:
            out.update(_flat_keys(dict(enumerate(v)), key + "."))
        else:
            out[key] = v
    return out


def check_model_keys(path: str, template: dict, parts_group=None) -> None:
    """Refuse a checkpoint of another model, listing the names.

    Args:
        template: a state dict of the model (of this rank's part, with ``parts_group``).
        parts_group: the group over which the model is spread in parts (pipeline stages): the
            names of all ranks' parts together must be the checkpoint's (one all-gather).
    Raises:
        CheckpointError: names missing from the checkpoint, names it has that
            ``template`` (a state dict of the model) lacks, and shape mismatches.
    """
    template = _flat_keys(template)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: getattr(v, "size", None) for k, v in md.items() if k.startswith("model.")}
    missing = [k for k in template if k not in saved]
    known = set(template)
    if parts_group is not None:
        for keys in collectives.all_gather_object(sorted(known), parts_group, tag="checkpoint names"):
            known.update(keys)
    unexpected = [k for k in saved if k not in known]
    shapes = [f"'{k}': checkpoint {tuple(saved[k])} vs model {tuple(v.shape)}"
              for k, v in template.items() if k in saved and saved[k] is not None and torch.is_tensor(v)
              and torch.Size(saved[k]) != torch.Size(v.shape)]
    if missing or unexpected or shapes:
        parts = ([f"missing from checkpoint: {missing}"] if missing else []) + \
                ([f"not in model: {unexpected}"] if unexpected else []) + \
                ([f"shape mismatch: {'; '.join(shapes)}"] if shapes else [])
        raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {path} is of another model: " + " | ".join(parts)
                              + "; nothing was loaded")


def load(checkpoint_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         process_group=None) -> Any:
    """Load a checkpoint written by :func:`save`, or by ``dcp.save`` of torch's
    ``get_state_dict`` under ``model`` / ``optim`` keys (see [Note: one
    checkpoint format]), at any world size; every rank calls it. ``process_group``: as
    :func:`save`'s (a model spread over the group: each rank loads its part, and the names of all
    parts together must be the checkpoint's).

    Returns:
        This rank's ``extra`` (by rank in the model's group; rank 0's when the
        saving run had fewer ranks), or None.
    Raises:
        CheckpointError: missing/damaged files (named), or a checkpoint of
            another model (missing, unexpected and mis-shaped names listed),
            or a model holding a unit on other ranks than its root's; in all
            cases before anything is loaded.
    """
    path = resolve(checkpoint_dir)
    group = process_group if process_group is not None else _group(model)
    verify(path, group)
    fsdp = _is_fsdp(model)
    had_state = {id(p) for p, s in optimizer.state.items() if s} if optimizer is not None else set()
    if optimizer is not None:
        optim_state.init_optim_state(optimizer)
    try:
        state = _states_in_parts(model, optimizer, process_group)
        check_model_keys(path, state["model"], process_group)
        if optimizer is not None:
            _only_saved_optim_state(path, state["optim"])
        with warnings.catch_warnings():  # one rank: DCP's "assuming ... a single process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group, no_dist=_world(group) == 1)
    except BaseException as e:  # refused before anything was loaded: the optimizer as it was too
        for p in [p for p in optimizer.state if id(p) not in had_state] if optimizer is not None else []:
            del optimizer.state[p]  # the templates init_optim_state made
        if "Missing key in checkpoint state_dict: optim." in str(e):
            raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {path} holds no optimizer state of this "
                                  f"optimizer's form ({type(optimizer).__name__}; {_missing_key(e)}); load it without "
                                  "the optimizer, or with the optimizer it was saved with") from None
        raise
    if _is_fully_shard(model) and optimizer is None:
        set_model_state_dict(model, state["model"])
    elif _is_fully_shard(model):
        # Not strict: the model's keys were checked above, and the optimizer template holds what was saved.
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        _frozen_optim_state(model, optimizer, state["optim"])
    elif fsdp:
        prev = state_dicts.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        try:
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(optim_state.optim_state_dict_to_load(model, optimizer, state["optim"]))
        finally:
            state_dicts.restore(model, prev)
    else:
        _plain(model).load_state_dict(state["model"])
        if optimizer is not None:
            plain = optim_state.plain_optim_state_dict_to_load(_plain(model), optimizer, state["optim"])
            optimizer.load_state_dict(plain)
    return read_extra(path, _rank(group))


def _missing_key(e: BaseException) -> str:
    """The first key torch.distributed.checkpoint reported missing, for a one-line message."""
    text = str(e)  # DCP's message holds its rank tracebacks (with the f-string's source) before the key
    start = text.index("Missing key in checkpoint state_dict: optim.")
    return text[start:].splitlines()[0].rstrip(".")


def _only_saved_optim_state(path: str, optim: dict) -> None:
    """Drop from the load template the optimizer state the checkpoint does not hold: a parameter that had
    none when it was saved (not used yet) then has none after the load, as ``optimizer.load_state_dict``
    leaves it (the template, made by ``init_optim_state``, has an entry for every parameter)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    per_param = optim.get("state", {})
    for name in list(per_param):
        entry = per_param[name]
        for key in [k for k in entry if f"optim.state.{name}.{k}" not in saved]:
            del entry[key]
        if not entry:
            del per_param[name]


def _frozen_optim_state(model: nn.Module, optimizer, optim: dict) -> None:
    """torch's ``set_state_dict`` loads no optimizer state for a frozen parameter (``requires_grad``
    False); a parameter frozen since the save keeps the saved state, as ``optimizer.load_state_dict`` and
    the FSDP1 door keep it, so it trains on from it when unfrozen."""
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optim.get("state", {}).get(names.get(id(p)))
            if not p.requires_grad and entry:
                optimizer.state[p] = dict(entry)
