"""Atomic, collective save: every rank writes its shards into one temporary directory, rank 0 writes
``meta.json``, renames the directory into place and only then moves the ``latest`` pointer.

A process killed at any moment leaves either the previous checkpoint (and a ``.tmp-*`` directory that
the next save removes) or the new one, never a ``latest`` pointing at something incomplete. The
directory must be visible to every rank (a shared filesystem when ranks run on several machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint.files import (
    FORMAT_VERSION,
    LATEST,
    META,
    check_json,
    durable_write,
    fsync_dir,
    shard_name,
    step_dir_name,
)
from dtlab.core.state import ShardedState

__all__ = ["save_checkpoint"]


def _to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    # clone: safetensors refuses tensors sharing storage (flat slices of one buffer)
    return st_save({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()})


def _write(tmp: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = _to_bytes(tensors)
    durable_write(tmp / name, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _prune(root: Path, keep_last: int, keep: str) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.name != keep:  # rename first (atomic), so no half-deleted step directory is ever visible
            trash = root / f".tmp-old-{old.name}-{uuid.uuid4().hex[:8]}"
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(
    root: str | Path,
    step: int,
    backend: CommunicationBackend,
    model_state: ShardedState,
    optim_state: ShardedState | None,
    rank_state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Collective: save this rank's shards; returns the final step directory (on every rank).

    ``meta`` (rank 0's is written) holds trainer-level JSON: config, data position, counters.
    ``rank_state`` holds per-rank tensors such as RNG states.
    """
    root = Path(root)
    name = None
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        name = tmp.name
    name = backend.broadcast_object(name, src=0)
    tmp = root / name
    r = backend.rank
    check_json(model_state.metadata, f"rank {r}'s model shard metadata")
    files = {shard_name("model", r): _write(tmp, shard_name("model", r), model_state.tensors)}
    if optim_state is not None:
        check_json(optim_state.metadata, f"rank {r}'s optimizer shard metadata")
        files[shard_name("optim", r)] = _write(tmp, shard_name("optim", r), optim_state.tensors)
    files[shard_name("state", r)] = _write(tmp, shard_name("state", r), rank_state)
    mine = {
        "rank": r,
        "files": files,
        "model": model_state.metadata,
        "optim": None if optim_state is None else optim_state.metadata,
    }
    everyone = backend.all_gather_object(mine)
    final = root / step_dir_name(step)
    if r == 0:
        doc = dict(meta)
        doc.update(
            format_version=FORMAT_VERSION,
            step=step,
            world_size=backend.world_size,
            ranks=[{k: v for k, v in e.items() if k != "files"} for e in everyone],
            files={fname: info for e in everyone for fname, info in e["files"].items()},
        )
        check_json(doc, "checkpoint metadata")
        durable_write(tmp / META, json.dumps(doc, indent=1, allow_nan=False).encode())
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): move the old one out first
            trash = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(root)
        pointer = root / f".tmp-{LATEST}-{uuid.uuid4().hex[:8]}"
        durable_write(pointer, (final.name + "\n").encode())
        os.replace(pointer, root / LATEST)
        fsync_dir(root)
        _prune(root, keep_last, keep=final.name)
    backend.barrier()
    return final
