"""ZeRO3Optimizer: optimizer state sharded over the data-parallel group.

ZeRO-3 and FSDP: the shards are the parameters' resting storage, so nothing is gathered after the
step (the next forward gathers); parameters kept whole (persistent) are all-gathered by the model.
"""

from __future__ import annotations

from typing import ClassVar

from dtlab.core import pairs
from dtlab.optimizers._sharded import ShardedOptimizer

__all__ = ["ZeRO3Optimizer"]


class ZeRO3Optimizer(ShardedOptimizer):
    """``ZeRO3Optimizer(model, torch.optim.AdamW, lr=...)``: this rank steps ``1/P`` of every parameter."""

    strategy_name: ClassVar[str] = "zero3"
    compatible_models: ClassVar[tuple[str, ...]] = pairs.models_for("zero3")
