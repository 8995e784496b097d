"""ZeRO2Optimizer: optimizer state sharded over the data-parallel group.

ZeRO-2: the model keeps whole parameters, so the updated shards are all-gathered after the step.
"""

from __future__ import annotations

from typing import ClassVar

from dtlab.core import pairs
from dtlab.optimizers._sharded import ShardedOptimizer

__all__ = ["ZeRO2Optimizer"]


class ZeRO2Optimizer(ShardedOptimizer):
    """``ZeRO2Optimizer(model, torch.optim.AdamW, lr=...)``: this rank steps ``1/P`` of every parameter."""

    strategy_name: ClassVar[str] = "zero2"
    compatible_models: ClassVar[tuple[str, ...]] = pairs.models_for("zero2")

    def _publish(self) -> None:
        self.dp_model.gather_updated_shards()
