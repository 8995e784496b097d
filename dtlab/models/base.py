"""What every model strategy offers (docs/architecture.md, section "Model strategies").

A model strategy wraps an ``nn.Module``, is itself an ``nn.Module`` (forward works), owns where its
parameters and gradients live, and sends gradients through its :class:`GradientReducer`.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.reducer import GradientReducer
from dtlab.core.state import ShardedState

__all__ = ["ModelStrategy", "ShardedState"]


class ModelStrategy(nn.Module):
    """Base of DDP, ZeRO-1/2/3, FSDP, pipeline, tensor and hybrid model strategies."""

    #: short name used in configs, checkpoints and errors ("ddp", "zero1", ...)
    strategy_name: ClassVar[str] = "base"

    def __init__(self, module: nn.Module, backend: CommunicationBackend) -> None:
        super().__init__()
        self.module = module
        self.backend = backend

    @property
    @abstractmethod
    def gradient_reducer(self) -> GradientReducer:
        """The reducer all gradients go through; assign a new one to change how they travel."""

    @gradient_reducer.setter
    @abstractmethod
    def gradient_reducer(self, reducer: GradientReducer) -> None: ...

    @property
    def dp_backend(self) -> CommunicationBackend:
        """The data-parallel group gradients are averaged over (the whole backend for pure DP)."""
        return self.backend

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside synchronizes."""
        raise NotImplementedError(f"{type(self).__name__} does not support no_sync()")
        yield

    def train_step(self, batch: tuple[Any, Any], loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch ``(inputs, targets)``; returns the detached loss."""
        inputs, targets = batch
        loss = loss_fn(self(inputs), targets)
        loss.backward()
        return loss.detach()

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers keyed like ``module.state_dict()`` (collective: all ranks call)."""

    @abstractmethod
    def sharded_state_dict(self) -> ShardedState:
        """This rank's shard of parameters and buffers with strategy metadata."""

    @abstractmethod
    def load_sharded_state_dict(self, shards: Sequence[ShardedState]) -> None:
        """Load from the shards of every saved rank (any world size, any data-parallel strategy)."""

    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer_state`` (filled by the
        optimizer strategy, 0 here), ``buffers`` and ``peak_gathered_parameters`` of the last step."""
