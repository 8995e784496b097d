"""``ShardedState``: one rank's piece of a model or optimizer state.

It lives in the neutral layer :mod:`dtlab.core` because strategies produce it, checkpoints store it
and compressed reducers add their state to it (docs/architecture.md, section "ShardedState").
``dtlab.models.base`` re-exports it for compatibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtlab.errors import ArgumentTypeError
from dtlab.untrusted import summary

__all__ = ["ShardedState"]


@dataclass
class ShardedState:
    """One rank's piece of a model or optimizer state: tensors plus JSON-serialisable metadata.

    ``metadata`` holds at least ``strategy``, ``world_size`` and ``rank``, and whatever the strategy
    needs to reshard (shapes, shard offsets). A checkpoint stores one per rank; loading receives the
    pieces of *every* saved rank, so it works at another world size (and, through full tensors, under
    another data-parallel strategy).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tensors: object = self.tensors
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            got = {k: type(v).__name__ for k, v in tensors.items()} if isinstance(tensors, dict) else tensors
            raise ArgumentTypeError(
                f"ShardedState: tensors must be a dict of name -> torch.Tensor (e.g. model.state_dict()'s "
                f"tensors), got {summary(got)}"
            )
        metadata: object = self.metadata
        if not isinstance(metadata, dict):
            raise ArgumentTypeError(
                f"ShardedState: metadata must be a dict of JSON values (e.g. {{}}), got {summary(metadata)}"
            )
