"""ZeRO1Optimizer: optimizer state sharded over the data-parallel group.

ZeRO-1: the model keeps whole parameters, so the updated shards are all-gathered after the step.
"""

from __future__ import annotations

from typing import ClassVar

from dtlab.core import pairs
from dtlab.optimizers._sharded import ShardedOptimizer

__all__ = ["ZeRO1Optimizer"]


class ZeRO1Optimizer(ShardedOptimizer):
    """``ZeRO1Optimizer(model, torch.optim.AdamW, lr=...)``: this rank steps ``1/P`` of every parameter."""

    strategy_name: ClassVar[str] = "zero1"
    compatible_models: ClassVar[tuple[str, ...]] = pairs.models_for("zero1")

    def _publish(self) -> None:
        self.dp_model.gather_updated_shards()
