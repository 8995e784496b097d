"""Optimizer strategies: DDP, ZeRO-1/2/3 (and gradient compression, async SGD, elastic)."""

from dtlab.optimizers._common import DataParallelOptimizer
from dtlab.optimizers.async_sgd import AsyncSGDOptimizer
from dtlab.optimizers.base import OptimizerStrategy
from dtlab.optimizers.compression import GradientCompressionOptimizer as GradientCompressionOptimizer
from dtlab.optimizers.ddp import DDPOptimizer
from dtlab.optimizers.elastic import ElasticOptimizer
from dtlab.optimizers.grad_scaler import GradScaler
from dtlab.optimizers.registry import (
    OPTIMIZER_STRATEGIES,
    default_optimizer_strategy,
    get_optimizer_strategy,
)
from dtlab.optimizers.zero1 import ZeRO1Optimizer
from dtlab.optimizers.zero2 import ZeRO2Optimizer
from dtlab.optimizers.zero3 import ZeRO3Optimizer

__all__ = [
    "AsyncSGDOptimizer",
    "DDPOptimizer",
    "DataParallelOptimizer",
    "ElasticOptimizer",
    "GradScaler",
    "OPTIMIZER_STRATEGIES",
    "OptimizerStrategy",
    "ZeRO1Optimizer",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
    "default_optimizer_strategy",
    "get_optimizer_strategy",
]
