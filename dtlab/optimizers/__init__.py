"""Optimizer strategies: DDP, ZeRO-1/2/3 (and gradient compression, async SGD, elastic)."""

from dtlab.optimizers.base import OptimizerStrategy

__all__ = ["OptimizerStrategy"]
