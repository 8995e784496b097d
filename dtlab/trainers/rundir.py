"""The run directory: a fresh one per run, ``latest`` beside it, a resume continuing its own.

``logging.run_dir`` may hold ``{time}`` (the default ``runs/{time}``): it becomes the run's start
time, ``20261125-070221``. A directory that already holds another run's ``metrics.jsonl`` is never
written over: a fresh run takes the next free ``-2``, ``-3`` ... suffix. A resumed run continues the
directory its checkpoint was written from (recorded in the checkpoint's trainer state) when the
setting is a ``{time}`` template, or the directory named. ``latest``, a symbolic link beside the run
directory, points to the newest run (not replaced when something else has that name).
Rank 0 chooses; every rank learns the choice (one broadcast), only rank 0 writes there.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint.agree import agree
from dtlab.config import TrainConfig
from dtlab.errors import UnsafePathError
from dtlab.trainers.metrics import MetricsCollector

__all__ = ["TIME_FORMAT", "choose_run_dir", "open_metrics", "template_root", "update_latest"]

#: what ``{time}`` becomes: local time, sortable
TIME_FORMAT = "%Y%m%d-%H%M%S"
METRICS = "metrics.jsonl"


def template_root(value: str) -> str:
    """The part of ``logging.run_dir`` before its first ``{time}`` component (what must exist)."""
    if "{time}" not in value:
        return value
    parts = Path(value).parts
    i = next(i for i, part in enumerate(parts) if "{time}" in part)
    return str(Path(*parts[:i])) if i else "."


def _free(path: Path) -> Path:
    """``path`` itself when it holds no run's metrics, else the first ``path-N`` that does not."""
    if not (path / METRICS).exists():
        return path
    n = 2
    while (path.with_name(f"{path.name}-{n}") / METRICS).exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


def choose_run_dir(
    value: str | None, resumed: bool, recorded: str | None, now: float | None = None
) -> Path | None:
    """This run's directory (rank 0): ``recorded`` is the directory the resumed checkpoint's run wrote."""
    if value is None:
        return None
    templated = "{time}" in value
    if resumed and templated and recorded and Path(recorded).is_dir():
        return Path(recorded)  # a resume continues its own run's directory
    path = Path(value.replace("{time}", time.strftime(TIME_FORMAT, time.localtime(now))))
    return path if resumed else _free(path)


def update_latest(run_dir: Path) -> None:
    """``latest`` beside ``run_dir`` now points to it (atomically); something else named ``latest``
    (a file or a directory) is left alone."""
    link = run_dir.parent / "latest"
    if run_dir.name == "latest" or (link.exists() and not link.is_symlink()):
        return
    tmp = run_dir.parent / f".latest-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:  # a filesystem without symbolic links: the run directory itself is what counts
        tmp.unlink(missing_ok=True)


def open_metrics(
    config: TrainConfig, backend: CommunicationBackend, resumed: bool, recorded: str | None
) -> tuple[Path | None, MetricsCollector]:
    """Collective: the run directory (chosen on rank 0, the same on every rank) and the metrics
    collector writing there on rank 0, with the configured sinks (TensorBoard, W&B, CSV).
    ``resumed``: the run starts past step 0; ``recorded``: the run directory its checkpoint names."""
    from dtlab.trainers.sinks import build_sinks

    log, is_main = config.logging, backend.rank == 0
    chosen = None
    if backend.rank == 0:
        path = choose_run_dir(log.run_dir, resumed, recorded)
        chosen = None if path is None else str(path)
    run_dir = _agree(backend, chosen)
    path = None if run_dir is None else Path(run_dir)
    sinks: list[Any] = []
    problem = None
    try:
        if path is not None and is_main:
            path.mkdir(parents=True, exist_ok=True)
            update_latest(path)
            sinks = build_sinks(config, path)
        metrics = MetricsCollector(
            path / METRICS if path is not None else None,
            enabled=is_main,
            append=resumed,  # a resumed run continues its file; a fresh run has a directory of its own
            sinks=sinks,
        )
    except UnsafePathError as exc:  # a link planted at metrics.jsonl: every rank stops, named
        problem = str(exc)
    if backend.world_size > 1:
        agree(backend, problem, "opening the run directory's files", UnsafePathError)
    elif problem is not None:
        raise UnsafePathError(problem)
    return path, metrics


def _agree(backend: CommunicationBackend, chosen: str | None) -> str | None:
    if backend.world_size == 1:
        return chosen
    result = backend.broadcast_object(chosen, src=0)
    return result if isinstance(result, str) else None
