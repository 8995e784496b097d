"""The argument checks of :class:`~dtlab.optimizers.async_sgd.AsyncSGDOptimizer`, before any
communication: each names the value and what to pass instead."""

from __future__ import annotations

from typing import Any

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import ArgumentError
from dtlab.optimizers._groups import refuse_sparse_only

__all__ = ["check_arguments"]


def check_arguments(
    backend: CommunicationBackend,
    optimizer_cls: type[torch.optim.Optimizer],
    staleness: int | None,
    num_servers: int,
    optimizer_kwargs: dict[str, Any],
) -> None:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            "AsyncSGDOptimizer takes a torch.optim.Optimizer class (e.g. torch.optim.SGD) and its keyword "
            f"arguments, got {optimizer_cls!r}"
        )
    refuse_sparse_only("AsyncSGDOptimizer", optimizer_cls)
    if "params" in optimizer_kwargs:
        raise TypeError("AsyncSGDOptimizer: do not pass params=; each server optimizes its own shard")
    bad = isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0
    if staleness is not None and bad:
        raise ArgumentError(
            f"AsyncSGDOptimizer: staleness must be an int >= 0 (0: synchronous) or None (fully "
            f"asynchronous), got {staleness!r}"
        )
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ArgumentError(f"AsyncSGDOptimizer: num_servers must be an int >= 1, got {num_servers!r}")
    if num_servers >= backend.world_size:
        raise ArgumentError(
            f"AsyncSGDOptimizer: num_servers={num_servers} leaves no worker in a world of "
            f"{backend.world_size} ranks; use at most {backend.world_size - 1} servers (or more ranks)"
        )
