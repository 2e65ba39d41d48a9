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
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from .. import faults
from ..api import StateDictType
from ..core import collectives as C
from . import optim as O
from . import state_dict as SD
from fullshard.digest import file_sha256

MANIFEST = "fullshard.json"
FORMAT = "fullshard-dcp-v1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: corrupted, missing, or of another model."""


def _world() -> int:
    return C.world_size() if C.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        C.barrier()


def _is_fsdp(model: nn.Module) -> bool:
    return bool(SD._units_of(model))


def _plain(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _states(model: nn.Module, optimizer) -> dict:
    """The sharded (FSDP) or plain (DDP, unwrapped) state under ``model`` / ``optim`` keys."""
    if _is_fsdp(model):
        prev = SD.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        try:
            state = {"model": model.state_dict()}
            if optimizer is not None:
                state["optim"] = O.optim_state_dict(model, optimizer)
        finally:
            SD.restore(model, prev)
        return state
    state = {"model": _plain(model).state_dict()}
    if optimizer is not None:
        state["optim"] = O.plain_optim_state_dict(_plain(model), optimizer)
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
         extra: Optional[dict] = None) -> float:
    """Write a sharded checkpoint (see [Note: checkpoint layout]); every rank calls it.

    Args:
        checkpoint_dir: the directory to create or replace.
        model: a FullyShardedDataParallel root, a DDP model or a plain module.
        optimizer: its optimizer (state saved by parameter name), or None.
        extra: this rank's picklable dict (RNG states, data position, ...);
            each rank's is kept and :func:`load` returns it to the same rank.
    Returns:
        Seconds the save took on this rank.
    Raises:
        CheckpointError: on every rank when any rank failed to write (e.g. a full disk):
            ``<dir>.tmp`` is removed and ``<dir>`` keeps the previous checkpoint.
    """
    start = time.perf_counter()
    final = os.path.abspath(checkpoint_dir)
    tmp = final + ".tmp"
    rank, world = C.rank(), _world()
    error = None
    if rank == 0:
        try:
            _recover(final)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(error, final, tmp, "creating")
    try:
        state = _states(model, optimizer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=world == 1)
        if extra is not None:
            torch.save(extra, os.path.join(tmp, f"extra-rank{rank}.pt"))
        faults.on_save(tmp)
        del state
    except (Exception, dcp.api.CheckpointException) as e:  # a full disk on any rank (DCP gathers them)
        error = e
    _agree(error, final, tmp, "writing")  # every rank's files are complete
    if rank == 0:
        try:
            _publish(tmp, final, world)
        except OSError as e:
            error = e
    _agree(error, final, tmp, "publishing")
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


def _one_line(error: BaseException) -> tuple[int, str]:
    """(failing rank, ``Type: message`` on one line); DCP's CheckpointException is unwrapped to
    the first failing rank's own exception."""
    rank = C.rank()
    if isinstance(error, dcp.api.CheckpointException) and error.failures:
        rank = min(error.failures)
        error = error.failures[rank][0]
    return rank, " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _agree(error: Optional[BaseException], final: str, tmp: str, phase: str) -> None:
    """Barrier that also tells every rank whether any rank failed; on failure rank 0 removes
    ``tmp`` (the previous checkpoint at ``final`` is untouched) and every rank raises.

    Raises:
        CheckpointError: one line naming the failing rank, the error, and what was kept.
    """
    mine = None if error is None else _one_line(error)
    every = C.all_gather_object(mine, tag="checkpoint save status") if _world() > 1 else [mine]
    failed = [m for m in every if m is not None]
    if not failed:
        return
    if C.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    kept = (f"the previous checkpoint {final} is intact" if os.path.isdir(final) or os.path.isdir(final + ".old")
            else f"no checkpoint was written at {final}")
    r, m = min(failed)
    hint = "free disk space" if "No space left" in m or "ENOSPC" in m or "Errno 28" in m else "check the path"
    raise CheckpointError(f"[rank {C.rank()}] saving {final} failed on rank {r} while {phase} files: {m}; "
                          f"{kept}; {hint} and save again")


