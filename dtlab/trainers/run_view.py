"""The typed views the Trainer's helpers take of a run: each helper names the members it reads (a
Protocol beside it, built from these), never the Trainer class, and a Trainer satisfies every one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig
from dtlab.models.base import ModelStrategy
from dtlab.models.precision import MixedPrecisionPolicy
from dtlab.trainers.feed import DataFeed
from dtlab.trainers.metrics import MetricsCollector

__all__ = ["ForwardRun", "Progress", "RunCore"]


class RunCore(Protocol):
    """The run's config, its world (``backend``) and data-parallel group (``dp``), its model strategy."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def backend(self) -> CommunicationBackend: ...
    @property
    def dp(self) -> CommunicationBackend: ...
    @property
    def model(self) -> ModelStrategy: ...


class ForwardRun(RunCore, Protocol):
    """A :class:`RunCore` and what a forward pass over the run's batches needs."""

    @property
    def feed(self) -> DataFeed: ...
    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]: ...
    @property
    def precision(self) -> MixedPrecisionPolicy: ...


class Progress(Protocol):
    """How far the run is (``step``: the last step done), whether this is rank 0, its metrics."""

    @property
    def step(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def metrics(self) -> MetricsCollector: ...
