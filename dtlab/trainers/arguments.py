"""The arguments of :func:`~dtlab.trainers.run_training` and :class:`~dtlab.trainers.Trainer` checked
before anything reads them: a config, backend, task or stop request of another kind is one error naming
it and what to pass (not an ``AttributeError`` from deep inside)."""

from __future__ import annotations

from dtlab.backends.base import check_backend
from dtlab.config import TrainConfig
from dtlab.errors import ArgumentTypeError
from dtlab.trainers.embedded import Task
from dtlab.trainers.preemption import check_stop

__all__ = ["check_arguments"]


def check_arguments(who: str, config: object, task: object, stop: object, *backend: object) -> None:
    """Refuses what ``who`` was given (``backend``: the Trainer's, absent for ``run_training``)."""
    if not isinstance(config, TrainConfig):
        raise ArgumentTypeError(
            f"{who} takes a dtlab.config.TrainConfig, got {type(config).__name__}; build one with "
            "dtlab.config.load_config(path, overrides=['train.steps=20', ...])"
        )
    for b in backend:
        check_backend(b, who)
    if task is not None and not isinstance(task, Task):
        raise ArgumentTypeError(
            f"{who}: task must be a dtlab.trainers.Task (or None for the config's), got "
            f"{type(task).__name__}; for your own model and data pass model=, train_data=, loss_fn="
        )
    if stop is not None:
        check_stop(who, stop, " (or None)")
