"""File-level helpers: names, durable writes, checksums."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from dtlab.errors import CheckpointError

__all__ = [
    "LATEST",
    "META",
    "check_json",
    "durable_write",
    "fsync_dir",
    "list_step_dirs",
    "sha256_file",
    "shard_name",
    "step_dir_name",
    "step_of",
]

META = "meta.json"
LATEST = "latest"
FORMAT_VERSION = 1


#: a step directory's name: ``step_`` and the step, zero-padded to at least 8 digits
_STEP_DIR = re.compile(r"step_(\d{8,})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a step directory's name stands for; ``None`` for any other name."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step directory directly in ``root``, oldest first."""
    found = []
    for p in root.iterdir():
        step = step_of(p.name)
        if step is not None and p.is_dir():
            found.append((step, p))
    return sorted(found)


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
    """Write ``data`` to ``path`` and fsync it before returning; a symbolic link at ``path`` is a
    :class:`CheckpointError` naming it, never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link; dtlab does not write through links") from None
        raise
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _as_json_types(obj: Any) -> Any:
    """``obj`` with tuples as lists: the one change a JSON round trip may make without losing data."""
    if isinstance(obj, dict):
        return {k: _as_json_types(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_as_json_types(v) for v in obj]
    return obj


def check_json(obj: Any, what: str) -> None:
    """``obj`` must survive JSON unchanged: a ``Counter`` with int keys, say, would come back with
    string keys and resume wrongly, so it is refused at save time rather than misread at load time."""
    try:
        text = json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON-serialisable ({exc}); checkpoints store metadata as JSON"
        ) from None
    if json.loads(text) != _as_json_types(obj):
        raise CheckpointError(
            f"{what} does not survive a JSON round trip unchanged (non-string dict keys?); checkpoints "
            "store metadata as JSON: keep such state as lists or string-keyed dicts"
        )
