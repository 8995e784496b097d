"""The checks of :class:`~dtlab.optimizers.async_sgd.AsyncSGDOptimizer`: its arguments, before any
communication (each names the value and what to pass instead), then that every rank agrees."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, check_backend
from dtlab.errors import ArgumentError, ArgumentTypeError, StrategyError, integer, real
from dtlab.models.base import ModelStrategy
from dtlab.optimizers._elementwise import check_elementwise
from dtlab.optimizers._groups import OptimizerSpec, refuse_closure_driven, refuse_sparse_only

__all__ = ["check_agreement", "check_arguments", "trainable"]


def trainable(module: object, backend: object) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of ``module``, after refusing a ``module`` or ``backend`` of another kind
    before either is read."""
    if isinstance(module, ModelStrategy):
        raise ArgumentTypeError(
            f"AsyncSGDOptimizer takes the plain torch.nn.Module (its servers synchronize it), got a "
            f"{type(module).__name__}; pass the module itself: AsyncSGDOptimizer(module, backend, ...)"
        )
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"AsyncSGDOptimizer trains a torch.nn.Module, got {type(module).__name__}")
    check_backend(backend, "AsyncSGDOptimizer")
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def check_arguments(
    backend: CommunicationBackend,
    optimizer_cls: type[torch.optim.Optimizer],
    staleness: int | None,
    num_servers: int,
    optimizer_kwargs: dict[str, Any],
    max_grad_norm: float | None = None,
    groups: list[dict[str, Any]] | None = None,
) -> None:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            "AsyncSGDOptimizer takes a torch.optim.Optimizer class (e.g. torch.optim.SGD) and its keyword "
            f"arguments, got {optimizer_cls!r}"
        )
    refuse_sparse_only("AsyncSGDOptimizer", optimizer_cls)
    refuse_closure_driven("AsyncSGDOptimizer", optimizer_cls)
    if "params" in optimizer_kwargs:
        raise TypeError("AsyncSGDOptimizer: do not pass params=; each server optimizes its own shard")
    # a server steps its shard's pieces of the parameters, flat: Adafactor, Muon, LAMB... would not
    spec = OptimizerSpec(optimizer_cls, dict(optimizer_kwargs), groups or [dict(optimizer_kwargs)], None, [])
    check_elementwise("AsyncSGDOptimizer", spec, spec.groups, backend.device, flat=True)
    if staleness is not None and (integer(staleness) is None or staleness < 0):
        raise ArgumentError(
            f"AsyncSGDOptimizer: staleness must be an int >= 0 (0: synchronous) or None (fully "
            f"asynchronous), got {staleness!r}"
        )
    if integer(num_servers) is None or num_servers < 1:
        raise ArgumentError(f"AsyncSGDOptimizer: num_servers must be an int >= 1, got {num_servers!r}")
    if num_servers >= backend.world_size:
        raise ArgumentError(
            f"AsyncSGDOptimizer: num_servers={num_servers} leaves no worker in a world of "
            f"{backend.world_size} ranks; use at most {backend.world_size - 1} servers (or more ranks)"
        )
    if max_grad_norm is not None:
        m = real(max_grad_norm)
        if m is None or m <= 0:
            raise ArgumentError(
                f"AsyncSGDOptimizer: max_grad_norm must be a finite number > 0 (or None), got "
                f"{max_grad_norm!r}"
            )
        if staleness != 0:
            raise ArgumentError(
                f"AsyncSGDOptimizer: max_grad_norm={m} clips the workers' mean gradient of a clock by its "
                f"global norm, which exists at staleness=0 only; under staleness={staleness} each push is "
                "an update of its own: clip each worker's gradient before step() instead "
                "(torch.nn.utils.clip_grad_norm_(opt.module.parameters(), max_norm) on the worker), or "
                "use staleness=0"
            )


def check_agreement(backend: CommunicationBackend, module: nn.Module, mine: tuple[Any, ...]) -> None:
    """Collective: every rank built the optimizer with the same ``mine`` (parameter names first) and
    the same buffers."""
    buffers = [(n, tuple(v.shape), str(v.dtype)) for n, v in module.state_dict().items()]
    everyone = backend.all_gather_object((mine, buffers))
    for r, (theirs, their_buffers) in enumerate(everyone):
        if theirs != mine or their_buffers != buffers:
            raise StrategyError(
                f"AsyncSGDOptimizer: rank {r} built it with (parameters, numel, dtype, num_servers, "
                "staleness, max_grad_norm, the group of each parameter, the groups' options) = "
                f"{theirs[1:]} and {len(theirs[0])} parameters, rank "
                f"{backend.rank} with {mine[1:]} and {len(mine[0])}; every rank must pass the same model "
                "and settings"
            )
