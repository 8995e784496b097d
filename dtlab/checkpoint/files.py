"""File-level helpers: names, durable writes, checksums."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["LATEST", "META", "durable_write", "fsync_dir", "sha256_file", "shard_name", "step_dir_name"]

META = "meta.json"
LATEST = "latest"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(kind: str, rank: int) -> str:
    return f"{kind}_rank{rank:05d}.safetensors"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
