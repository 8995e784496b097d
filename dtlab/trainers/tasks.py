"""A task: the model to build, its data and its loss. The embedded tasks come from the config;
pass your own :class:`Task` to :class:`~dtlab.trainers.Trainer` to train anything else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.config import TrainConfig
from dtlab.data import TensorDataset, load_digits_dataset, stdlib_lm_dataset
from dtlab.errors import ConfigError
from dtlab.trainers.models import Block, DigitsCNN, TransformerLM

__all__ = ["Task", "build_task", "check_task", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position (works for ``(B, C)`` and ``(B, T, C)`` logits)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@dataclass(frozen=True)
class Task:
    #: builds the model; the trainer calls it inside ``dtlab.core.seeded_init(train.seed)`` (torch's
    #: global RNG seeded, one build at a time in the process), so every rank builds the same model in
    #: every run, however and wherever the task was made
    build_model: Callable[[], nn.Module]
    train_data: TensorDataset
    eval_data: TensorDataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    #: tokens per sample (for tokens/s); 1 for classification
    tokens_per_sample: int = 1
    #: module classes FSDP wraps as units (``None``: the strategy's default policy)
    fsdp_unit_classes: tuple[type[nn.Module], ...] | None = None
    name: str = "custom"
    #: classification: evaluation also reports accuracy (argmax of the last dimension)
    classification: bool = False


def build_task(config: TrainConfig) -> Task:
    m, d = config.model, config.data
    if d.dataset == "stdlib":
        full = stdlib_lm_dataset(d.max_bytes, m.seq_len)
        train, evals = full.split(d.eval_fraction)
        return Task(
            build_model=lambda: TransformerLM(m.d_model, m.n_layers, m.n_heads, m.seq_len, m.dropout),
            train_data=train,
            eval_data=evals,
            tokens_per_sample=m.seq_len,
            fsdp_unit_classes=(Block,),
            name="stdlib-transformer-lm",
        )
    full = load_digits_dataset()
    train, evals = full.split(d.eval_fraction)
    return Task(
        build_model=DigitsCNN, train_data=train, eval_data=evals, name="digits-cnn", classification=True
    )


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
