"""Pre-flight: every path the config names is checked before any training work, so a run is not
lost at its first save to a directory it cannot write.

``checkpoint.dir`` and ``logging.run_dir`` must be directories that can be created and written (a
probe file is created, fsynced and removed, and so are the directories the check created);
``checkpoint.resume``, when a path, must exist and be readable; ``model.pretrained`` must exist. All
problems are one :class:`~dtlab.errors.ConfigError` naming the field, the path and the reason.
:func:`check_paths_on_every_rank` also checks that every rank sees ``checkpoint.dir`` (a file rank 0
writes there): with ranks on several machines it must be a shared filesystem.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig
from dtlab.errors import ConfigError

__all__ = ["check_paths", "check_paths_on_every_rank"]

_PROBE = ".dtlab-write-probe-"


def _create(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the directories it created, deepest last."""
    made = []
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        made.append(d)
    return made


def _probe(path: Path, keep: bool = False) -> Path:
    probe = path / f"{_PROBE}{uuid.uuid4().hex[:12]}"
    with open(probe, "wb") as f:
        f.write(b"dtlab")
        f.flush()
        os.fsync(f.fileno())
    if not keep:
        probe.unlink()
    return probe


def _writable_dir(
    field: str, value: str, made: list[Path], keep_probe: bool = False
) -> tuple[str | None, Path | None]:
    """``(problem, probe left behind)`` for a directory that must be created and written."""
    path = Path(value)
    try:
        if path.exists() and not path.is_dir():
            return f"{field}={value!r} exists and is not a directory", None
        made += _create(path)
    except OSError as exc:
        return f"{field}={value!r} cannot be created: {_reason(exc, value)}", None
    try:
        return None, _probe(path, keep=keep_probe)
    except OSError as exc:
        return (
            f"{field}={value!r} is not writable (a probe file could not be written: {_reason(exc, value)})",
            None,
        )


def _reason(exc: OSError, value: str) -> str:
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != value else ""
    return f"{exc.strerror or exc}{where}"


def _cleanup(probe: Path | None, made: list[Path]) -> None:
    """Leave no trace: the probe file and the directories the check created (the run makes them
    again when it first writes there)."""
    if probe is not None:
        probe.unlink(missing_ok=True)
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            pass


def _problems(config: TrainConfig) -> tuple[list[str], Path | None, list[Path]]:
    """``(problems, probe file left in checkpoint.dir, directories created)``; clean up with ``_cleanup``."""
    problems: list[str] = []
    made: list[Path] = []
    probe = None
    c, log = config.checkpoint, config.logging
    if c.dir is not None:
        problem, probe = _writable_dir("checkpoint.dir", c.dir, made, keep_probe=True)
        problems += [problem] if problem else []
    if log.run_dir is not None:  # with {time}: the directory the run's own will be made in
        from dtlab.trainers.rundir import template_root

        problem, _ = _writable_dir("logging.run_dir", template_root(log.run_dir), made)
        problems += [problem] if problem else []
    if isinstance(c.resume, str):
        p = Path(c.resume)
        try:
            if not p.exists():
                problems.append(
                    f"checkpoint.resume={c.resume!r} does not exist: give a checkpoint directory (or one "
                    "of its step_* directories), or true to resume from checkpoint.dir (a fresh start "
                    "when it holds none)"
                )
            elif not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
                problems.append(f"checkpoint.resume={c.resume!r} cannot be read: permission denied")
        except OSError as exc:  # a name too long for the filesystem, a loop of links
            problems.append(f"checkpoint.resume={c.resume!r} cannot be read: {_reason(exc, c.resume)}")
    pretrained = config.model.pretrained
    if pretrained is not None and not Path(pretrained).exists():
        problems.append(
            f"model.pretrained={pretrained!r} does not exist: give a .safetensors file, a folder holding "
            "model.safetensors or model.safetensors.index.json (save_pretrained's output), or the file "
            "dtlab consolidate wrote"
        )
    return problems, probe, made


def _error(problems: list[str]) -> ConfigError:
    dirs = any(p.startswith(("checkpoint.dir", "logging.run_dir")) for p in problems)
    return ConfigError(
        "unusable path"
        + ("s" if len(problems) > 1 else "")
        + " in the configuration: "
        + "; ".join(problems)
        + (
            "; choose directories this user can create and write "
            "(checkpoint.dir on a filesystem every rank sees)"
            if dirs
            else ""
        )
    )


def check_paths(config: TrainConfig) -> None:
    """Local check of every path the config names: one ``ConfigError`` listing every problem."""
    problems, probe, made = _problems(config)
    _cleanup(probe, made)
    if problems:
        raise _error(problems)


def check_paths_on_every_rank(config: TrainConfig, backend: CommunicationBackend) -> None:
    """Collective: rank 0 checks every path; every other rank checks that it sees ``checkpoint.dir``
    (a probe file rank 0 left there) and can write into it. Every rank raises the same ``ConfigError``."""
    msg: tuple[list[str], str | None] | None = None
    probe: Path | None = None
    made: list[Path] = []
    if backend.rank == 0:
        problems, probe, made = _problems(config)
        msg = (problems, None if probe is None else probe.name)
    problems, probe_name = backend.broadcast_object(msg, src=0)
    mine = None
    c = config.checkpoint
    if not problems and backend.rank != 0 and c.dir is not None and probe_name is not None:
        if not (Path(c.dir) / probe_name).is_file():
            mine = (
                f"checkpoint.dir={c.dir!r} is not the same directory on rank {backend.rank} as on rank 0 "
                "(a file rank 0 wrote there is not visible): with ranks on several machines it must be "
                "on a shared filesystem"
            )
        else:
            try:
                _probe(Path(c.dir))
            except OSError as exc:
                mine = (
                    f"checkpoint.dir={c.dir!r} is not writable on rank {backend.rank}: {_reason(exc, c.dir)}"
                )
    others = backend.all_gather_object(mine)
    _cleanup(probe, made)
    problems = problems + [m for m in others if m]
    if problems:
        raise _error(problems)
