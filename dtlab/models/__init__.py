"""Model strategies: DDP, ZeRO-1/2/3, FSDP (and later pipeline, tensor, hybrid)."""

from dtlab.models.base import ModelStrategy, ShardedState
from dtlab.models.reducer import DenseReducer, GradientReducer

__all__ = ["DenseReducer", "GradientReducer", "ModelStrategy", "ShardedState"]
