"""Which checkpoint a resume takes: the one ``latest`` names, or else the newest step directory that
verifies (every file's size and SHA-256 against ``meta.json``), with a note naming every problem met.

The rules (docs/checkpoints.md, "What dtlab promises when things fail"):

- ``latest`` names a step directory that verifies: take it, unless a newer step directory continues
  it (its ``meta.json`` says it was written by the same run, ``run.id``, or by a run that resumed
  from it, ``run.resumed_from``) and verifies: that is a save interrupted before the pointer moved,
  and the newest such one is taken. Other newer step directories (another run's, or an abandoned
  branch after a resume from an older step) are named in a note, not taken.
- ``latest`` is missing: take the newest step directory that verifies (a note says so).
- ``latest`` is unreadable, names something outside the checkpoint directory, names a directory that
  is gone, or its checkpoint does not verify: fall back to the newest step directory that verifies,
  with a note naming what was wrong; with ``strict=True`` a :class:`CheckpointError` instead.
- nothing verifies: a :class:`CheckpointError` naming each step directory and its problem.

"Verifies" includes ``meta.json`` checked like a config (``validate.py``), every file and the step
directory resolving inside the checkpoint directory (unless ``allow_outside``), and the caller's own
``check`` of what it will restore (the Trainer checks its saved state): a step directory failing any
of them is corrupt and passed over like one whose checksum differs.

Nothing here writes or deletes anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.checkpoint.files import LATEST, META, list_step_dirs
from dtlab.checkpoint.load import MAX_META_BYTES, LoadedCheckpoint, read_checkpoint, read_latest
from dtlab.checkpoint.safe_files import check_inside, read_inside
from dtlab.checkpoint.validate import parse_json
from dtlab.errors import ArgumentTypeError, CheckpointError, check_path, check_switches

#: what a caller checks of a checkpoint before taking it (raises ``CheckpointError``)
Check = Callable[[LoadedCheckpoint], None]

__all__ = ["ResumePoint", "find_resume_checkpoint"]

_STRICT = "checkpoint.strict_resume=true refuses to fall back to an older step directory"


@dataclass
class ResumePoint:
    #: the verified checkpoint to resume from; ``None``: nothing was ever saved there (a fresh start)
    checkpoint: LoadedCheckpoint | None
    #: one line per problem met or directory passed over, for the run's log and metrics
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Reader:
    root: Path
    with_optimizer: bool
    allow_outside: bool
    check: Check | None

    def verify(self, path: Path) -> LoadedCheckpoint:
        if not self.allow_outside:
            check_inside(path, self.root, "step directory")
        ckpt = read_checkpoint(path, self.with_optimizer, self.allow_outside)
        if self.check is not None:
            self.check(ckpt)
        return ckpt


def _run_of(meta: Any) -> dict[str, Any]:
    run = meta.get("run") if isinstance(meta, dict) else None
    return run if isinstance(run, dict) else {}


def _continues(path: Path, base: LoadedCheckpoint) -> bool:
    """Whether step directory ``path`` was written by the run that wrote ``base`` or by a run that
    resumed from ``base`` (read from the ``run`` entries of both ``meta.json``; no tensors read)."""
    try:
        run = _run_of(parse_json(read_inside(path / META, path, META, limit=MAX_META_BYTES), path / META))
    except CheckpointError:
        return False
    base_id = _run_of(base.meta).get("id")
    if base_id is not None and run.get("id") == base_id:
        return True
    parent = run.get("resumed_from")
    if not isinstance(parent, str):
        return False
    try:
        return Path(parent).resolve() == base.path.resolve()
    except OSError:
        return False


def _newer(name: str, steps: list[tuple[int, Path]], base: LoadedCheckpoint, reader: _Reader) -> ResumePoint:
    """``latest`` names ``base`` (verified): a newer step directory continuing it wins if it verifies."""
    notes: list[str] = []
    others = []
    for s, path in reversed(steps):
        if s <= base.step:
            break
        if not _continues(path, base):
            others.append(path.name)
            continue
        try:
            ckpt = reader.verify(path)
        except CheckpointError as exc:
            notes.append(f"{path.name} continues {name} but was not taken: {exc}")
            continue
        notes.append(
            f"took {path.name}, newer than {name} which {LATEST} names: the same run's save, "
            f"interrupted before {LATEST} moved"
        )
        return ResumePoint(ckpt, notes)
    if others:
        notes.append(
            f"{', '.join(reversed(others))} in {reader.root} {'is' if len(others) == 1 else 'are'} "
            f"newer than {name}, which {LATEST} names, but another run's (or a branch abandoned by a "
            "resume from an older step): not taken, kept, set aside if this run saves the same step; "
            "resume from one with checkpoint.resume=<its path>"
        )
    return ResumePoint(base, notes)


def find_resume_checkpoint(
    root: str | Path,
    strict: bool = False,
    with_optimizer: bool = True,
    allow_outside: bool = False,
    check: Check | None = None,
) -> ResumePoint:
    """The checkpoint a resume from checkpoint root ``root`` takes (read and verified), see above.

    ``root`` missing or holding neither ``latest`` nor a step directory: ``ResumePoint(None)``.
    """
    check_path("find_resume_checkpoint", "root", root, "the checkpoint directory")
    check_switches(
        "find_resume_checkpoint", strict=strict, with_optimizer=with_optimizer, allow_outside=allow_outside
    )
    if check is not None and not callable(check):
        raise ArgumentTypeError(
            "find_resume_checkpoint: check must be a function of the loaded checkpoint (or None), got "
            f"{check!r}"
        )
    root = Path(root)
    reader = _Reader(root, with_optimizer, allow_outside, check)
    if not root.exists():
        return ResumePoint(None)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} is not a directory")
    steps = list_step_dirs(root)
    notes: list[str] = []
    try:
        name = read_latest(root)
        pointer_problem = None
    except CheckpointError as exc:
        name, pointer_problem = None, str(exc)
    if name is None and pointer_problem is None and not steps:
        return ResumePoint(None)

    candidates = [p for _, p in reversed(steps)]  # newest first
    if name is not None:
        target = root / name
        if target.is_dir():
            try:
                ckpt = reader.verify(target)
            except CheckpointError as exc:
                pointer_problem = f"{root / LATEST} names {name}, which does not verify: {exc}"
            else:
                return _newer(name, steps, ckpt, reader)
        else:
            pointer_problem = f"{root / LATEST} names {name}, which does not exist in {root}"
        candidates = [p for p in candidates if p != target]
    elif pointer_problem is None:
        notes.append(f"{root} has no {LATEST} pointer: taking the newest step directory that verifies")

    if pointer_problem is not None:
        if strict:
            raise CheckpointError(f"{pointer_problem}; {_STRICT}")
        notes.append(pointer_problem)
    return _first_verifying(reader, root, candidates, strict, pointer_problem, notes)


def _first_verifying(
    reader: _Reader,
    root: Path,
    candidates: list[Path],
    strict: bool,
    pointer_problem: str | None,
    notes: list[str],
) -> ResumePoint:
    """The newest of ``candidates`` that verifies (``latest`` did not give one)."""
    failed: list[str] = []
    for i, path in enumerate(candidates):
        try:
            ckpt = reader.verify(path)
        except CheckpointError as exc:
            if strict and i == 0 and pointer_problem is None:
                raise CheckpointError(
                    f"the newest step directory does not verify: {exc}; {_STRICT}"
                ) from None
            failed.append(f"{path.name}: {exc}")
            notes.append(f"{path.name} was not taken: {exc}")
            continue
        if pointer_problem is not None or failed:
            notes.append(f"fell back to {path.name}, the newest step directory in {root} that verifies")
        return ResumePoint(ckpt, notes)
    problems = [pointer_problem] if pointer_problem else []
    problems += failed
    raise CheckpointError(
        f"no checkpoint in {root} can be resumed: {'; '.join(problems) or 'no step directory'}; "
        "move the directory away, or set checkpoint.resume=false to start fresh there (a fresh run "
        "keeps every step directory it did not write)"
    )
