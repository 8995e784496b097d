"""Look up an optimizer strategy by name, and the one that fits a model strategy."""

from __future__ import annotations

from dtlab.optimizers._common import DataParallelOptimizer
from dtlab.optimizers.ddp import DDPOptimizer
from dtlab.optimizers.zero1 import ZeRO1Optimizer
from dtlab.optimizers.zero2 import ZeRO2Optimizer
from dtlab.optimizers.zero3 import ZeRO3Optimizer

__all__ = ["OPTIMIZER_STRATEGIES", "default_optimizer_strategy", "get_optimizer_strategy"]

OPTIMIZER_STRATEGIES: dict[str, type[DataParallelOptimizer]] = {
    "ddp": DDPOptimizer,
    "zero1": ZeRO1Optimizer,
    "zero2": ZeRO2Optimizer,
    "zero3": ZeRO3Optimizer,
}
_DEFAULTS = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp": "zero3"}


def get_optimizer_strategy(name: str) -> type[DataParallelOptimizer]:
    """The optimizer strategy class for ``name`` (one of ``ddp, zero1, zero2, zero3``)."""
    key = str(name).lower()
    if key not in OPTIMIZER_STRATEGIES:
        raise ValueError(
            f"unknown optimizer strategy {name!r}; choose one of {', '.join(OPTIMIZER_STRATEGIES)}"
        )
    return OPTIMIZER_STRATEGIES[key]


def default_optimizer_strategy(model_name: str) -> type[DataParallelOptimizer]:
    """The optimizer strategy that fits model strategy ``model_name`` (``fsdp`` -> ZeRO3Optimizer)."""
    key = str(model_name).lower()
    if key not in _DEFAULTS:
        raise ValueError(f"unknown model strategy {model_name!r}; choose one of {', '.join(_DEFAULTS)}")
    return OPTIMIZER_STRATEGIES[_DEFAULTS[key]]
