"""A task: the model to build, its data and its loss. The embedded tasks come from the config;
pass your own :class:`Task` to :class:`~dtlab.trainers.Trainer` to train anything else."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.config import TrainConfig
from dtlab.data import TensorDataset, load_digits_dataset, stdlib_lm_dataset
from dtlab.trainers.models import Block, DigitsCNN, TransformerLM

__all__ = ["Task", "build_task", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position (works for ``(B, C)`` and ``(B, T, C)`` logits)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@dataclass(frozen=True)
class Task:
    #: builds the model; the trainer seeds torch before calling it so every rank builds the same one
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
    #: in-memory ranks are threads sharing torch's global RNG: building the model under this lock
    #: (with a forked, seeded RNG) makes every rank's initial model the same and reproducible
    init_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


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
