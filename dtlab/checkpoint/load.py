"""Reading checkpoints: every file's size and SHA-256 checked against ``meta.json`` before use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from dtlab.checkpoint.files import FORMAT_VERSION, LATEST, META, shard_name, step_of
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError

__all__ = ["LoadedCheckpoint", "read_checkpoint", "read_latest", "resolve_checkpoint"]


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

    A :class:`CheckpointError` when the pointer cannot be read or names anything but a step directory
    directly inside ``root`` (an absolute path, ``..``, a path with separators): such a pointer is
    never followed.
    """
    pointer = root / LATEST
    if not pointer.is_file():
        if pointer.exists():
            what = "a directory" if pointer.is_dir() else "not a regular file"
            raise CheckpointError(
                f"{pointer} is {what}, not the file naming the newest step directory that dtlab writes"
            )
        return None
    try:
        text = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} cannot be read ({exc})") from None
    if step_of(text) is None:
        raise CheckpointError(
            f"{pointer} names {text[:200]!r}, which is not a step directory inside {root} "
            "(step_NNNNNNNN); refusing to follow it"
        )
    return text


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory (holding ``meta.json``) or a checkpoint root (its ``latest`` pointer)."""
    p = Path(path)
    if (p / META).is_file():
        return p
    name = read_latest(p)
    if name is not None:
        target = p / name
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


def _read_meta(step_dir: Path) -> dict[str, Any]:
    path = step_dir / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupted (not valid JSON: {exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is corrupted: it holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format_version')!r}, but this dtlab reads format "
            f"{FORMAT_VERSION}; load it with the dtlab version that wrote it"
        )
    missing = [k for k in ("step", "world_size", "ranks", "files") if k not in meta]
    if missing or not isinstance(meta["step"], int) or not isinstance(meta["world_size"], int):
        raise CheckpointError(
            f"{path} is corrupted: missing {missing} or a non-integer step/world_size; "
            "resume from another step directory"
        )
    return meta


def _read_tensors(step_dir: Path, name: str, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    import hashlib

    path = step_dir / name
    if not path.is_file():
        raise CheckpointError(
            f"shard file {path} is missing; the checkpoint is incomplete: resume from another step directory"
        )
    data = path.read_bytes()
    if len(data) != int(info["bytes"]):
        raise CheckpointError(
            f"shard file {path} is truncated or extended: {len(data)} bytes, expected {info['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise CheckpointError(f"shard file {path} is corrupted: its SHA-256 differs from the one in {META}")
    try:
        return st_load(data)
    except SafetensorError as exc:  # pragma: no cover - the checksum catches this first
        raise CheckpointError(f"shard file {path} is not a valid safetensors file: {exc}") from None


def read_checkpoint(path: str | Path, with_optimizer: bool = True) -> LoadedCheckpoint:
    """Read and verify every rank's shards (tensors on CPU)."""
    step_dir = resolve_checkpoint(path)
    meta = _read_meta(step_dir)
    model, optim, states = [], [], []
    try:
        files: dict[str, Any] = meta["files"]
        for entry in meta["ranks"]:
            r = int(entry["rank"])
            name = shard_name("model", r)
            model.append(ShardedState(_read_tensors(step_dir, name, files[name]), entry["model"]))
            if with_optimizer and entry.get("optim") is not None:
                name = shard_name("optim", r)
                optim.append(ShardedState(_read_tensors(step_dir, name, files[name]), entry["optim"]))
            name = shard_name("state", r)
            states.append(_read_tensors(step_dir, name, files[name]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"{step_dir / META} is corrupted: {type(exc).__name__} {exc} while reading its entries; "
            "resume from another step directory"
        ) from None
    return LoadedCheckpoint(step_dir, meta, model, optim if optim else None, states)
