"""A run owns its ``checkpoint.dir`` from before its first step to its end (``dtlab/checkpoint/lock.py``).

Rank 0 takes the directory's lock and every rank learns the outcome (one broadcast): a directory
another live run holds is a :class:`CheckpointError` on every rank, before any step. Taking it also
names what earlier runs left there: leftovers of their interrupted saves (``.tmp-*``, kept: a run
deletes only what it wrote) and a ``latest`` that is not a regular file (moved aside once the resume
has chosen, so that the first save does not fail on it). A resume that would take a step written by
another run (another ``train.seed``, or not the run whose stale lock this one took over) says so, and
``checkpoint.strict_resume`` refuses it.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint.files import LATEST
from dtlab.checkpoint.load import LoadedCheckpoint
from dtlab.checkpoint.lock import LOCK, DirectoryLock, LockOwner
from dtlab.config import TrainConfig
from dtlab.errors import CheckpointError

__all__ = ["DirectoryHold", "another_run", "hold_checkpoint_dir"]


def _leftovers(root: Path) -> str | None:
    found = [p for p in root.glob(".tmp-*") if not p.name.startswith((".tmp-lock-", ".tmp-stale-lock-"))]
    if not found:
        return None
    size = 0
    for p in found:
        for f in [p, *p.rglob("*")] if p.is_dir() else [p]:
            try:
                size += f.stat().st_size if f.is_file() else 0
            except OSError:
                pass
    names = ", ".join(sorted(p.name for p in found)[:3]) + (", ..." if len(found) > 3 else "")
    return (
        f"{root} holds {len(found)} leftover(s) of interrupted saves by other runs ({names}; "
        f"{size / 2**20:.1f} MiB): kept, a run deletes only what it wrote; delete them once no run "
        "uses the directory"
    )


class DirectoryHold:
    """This rank's view of the run's hold on ``checkpoint.dir`` (the lock itself lives on rank 0)."""

    def __init__(self, config: TrainConfig, backend: CommunicationBackend, run_id: str) -> None:
        self.config, self.backend, self.run_id = config, backend, run_id
        self.lock: DirectoryLock | None = None
        #: warnings for the run's log: a stale lock taken over, other runs' leftovers
        self.notes: list[str] = []
        #: the owner of the stale lock this run took over (rank 0), to tell another run's steps
        self.previous: LockOwner | None = None
        #: the same on every rank: whether the run holds the directory now
        self.taken = False

    def acquire(self) -> None:
        """Collective: take the lock (rank 0); a :class:`CheckpointError` on every rank when refused."""
        root = self.config.checkpoint.dir
        if root is None or self.taken:
            return
        msg: tuple[str | None, list[str]] = (None, [])
        if self.backend.rank == 0:
            owner = LockOwner.of_this_process(self.run_id)
            lock = DirectoryLock(root, owner, self.config.checkpoint.lock_stale_after)
            try:
                notes, self.previous = lock.acquire()
                self.lock = lock
                left = _leftovers(Path(root))
                msg = (None, notes + ([left] if left else []))
            except CheckpointError as exc:
                msg = (str(exc), [])
            except OSError as exc:
                msg = (f"cannot take the lock {Path(root) / LOCK} of checkpoint.dir={root!r}: {exc}", [])
        error, notes = self.backend.broadcast_object(msg, src=0)
        if error is not None:
            raise CheckpointError(error)
        self.notes = notes
        self.taken = True

    def record_resume(self, ckpt: LoadedCheckpoint) -> None:
        """Rank 0: the lock records which run wrote the checkpoint resumed from (this run's lineage)."""
        if self.lock is None:
            return
        try:
            self.lock.update(resumed_run=_run_id(ckpt.meta))
        except OSError as exc:
            logging.getLogger(__name__).warning("could not update the lock %s: %s", self.lock.path, exc)

    def settle_latest(self) -> None:
        """Collective, once the resume has chosen: a ``latest`` that is not a regular file is moved
        aside (named in a note) so that the first save can write the pointer."""
        if self.config.checkpoint.dir is None:
            return
        msg: tuple[str | None, list[str]] = (None, [])
        if self.backend.rank == 0:
            root = Path(self.config.checkpoint.dir)
            pointer = root / LATEST
            try:
                if (pointer.exists() or pointer.is_symlink()) and not pointer.is_file():
                    aside = root / f"superseded-{LATEST}-{uuid.uuid4().hex[:8]}"
                    os.rename(pointer, aside)
                    msg = (None, [f"{pointer} was not a regular file: moved to {aside.name} (kept)"])
            except OSError as exc:
                msg = (f"checkpoint.dir={str(root)!r}: cannot move {pointer} aside: {exc}", [])
        error, notes = self.backend.broadcast_object(msg, src=0)
        if error is not None:
            raise CheckpointError(error)
        self.notes += notes

    def refresh(self) -> None:
        if self.lock is not None:
            self.lock.refresh()

    def release(self) -> None:
        """Local (rank 0 removes the lock file): at the run's end, and on any failure."""
        self.taken = False
        if self.lock is not None:
            self.lock.release()


def hold_checkpoint_dir(config: TrainConfig, backend: CommunicationBackend, run_id: str) -> DirectoryHold:
    """Collective: the run's hold on ``checkpoint.dir`` (nothing when it is unset), taken."""
    hold = DirectoryHold(config, backend, run_id)
    hold.acquire()
    return hold


def _run_id(meta: Any) -> str | None:
    run = meta.get("run") if isinstance(meta, dict) else None
    rid = run.get("id") if isinstance(run, dict) else None
    return rid if isinstance(rid, str) else None


def another_run(config: TrainConfig, ckpt: LoadedCheckpoint, previous: LockOwner | None) -> str | None:
    """Why ``ckpt`` was written by another run than the one resuming (``None``: it was not seen to be):
    another ``train.seed``, or not by the run whose stale lock this run took over (nor the step that
    run resumed from)."""
    saved = ckpt.meta.get("config")
    train = saved.get("train") if isinstance(saved, dict) else None
    seed = train.get("seed") if isinstance(train, dict) else None
    if isinstance(seed, int) and seed != config.train.seed:
        return f"{ckpt.path} was written by a run with train.seed={seed}, this run's is {config.train.seed}"
    rid = _run_id(ckpt.meta)
    if previous is not None and rid is not None and rid not in (previous.run_id, previous.resumed_run):
        return (
            f"{ckpt.path} was written by run {rid[:12]}, not by {previous.describe()}, whose lock on "
            f"{ckpt.path.parent} this run took over (nor by the run that one resumed from)"
        )
    return None
