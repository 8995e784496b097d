"""Reading checkpoints: ``meta.json`` checked like a config (``validate.py``), then every file's size
and SHA-256 checked against it on the open file before the file is read (``safe_files.py``); files
and step directories that resolve outside their directory are refused unless explicitly allowed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from dtlab.checkpoint.files import LATEST, META, shard_name, step_of
from dtlab.checkpoint.safe_files import check_inside, read_inside
from dtlab.checkpoint.validate import MAX_SHARD_BYTES, check_meta, parse_json
from dtlab.core.shard_index import ShardIndex, check_entries
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError

__all__ = ["LoadedCheckpoint", "read_checkpoint", "read_latest", "resolve_checkpoint"]

#: the largest ``meta.json`` read (it is JSON metadata: kilobytes to a few megabytes)
MAX_META_BYTES = 256 << 20
#: the largest ``latest`` pointer read (it holds one step directory name)
MAX_POINTER_BYTES = 4096


@dataclass
class LoadedCheckpoint:
    path: Path
    meta: dict[str, Any]
    model: list[ShardedState]
    optim: list[ShardedState] | None
    #: per saved rank: RNG states and other per-rank tensors
    rank_states: list[dict[str, torch.Tensor]]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])


def read_latest(root: Path) -> str | None:
    """The step directory name ``root/latest`` holds; ``None`` when there is no pointer.

    A :class:`CheckpointError` when the pointer cannot be read (a link, not a regular file, larger
    than a name) or names anything but a step directory directly inside ``root`` (an absolute path,
    ``..``, a path with separators): such a pointer is never followed, and its content never quoted.
    """
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return None
    if pointer.is_dir() and not pointer.is_symlink():
        raise CheckpointError(
            f"{pointer} is a directory, not the file naming the newest step directory that dtlab writes"
        )
    data = read_inside(pointer, None, "the pointer", limit=MAX_POINTER_BYTES)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    if step_of(text) is None:
        raise CheckpointError(
            f"{pointer} does not name a step directory inside {root} (it holds {len(data)} bytes; a "
            "pointer holds one name, step_NNNNNNNN); refusing to follow it"
        )
    return text


def resolve_checkpoint(path: str | Path, allow_outside: bool = False) -> Path:
    """A step directory (holding ``meta.json``) or a checkpoint root (its ``latest`` pointer); the
    step directory ``latest`` names must resolve inside the root unless ``allow_outside``."""
    p = Path(path)
    if (p / META).is_file():
        return p
    name = read_latest(p)
    if name is not None:
        target = p / name
        if not allow_outside:
            check_inside(target, p, "step directory")
        if not (target / META).is_file():
            raise CheckpointError(
                f"{p / LATEST} names {target.name!r}, which has no {META}; the checkpoint is gone"
            )
        return target
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist")
    raise CheckpointError(
        f"{str(p)!r} is neither a step directory (no {META}) nor a checkpoint root (no {LATEST})"
    )


def _read_meta(step_dir: Path, allow_outside: bool) -> dict[str, Any]:
    path = step_dir / META
    data = read_inside(path, step_dir, META, limit=MAX_META_BYTES, allow_outside=allow_outside)
    return check_meta(parse_json(data, path), path, step_dir)


def _read_tensors(
    step_dir: Path, name: str, info: dict[str, Any], allow_outside: bool
) -> dict[str, torch.Tensor]:
    path = step_dir / name
    if not os.path.lexists(path):
        raise CheckpointError(
            f"shard file {path} is missing; the checkpoint is incomplete: resume from another step directory"
        )
    data = read_inside(
        path,
        step_dir,
        "shard file",
        limit=MAX_SHARD_BYTES,
        size=info["bytes"],
        sha256=info["sha256"],
        allow_outside=allow_outside,
    )
    try:
        return st_load(data)
    except SafetensorError as exc:  # a crafted file whose checksum was crafted to match
        raise CheckpointError(f"shard file {path} is not a valid safetensors file: {exc}") from None


def _shard(step_dir: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> ShardedState:
    state = ShardedState(tensors, metadata)
    check_entries(state, f"{step_dir / META}")
    return state


def read_checkpoint(
    path: str | Path, with_optimizer: bool = True, allow_outside: bool = False
) -> LoadedCheckpoint:
    """Read and verify every rank's shards (tensors on CPU). ``meta.json`` is checked first (types,
    ranges, the shape and dtype of every entry against the tensors the shards hold) and every file
    must resolve inside the step directory, unless ``allow_outside``."""
    step_dir = resolve_checkpoint(path, allow_outside)
    meta = _read_meta(step_dir, allow_outside)
    model, optim, states = [], [], []
    files: dict[str, Any] = meta["files"]
    for entry in meta["ranks"]:
        r = entry["rank"]
        name = shard_name("model", r)
        model.append(
            _shard(step_dir, _read_tensors(step_dir, name, files[name], allow_outside), entry["model"])
        )
        if with_optimizer and entry.get("optim") is not None:
            name = shard_name("optim", r)
            tensors = _read_tensors(step_dir, name, files[name], allow_outside)
            optim.append(_shard(step_dir, tensors, entry["optim"]))
        name = shard_name("state", r)
        states.append(_read_tensors(step_dir, name, files[name], allow_outside))
    for shards in (model, optim):
        if shards and all("entries" in s.metadata for s in shards):
            ShardIndex(shards).check_complete(str(step_dir / META))
    return LoadedCheckpoint(step_dir, meta, model, optim if optim else None, states)