def _resolve(checkpoint_dir: str) -> str:
    final = os.path.abspath(checkpoint_dir)
    for path in (final, final + ".old"):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    raise CheckpointError(f"[rank {C.rank()}] no checkpoint at {final} (no {MANIFEST}: the directory is "
                          "missing or its save did not finish)")


def verify(path: str) -> dict:
    """Check every file of the manifest (size and sha256; files split over
    ranks); returns the manifest.

    Raises:
        CheckpointError: naming each missing, truncated or corrupted file.
    """
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    rank, world = C.rank(), _world()
    bad = []
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        if i % world != rank:
            continue
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            bad.append(f"{name} (missing)")
        elif os.path.getsize(full) != info["bytes"]:
            bad.append(f"{name} (truncated: {os.path.getsize(full)} of {info['bytes']} bytes)")
        elif file_sha256(full) != info["sha256"]:
            bad.append(f"{name} (corrupted: sha256 differs)")
    every = [b for theirs in (C.all_gather_object(bad) if world > 1 else [bad]) for b in theirs]
    if every:
        raise CheckpointError(f"[rank {rank}] checkpoint {path} is damaged: {', '.join(every)}; "
                              "load an earlier checkpoint")
    return manifest


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


def _check_model_keys(path: str, template: dict) -> None:
    """Refuse a checkpoint of another model, listing the names."""
    template = _flat_keys(template)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: getattr(v, "size", None) for k, v in md.items() if k.startswith("model.")}
    missing = [k for k in template if k not in saved]
    unexpected = [k for k in saved if k not in template]
    shapes = [f"'{k}': checkpoint {tuple(saved[k])} vs model {tuple(v.shape)}"
              for k, v in template.items() if k in saved and saved[k] is not None and torch.is_tensor(v)
              and torch.Size(saved[k]) != torch.Size(v.shape)]
    if missing or unexpected or shapes:
        parts = ([f"missing from checkpoint: {missing}"] if missing else []) + \
                ([f"not in model: {unexpected}"] if unexpected else []) + \
                ([f"shape mismatch: {'; '.join(shapes)}"] if shapes else [])
        raise CheckpointError(f"[rank {C.rank()}] checkpoint {path} is of another model: " + " | ".join(parts)
                              + "; nothing was loaded")


def load(checkpoint_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Load a checkpoint written by :func:`save` at any world size; every rank calls it.

    Returns:
        This rank's ``extra`` (rank 0's when the saving run had fewer ranks),
        or None.
    Raises:
        CheckpointError: missing/damaged files (named), or a checkpoint of
            another model (missing, unexpected and mis-shaped names listed);
            in both cases before anything is loaded.
    """
    path = _resolve(checkpoint_dir)
    verify(path)
    fsdp = _is_fsdp(model)
    if optimizer is not None:
        O.init_optim_state(optimizer)
    state = _states(model, optimizer)
    _check_model_keys(path, state["model"])
    world = _world()
    with warnings.catch_warnings():  # one rank: DCP's "assuming ... a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=world == 1)
    if fsdp:
        prev = SD.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        try:
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(O.optim_state_dict_to_load(model, optimizer, state["optim"]))
        finally:
            SD.restore(model, prev)
    else:
        _plain(model).load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(O.plain_optim_state_dict_to_load(_plain(model), optimizer, state["optim"]))
    return read_extra(path, C.rank())


def read_extra(checkpoint_dir: str, rank: int = 0) -> Any:
    """Rank ``rank``'s ``extra`` dict of a checkpoint (rank 0's when the saving
    run had fewer ranks), or None; offline, no process group needed.

    Raises:
        CheckpointError: no finished checkpoint at ``checkpoint_dir``.
    """
    path = _resolve(checkpoint_dir)
    for name in (f"extra-rank{rank}.pt", "extra-rank0.pt"):
        if os.path.isfile(os.path.join(path, name)):
            return torch.load(os.path.join(path, name), weights_only=False)
    return None
