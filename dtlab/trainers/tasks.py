"""A task: the model to build, its data and its loss. The embedded tasks come from the config;
pass your own :class:`Task` to :class:`~dtlab.trainers.Trainer` to train anything else."""

from __future__ import annotations

from dtlab.config import TrainConfig
from dtlab.errors import ConfigError
from dtlab.trainers.arguments import check_arguments
from dtlab.trainers.custom import task_from_config
from dtlab.trainers.embedded import (
    Task,
    builtin_data,
    builtin_model,
    builtin_task,
    cross_entropy_loss,
    logits_of,
)

__all__ = [
    "Task",
    "build_task",
    "builtin_data",
    "builtin_model",
    "builtin_task",
    "check_task",
    "cross_entropy_loss",
    "logits_of",
]


def build_task(config: TrainConfig) -> Task:
    """The task the config describes: the embedded one, or your own model, data and loss
    (``model.factory``, ``data.factory``, ``model.loss``; checked here, before any rank starts)."""
    check_arguments("build_task", config, None, None)
    m = config.model
    if m.factory is None and config.data.factory is None and m.loss is None:
        return builtin_task(config)
    return task_from_config(config)


def check_task(config: TrainConfig, task: Task, world_size: int) -> None:
    """Checks that need the data's size, run before any model is built: a ``ConfigError`` naming the field.

    The training data must hold one global batch; with evaluation on, the held-out data must give every
    rank at least one sample (each evaluates an equal share).
    """
    d = config.data
    more = "raise data.max_bytes" if task.name == "stdlib-transformer-lm" else "use more data"
    n_train, n_eval = len(task.train_data), len(task.eval_data)
    if n_train < d.global_batch_size:
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} is larger than the {n_train} training samples "
            f"of {task.name}; lower data.global_batch_size (a multiple of world size x "
            f"data.accumulation_steps = {world_size * d.accumulation_steps}) or {more}"
        )
    if config.train.eval_every and n_eval < world_size:
        raise ConfigError(
            f"data.eval_fraction={d.eval_fraction} holds out {n_eval} samples of {task.name}, fewer than the "
            f"{world_size} ranks (each evaluates an equal share); raise data.eval_fraction or {more}, "
            "or set train.eval_every=0"
        )
