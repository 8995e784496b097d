"""What :meth:`Trainer.fit <dtlab.trainers.Trainer.fit>` returns on each rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    #: (step, loss averaged over the data-parallel group) of every applied step (skipped steps are absent)
    losses: list[tuple[int, float]] = field(default_factory=list)
    #: (step, {"eval_loss": ..., "eval_accuracy": ... for classification}) of every evaluation
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    final_step: int = 0
    rank: int = 0
    start_step: int = 0
    stopped_early: bool = False
    checkpoint: str | None = None
    #: the signal (``"SIGTERM"``, ``"SIGINT"``) or reason that stopped training before ``train.steps``
    preempted_by: str | None = None
    #: the step directory this run resumed from (``None``: a fresh start)
    resumed_from: str | None = None
    #: problems met while choosing it (a broken ``latest``, a newest step that did not verify, ...)
    resume_notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    #: the directory its metrics, profile, ``loss.png`` (and event files) went to; None: not written
    run_dir: str | None = None
