"""Param groups of :class:`~dtlab.optimizers.async_sgd.AsyncSGDOptimizer`: the group of each trainable
parameter and each group's options, from torch-style ``param_groups`` (``[{"params": [...], "lr": ...},
...]``, over the module's own parameters). Every trainable parameter must be in exactly one group: a
server steps every piece of its shard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dtlab.errors import ArgumentError, StrategyError

__all__ = ["assign_groups"]

_WHO = "AsyncSGDOptimizer"


def assign_groups(
    named: list[tuple[str, nn.Parameter]], param_groups: Sequence[Mapping[str, Any]] | None
) -> tuple[list[int], list[dict[str, Any]]]:
    """``(group index per parameter of named, options per group)``; one group of no options when
    ``param_groups`` is None."""
    if param_groups is None:
        return [0] * len(named), [{}]
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence) or not param_groups:
        raise ArgumentError(
            f"{_WHO}: param_groups must be a non-empty list of dicts such as [{{'params': [...], "
            f"'weight_decay': 0.0}}, ...], got {type(param_groups).__name__}"
        )
    index = {id(p): i for i, (_, p) in enumerate(named)}
    group_of = [-1] * len(named)
    options = []
    for g, group in enumerate(param_groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ArgumentError(f"{_WHO}: param_groups[{g}] must be a dict with 'params', got {group!r}")
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else list(params):
            i = index.get(id(p))
            if i is None:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise StrategyError(
                    f"{_WHO}: param_groups[{g}] holds a tensor ({shape}) that is not a trainable parameter "
                    "of the module (a frozen one, or another module's); build the groups from the module's "
                    "own trainable parameters (module.named_parameters())"
                )
            if group_of[i] != -1:
                raise StrategyError(
                    f"{_WHO}: parameter {named[i][0]!r} is in param groups {group_of[i]} and {g}; put each "
                    "parameter in one group"
                )
            group_of[i] = g
        options.append({k: v for k, v in group.items() if k != "params"})
    missing = [named[i][0] for i, g in enumerate(group_of) if g < 0]
    if missing:
        raise StrategyError(
            f"{_WHO}: trainable parameter(s) {missing[:5]} are in no param group, but a server steps every "
            "trainable parameter; add them to a group, or freeze them (requires_grad_(False)) before "
            "building the optimizer"
        )
    return group_of, options
