"""A checkpoint directory's manifest (``fullshard.json``: sizes and sha256 of every file) and what reads
the directory without loading the model: :func:`resolve`, :func:`verify`, :func:`read_extra`
(``save_load.py`` [Note: checkpoint layout] describes the directory).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from fullshard.digest import file_sha256

from ..core import collectives

MANIFEST = "fullshard.json"
FORMAT = "fullshard-dcp-v1"
DCP_METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: corrupted, missing, or of another model."""


def _world(group=None) -> int:
    return collectives.group_size(group) if collectives.is_initialized() else 1


def _rank(group=None) -> int:
    return collectives.group_rank(group) if collectives.is_initialized() else 0


def resolve(checkpoint_dir: str) -> str:
    """The directory holding the checkpoint ``checkpoint_dir`` names: itself, or
    ``<dir>.old`` left by a save killed while publishing; or itself when it is
    a plain ``torch.distributed.checkpoint`` directory (``.metadata``, no
    manifest; DCP writes ``.metadata`` last, so its save finished).

    Raises:
        CheckpointError: none of these holds a finished checkpoint.
    """
    final = os.path.abspath(checkpoint_dir)
    for path in (final, final + ".old"):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    if os.path.isfile(os.path.join(final, DCP_METADATA)):
        if any(n.startswith("extra-rank") for n in os.listdir(final)):  # ours, its manifest lost: no hashes
            raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {final} has lost its {MANIFEST} (the "
                                  "sizes and sha256 of its files), so its files cannot be checked; restore it from a "
                                  "copy, or load an earlier checkpoint")
        return final
    raise CheckpointError(f"[rank {collectives.rank()}] no checkpoint at {final} (neither {MANIFEST} nor "
                          f"{DCP_METADATA}: the directory is missing or its save did not finish)")


def verify(path: str, group=None) -> dict:
    """Check every file of the manifest (size and sha256; files split over
    the ranks of ``group``, None = the world); returns the manifest, or
    ``{}`` for a plain ``torch.distributed.checkpoint`` directory (no
    manifest, so no sizes or hashes to check; see :func:`resolve`).

    Raises:
        CheckpointError: no checkpoint at ``path``, a damaged manifest, or
            naming each missing, truncated or corrupted file.
    """
    path = resolve(path)
    manifest = _read_manifest(path)
    if not manifest:
        return {}
    rank, world = _rank(group), _world(group)
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
    every = [b for theirs in (collectives.all_gather_object(bad, group) if world > 1 else [bad]) for b in theirs]
    if every:
        raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {path} is damaged: {', '.join(every)}; "
                              "load an earlier checkpoint")
    return manifest


def _read_manifest(path: str) -> dict:
    """The manifest of resolved checkpoint ``path``; ``{}`` for a plain DCP directory.

    Raises:
        CheckpointError: the manifest is not readable JSON.
    """
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return {}
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {path}: its {MANIFEST} is damaged ({e}); "
                              "load an earlier checkpoint") from None


def read_extra(checkpoint_dir: str, rank: int = 0) -> Any:
    """Rank ``rank``'s ``extra`` dict of a checkpoint (rank 0's when the saving
    run had fewer ranks), or None; offline, no process group needed. The file
    is checked against the manifest's sha256 first.

    Raises:
        CheckpointError: no finished checkpoint at ``checkpoint_dir``, or the
            file (or the manifest) is damaged.
    """
    path = resolve(checkpoint_dir)
    files = _read_manifest(path).get("files", {})
    for name in (f"extra-rank{rank}.pt", "extra-rank0.pt"):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            if name in files and file_sha256(full) != files[name]["sha256"]:  # read alone, without verify()
                raise CheckpointError(f"[rank {collectives.rank()}] checkpoint {path} is damaged: {name} "
                                      "(corrupted: sha256 differs); load an earlier checkpoint")
            return torch.load(full, weights_only=False)
    return None
