"""Atomic, collective save: every rank writes its shards into one temporary directory, rank 0 writes
``meta.json``, renames the directory into place and only then moves the ``latest`` pointer.

A process killed at any moment leaves either the previous checkpoint (and ``.tmp-*`` leftovers that
the next save removes) or the new one, never a ``latest`` pointing at something incomplete. The
directory must be visible to every rank (a shared filesystem when ranks run on several machines).

``owned`` names the step directories the caller may replace and prune (the Trainer passes the ones
its run wrote and the ones it resumed through): any other step directory is never deleted, and one
in the way of a new save is renamed to ``superseded-step_NNNNNNNN-<random>`` with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Collection
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
    list_step_dirs,
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


def _remove(path: Path) -> None:
    """Rename first (atomic), so no half-deleted directory is ever visible under its own name."""
    trash = path.parent / f".tmp-old-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """``.tmp-*`` leftovers of an earlier crash: step directories being written or deleted, and
    ``latest`` pointers being written (files)."""
    for stale in root.glob(".tmp-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            try:
                stale.unlink()
            except OSError:
                pass


def _set_aside(final: Path, owned: Collection[str] | None) -> None:
    """Make room for ``final``: replace it when the caller owns it, else keep it under a new name."""
    if not final.exists():
        return
    if owned is None or final.name in owned:
        _remove(final)
        return
    kept = final.parent / f"superseded-{final.name}-{uuid.uuid4().hex[:8]}"
    os.rename(final, kept)
    logging.getLogger(__name__).warning(
        "%s existed and was not written by this run: moved to %s rather than overwritten; delete it "
        "when no longer needed",
        final,
        kept.name,
    )


def _prune(root: Path, keep_last: int, keep: str, owned: Collection[str] | None) -> None:
    steps = [p for _, p in list_step_dirs(root) if owned is None or p.name in owned or p.name == keep]
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.name != keep:
            _remove(old)


def save_checkpoint(
    root: str | Path,
    step: int,
    backend: CommunicationBackend,
    model_state: ShardedState,
    optim_state: ShardedState | None,
    rank_state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    keep_last: int = 2,
    owned: Collection[str] | None = None,
) -> Path:
    """Collective: save this rank's shards; returns the final step directory (on every rank).

    ``meta`` (rank 0's is written) holds trainer-level JSON: config, data position, counters.
    ``rank_state`` holds per-rank tensors such as RNG states. The ``keep_last`` newest step
    directories among ``owned`` (names; ``None``: every step directory in ``root``) and this one are
    kept, the older ones among ``owned`` deleted; see the module docstring for ``owned``.
    """
    root = Path(root)
    name = None
    if backend.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
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
        _set_aside(final, owned)
        os.rename(tmp, final)
        fsync_dir(root)
        pointer = root / f".tmp-{LATEST}-{uuid.uuid4().hex[:8]}"
        durable_write(pointer, (final.name + "\n").encode())
        os.replace(pointer, root / LATEST)
        fsync_dir(root)
        _prune(root, keep_last, final.name, owned)
    backend.barrier()
    return final
