"""Reading checkpoints: ``meta.json`` checked like a config (``validate.py``), then every file's size,
SHA-256 and header checked against it on the open file before any tensor of it is read
(``shard_file.py``); files and step directories that resolve outside their directory are refused
unless explicitly allowed.

The shards come back lazy (:class:`~dtlab.core.state.LazyTensors`): a tensor is read from its verified
file when it is used, and :class:`~dtlab.core.shard_index.ShardIndex` reads only the ranges a rank
loads, so a rank holds what it keeps, not every saved rank's state."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dtlab.checkpoint.files import LATEST, META, shard_name, step_of
from dtlab.checkpoint.safe_files import check_inside, read_inside
from dtlab.checkpoint.shard_file import ReadCounts, ShardFile
from dtlab.checkpoint.validate import MAX_SHARD_BYTES, check_meta, parse_json
from dtlab.core.shard_index import ShardIndex, check_entries
from dtlab.core.state import LazyTensors, ShardedState
from dtlab.errors import CheckpointError, check_switches

__all__ = ["LoadedCheckpoint", "ReadCounts", "read_checkpoint", "read_latest", "resolve_checkpoint"]

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
    #: per saved rank: RNG states and other per-rank tensors (read from the file when used)
    rank_states: list[MutableMapping[str, torch.Tensor]]
    #: what was read from disk and materialised so far (grows as tensors are used)
    reads: ReadCounts = field(default_factory=ReadCounts)

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


def _file(
    step_dir: Path, kind: str, rank: int, files: dict[str, Any], counts: ReadCounts, allow_outside: bool
) -> ShardFile:
    name = shard_name(kind, rank)
    info = files[name]
    return ShardFile(
        step_dir / name, step_dir, info["bytes"], info["sha256"], MAX_SHARD_BYTES, counts, allow_outside
    )


def _shard(file: ShardFile, metadata: dict[str, Any], where: str, verify: bool) -> ShardedState:
    """A lazy shard of ``file``: its entries are checked against the file's header once it is verified
    (now, when ``verify``), their metadata now."""
    state = ShardedState(LazyTensors(file), metadata)
    file.check = partial(check_entries, state, where)
    if verify:
        file.verify()
    else:
        check_entries(state, where)
    return state


def read_checkpoint(
    path: str | Path, with_optimizer: bool = True, allow_outside: bool = False, verify_all: bool = True
) -> LoadedCheckpoint:
    """Every saved rank's shards, read lazily (tensors on CPU, read from disk when used: a rank that
    loads its part reads only that). ``meta.json`` is checked first (types, ranges, every entry's
    shape, dtype and range) and every file must resolve inside the step directory, unless
    ``allow_outside``. With ``verify_all`` every file is verified now (streamed through SHA-256 and its
    header checked against ``meta.json``, nothing held); without, each file is verified when a tensor of
    it is first used, and a file this rank never uses is never opened (after another rank verified the
    checkpoint: the Trainer's rank 0 verifies every file of the checkpoint it chooses)."""
    check_switches(
        "read_checkpoint", with_optimizer=with_optimizer, allow_outside=allow_outside, verify_all=verify_all
    )
    step_dir = resolve_checkpoint(path, allow_outside)
    meta = _read_meta(step_dir, allow_outside)
    where = str(step_dir / META)
    counts = ReadCounts()
    model, optim, states = [], [], []
    files: dict[str, Any] = meta["files"]
    for entry in meta["ranks"]:
        r = entry["rank"]
        model.append(
            _shard(
                _file(step_dir, "model", r, files, counts, allow_outside), entry["model"], where, verify_all
            )
        )
        if with_optimizer and entry.get("optim") is not None:
            f = _file(step_dir, "optim", r, files, counts, allow_outside)
            optim.append(_shard(f, entry["optim"], where, verify_all))
        f = _file(step_dir, "state", r, files, counts, allow_outside)
        if verify_all:
            f.verify()
        states.append(LazyTensors(f))
    for shards in (model, optim):
        if shards and all("entries" in s.metadata for s in shards):
            ShardIndex(shards).check_complete(where)
    return LoadedCheckpoint(step_dir, meta, model, optim if optim else None, list(states), counts)
