"""Atomic, collective save: every rank writes its shards into one temporary directory, rank 0 writes
``meta.json``, renames the directory into place and only then moves the ``latest`` pointer.

A process killed at any moment leaves either the previous checkpoint (and ``.tmp-*`` leftovers) or
the new one, never a ``latest`` pointing at something incomplete. The directory must be visible to
every rank (a shared filesystem when ranks run on several machines).

Temporary names carry the writer's ``run_tag``: a save removes leftovers of its own run's earlier
saves only, never another run's (which may be saving right now). A file-system failure on any rank
(no space, permissions, a ``latest`` that is a directory) is a :class:`CheckpointError` on every
rank naming the path, the step, the reason (for no space: what was needed and what was free) and the
newest complete checkpoint, which is left as it was; the failed save's temporary directory is removed,
also by the survivors of a peer that died or hung during the save (the engine's error is raised).

``owned`` names the step directories the caller may replace and prune (the Trainer passes the ones
its run wrote and the ones it resumed through): any other step directory is never deleted, and one
in the way of a new save is renamed to ``superseded-step_NNNNNNNN-<random>`` with a warning.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Collection, Mapping
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
from dtlab.checkpoint.save_args import check_save_arguments
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError

__all__ = ["save_checkpoint"]


def _to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    # clone: safetensors refuses tensors sharing storage (flat slices of one buffer)
    return st_save({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()})


def _write(tmp: Path, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    data = _to_bytes(tensors)
    durable_write(tmp / name, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _remove(path: Path, tag: str) -> None:
    """Rename first (atomic), so no half-deleted directory is ever visible under its own name."""
    trash = path.parent / f".tmp-old-{path.name}-{tag}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _abandon(tmp: Path, tag: str) -> None:
    """The temporary directory of a save that a peer's death or hang broke off, removed by every rank
    that saw the failure (renamed first: a rank 0 that committed it meanwhile keeps it, as renames are
    atomic; any failure here is ignored, the error being raised is the one to report)."""
    try:
        _remove(tmp, tag)
    except OSError:
        pass


def _remove_own_leftovers(root: Path, tag: str) -> None:
    """``.tmp-*`` leftovers of this run's earlier saves (step directories being written or deleted,
    ``latest`` pointers being written); another run's are never touched."""
    for stale in root.glob(f".tmp-*-{tag}-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            try:
                stale.unlink()
            except OSError:
                pass


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def newest_complete(root: Path) -> str:
    """The newest step directory in ``root`` holding ``meta.json`` (named, not verified), in words."""
    try:
        done = [p for _, p in list_step_dirs(root) if (p / META).is_file()]
    except OSError:
        done = []
    if not done:
        return f"no checkpoint was saved in {root} before"
    return f"the checkpoints saved before are intact, the newest complete one is {done[-1]}"


def save_failure(
    exc: OSError, what: Path, step: int, root: Path, needed: int | None = None, free: int | None = None
) -> str:
    """The message of a failed save: the path, the step, the reason, space, the newest checkpoint."""
    path = exc.filename or what
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and needed is not None:
        if free is None:
            try:
                free = shutil.disk_usage(root).free
            except OSError:
                free = None
        reason += f" (this rank's files of the step need {_mib(needed)}"
        reason += f", {_mib(free)} were free)" if free is not None else ")"
    return (
        f"checkpoint step {step} was not saved: {path}: {reason}; {newest_complete(root)}. Free space "
        f"(or set checkpoint.dir to another filesystem) and resume with checkpoint.resume=true"
    )


def _set_aside(final: Path, owned: Collection[str] | None, tag: str) -> None:
    """Make room for ``final``: replace it when the caller owns it, else keep it under a new name."""
    if not final.exists():
        return
    if owned is None or final.name in owned:
        _remove(final, tag)
        return
    kept = final.parent / f"superseded-{final.name}-{uuid.uuid4().hex[:8]}"
    os.rename(final, kept)
    logging.getLogger(__name__).warning(
        "%s existed and was not written by this run: moved to %s rather than overwritten; delete it "
        "when no longer needed",
        final,
        kept.name,
    )


def _prune(root: Path, keep_last: int, keep: str, owned: Collection[str] | None, tag: str) -> None:
    """Delete this run's older step directories; a failure is a warning (the new step is saved)."""
    steps = [p for _, p in list_step_dirs(root) if owned is None or p.name in owned or p.name == keep]
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.name != keep:
            try:
                _remove(old, tag)
            except OSError as exc:
                logging.getLogger(__name__).warning("could not delete the old checkpoint %s: %s", old, exc)


def _write_rank(
    tmp: Path,
    r: int,
    model_state: ShardedState,
    optim_state: ShardedState | None,
    rank_state: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """This rank's shard files in ``tmp``; refused before writing when the filesystem lacks the room."""
    parts = [("model", model_state.tensors), ("state", rank_state)]
    check_json(model_state.metadata, f"rank {r}'s model shard metadata")
    if optim_state is not None:
        check_json(optim_state.metadata, f"rank {r}'s optimizer shard metadata")
        parts.insert(1, ("optim", optim_state.tensors))
    needed = sum(t.numel() * t.element_size() for _, ts in parts for t in ts.values())
    free = shutil.disk_usage(tmp).free
    if free < needed:
        raise _WriteFailed(tmp, needed, free)
    files = {}
    try:
        for kind, tensors in parts:
            files[shard_name(kind, r)] = _write(tmp, shard_name(kind, r), tensors)
    except OSError as exc:
        raise _WriteFailed(tmp, needed, free, exc) from exc
    return {
        "rank": r,
        "files": files,
        "model": model_state.metadata,
        "optim": None if optim_state is None else optim_state.metadata,
    }


class _WriteFailed(Exception):
    """A rank's write failed (or would not fit): what it needed and what was free, for the message."""

    def __init__(self, tmp: Path, needed: int, free: int, cause: OSError | None = None) -> None:
        super().__init__(str(tmp))
        self.cause = cause or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        self.needed, self.free = needed, free


def _commit(
    root: Path,
    tmp: Path,
    step: int,
    meta: dict[str, Any],
    everyone: list[dict[str, Any]],
    world: int,
    keep_last: int,
    owned: Collection[str] | None,
    tag: str,
) -> None:
    """Rank 0: ``meta.json``, the step directory renamed into place, then ``latest``, then pruning."""
    final = root / step_dir_name(step)
    doc = dict(meta)
    doc.update(
        format_version=FORMAT_VERSION,
        step=step,
        world_size=world,
        ranks=[{k: v for k, v in e.items() if k != "files"} for e in everyone],
        files={fname: info for e in everyone for fname, info in e["files"].items()},
    )
    check_json(doc, "checkpoint metadata")
    durable_write(tmp / META, json.dumps(doc, indent=1, allow_nan=False).encode())
    fsync_dir(tmp)
    _set_aside(final, owned, tag)
    os.rename(tmp, final)
    fsync_dir(root)
    pointer = root / f".tmp-{LATEST}-{tag}-{uuid.uuid4().hex[:8]}"
    try:
        durable_write(pointer, (final.name + "\n").encode())
        os.replace(pointer, root / LATEST)
    except OSError:
        pointer.unlink(missing_ok=True)
        raise
    fsync_dir(root)
    _prune(root, keep_last, final.name, owned, tag)


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
    run_tag: str | None = None,
) -> Path:
    """Collective: save this rank's shards; returns the final step directory (on every rank).

    ``meta`` (rank 0's is written) holds trainer-level JSON: config, data position, counters.
    ``rank_state`` holds per-rank tensors such as RNG states. The ``keep_last`` newest step
    directories among ``owned`` (names; ``None``: every step directory in ``root``) and this one are
    kept, the older ones among ``owned`` deleted; see the module docstring for ``owned``. ``run_tag``
    (letters and digits, no ``-``) marks this run's temporary names; without it each call is its own.
    A failure on any rank: a :class:`CheckpointError` on every rank, the earlier checkpoints intact.
    """
    step, keep_last = check_save_arguments(
        root, step, backend, (model_state, optim_state, rank_state, meta), keep_last, run_tag
    )
    root = Path(root)
    tag = run_tag or uuid.uuid4().hex[:8]
    made: tuple[str | None, str | None] = (None, None)
    if backend.rank == 0:
        tmp = root / f".tmp-{step_dir_name(step)}-{tag}-{uuid.uuid4().hex[:8]}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_own_leftovers(root, tag)
            tmp.mkdir()
            made = (tmp.name, None)
        except OSError as exc:
            made = (None, save_failure(exc, tmp, step, root))
    try:
        name, error = backend.broadcast_object(made, src=0)
    except BaseException:  # a peer died or hung: this save's directory is nobody's
        if made[0] is not None:
            _abandon(root / made[0], tag)
        raise
    if error is not None:
        raise CheckpointError(error)
    tmp = root / name
    try:
        return _write_and_commit(
            root, tmp, step, backend, model_state, optim_state, rank_state, meta, (keep_last, owned, tag)
        )
    except BaseException:  # a peer died or hung mid-save: no run would ever remove this directory
        _abandon(tmp, tag)
        raise


def _write_and_commit(
    root: Path,
    tmp: Path,
    step: int,
    backend: CommunicationBackend,
    model_state: ShardedState,
    optim_state: ShardedState | None,
    rank_state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    pruning: tuple[int, Collection[str] | None, str],
) -> Path:
    """Steps 2 to 4 of :func:`save_checkpoint`, in the temporary directory ``tmp`` of every rank."""
    keep_last, owned, tag = pruning
    r = backend.rank
    mine: dict[str, Any]
    try:
        mine = _write_rank(tmp, r, model_state, optim_state, rank_state)
    except _WriteFailed as exc:
        mine = {"error": f"rank {r}: " + save_failure(exc.cause, tmp, step, root, exc.needed, exc.free)}
    except OSError as exc:
        mine = {"error": f"rank {r}: " + save_failure(exc, tmp, step, root)}
    except CheckpointError as exc:
        mine = {"error": f"rank {r}: {exc}"}
    everyone = backend.all_gather_object(mine)
    errors = [e["error"] for e in everyone if "error" in e]
    if r == 0:
        outcome = None
        if not errors:
            try:
                _commit(root, tmp, step, meta, everyone, backend.world_size, keep_last, owned, tag)
            except OSError as exc:
                outcome = save_failure(exc, root / step_dir_name(step), step, root)
            except CheckpointError as exc:
                outcome = str(exc)
        if errors or outcome is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own temporary directory
        if outcome is not None:
            errors.append(outcome)
    errors = backend.broadcast_object(errors if r == 0 else None, src=0)
    if errors:
        raise CheckpointError(errors[0])
    return root / step_dir_name(step)
