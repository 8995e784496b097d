"""``ShardedState``: one rank's piece of a model or optimizer state.

It lives in the neutral layer :mod:`dtlab.core` because strategies produce it, checkpoints store it
and compressed reducers add their state to it (docs/architecture.md, section "ShardedState").
``dtlab.models.base`` re-exports it for compatibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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
