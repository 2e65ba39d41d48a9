"""File checksums shared by the data cache and checkpoint manifests."""
from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB blocks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
