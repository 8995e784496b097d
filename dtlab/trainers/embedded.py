"""The embedded tasks and what a task is: the model to build, its data and its loss (the config's
``model.name`` and ``data.dataset``). :mod:`dtlab.trainers.tasks` builds any task a config describes;
tasks of your own (``model.factory``, ``data.factory``) are :mod:`dtlab.trainers.custom`'s."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.config import TrainConfig
from dtlab.data import TensorDataset, load_digits_dataset, stdlib_lm_dataset
from dtlab.errors import ArgumentTypeError, ConfigError, check_switches
from dtlab.models.tensor import whole_cross_entropy
from dtlab.parallel_config import check_builtin_fits
from dtlab.zoo import Block, DigitsCNN, TransformerLM

__all__ = ["Task", "builtin_data", "builtin_model", "builtin_task", "cross_entropy_loss", "logits_of"]


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself (a tensor), its ``.logits`` (a Hugging Face
    ``ModelOutput``) or its ``["logits"]`` (a dict). Anything else: a TypeError saying what to pass."""
    if isinstance(output, torch.Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    fields = list(output.keys()) if isinstance(output, Mapping) else None
    raise TypeError(
        f"the default loss (cross_entropy) takes logits: a tensor, an output with a .logits tensor (a "
        f"Hugging Face ModelOutput) or a dict with 'logits'; the model returned a {type(output).__name__}"
        f"{f' with keys {fields}' if fields is not None else ''}. Pass a loss that takes this output: "
        "model.loss='package.module:function' in the config (loss_fn= in Python), a function "
        "(output, target) -> a 0-dim tensor"
    )


def cross_entropy_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position whose target is not -100 (works for ``(B, C)`` and
    ``(B, T, C)`` logits; the logits of a Hugging Face output or a dict with ``"logits"``, see
    :func:`logits_of`): ``F.cross_entropy``'s mean, but 0 with zero gradients where every target is -100
    (``F.cross_entropy`` gives NaN). The Trainer weights each call by its share of the step's counted
    targets (``trainers/token_mean.py``), so it trains on the global batch's mean."""
    return whole_cross_entropy(logits_of(output).float(), targets)


@dataclass(frozen=True)
class Task:
    #: builds the model; the trainer calls it inside ``dtlab.core.seeded_init(train.seed)`` (generators
    #: of its own seeded with ``train.seed``, one build at a time in the process), so every rank builds
    #: the same model in every run, however and wherever the task was made
    build_model: Callable[[], nn.Module]
    #: any map-style torch ``Dataset`` of ``(input, target)`` pairs
    train_data: Any
    eval_data: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    #: tokens per sample (for tokens/s); 1 for classification
    tokens_per_sample: int = 1
    #: module classes FSDP wraps as units (``None``: the strategy's default policy)
    fsdp_unit_classes: tuple[type[nn.Module], ...] | None = None
    name: str = "custom"
    #: classification: evaluation also reports accuracy (argmax of the last dimension)
    classification: bool = False

    def __post_init__(self) -> None:
        """Refuses a model where the function building it goes (the Trainer calls it on every rank)."""
        if isinstance(self.build_model, nn.Module) or not callable(self.build_model):
            raise ArgumentTypeError(
                f"Task.build_model is a function building the model, got {type(self.build_model).__name__}"
                "; pass lambda: module (or run_training(config, model=module, train_data=...))"
            )
        if not callable(self.loss_fn):
            raise ArgumentTypeError(
                f"Task.loss_fn must be a function of (output, target), got {self.loss_fn!r}"
            )
        check_switches("Task", classification=self.classification)


def builtin_model(
    config: TrainConfig,
) -> tuple[Callable[[], nn.Module], int, tuple[type[nn.Module], ...] | None]:
    """``model.name``'s builder, its tokens per sample and its FSDP unit classes."""
    m = config.model
    if m.name == "transformer_lm":
        check_builtin_fits(config)  # its sizes and blocks against the run plan, before any rank builds it
        return (
            lambda: TransformerLM(m.d_model, m.n_layers, m.n_heads, m.seq_len, m.dropout),
            m.seq_len,
            (Block,),
        )
    return DigitsCNN, 1, None


def builtin_data(config: TrainConfig) -> tuple[TensorDataset, TensorDataset]:
    """``data.dataset``'s training and held-out parts."""
    d = config.data
    if d.dataset == "stdlib":
        try:
            data = stdlib_lm_dataset(d.max_bytes, config.model.seq_len)
        except ValueError as exc:
            raise ConfigError(
                f"model.seq_len={config.model.seq_len} does not fit data.max_bytes={d.max_bytes}: {exc}; "
                "use a shorter model.seq_len or a larger data.max_bytes"
            ) from None
        return data.split(d.eval_fraction)
    return load_digits_dataset().split(d.eval_fraction)


def builtin_task(config: TrainConfig) -> Task:
    """The embedded task of ``model.name`` and ``data.dataset``."""
    build, tokens, units = builtin_model(config)
    train, evals = builtin_data(config)
    if config.data.dataset == "stdlib":
        return Task(
            build,
            train,
            evals,
            tokens_per_sample=tokens,
            fsdp_unit_classes=units,
            name="stdlib-transformer-lm",
        )
    return Task(build, train, evals, name="digits-cnn", classification=True)
