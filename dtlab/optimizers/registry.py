"""Look up an optimizer strategy by name, and the one that fits a model strategy.

Names, class names and defaults come from the pairing table (:mod:`dtlab.core.pairs`); a class is
looked up in :mod:`dtlab.optimizers` when first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from dtlab.core import pairs
from dtlab.optimizers._common import DataParallelOptimizer

__all__ = ["OPTIMIZER_STRATEGIES", "default_optimizer_strategy", "get_optimizer_strategy"]


class _OptimizerClasses(Mapping[str, type[DataParallelOptimizer]]):
    """Read-only ``{name: class}`` view of the pairing table's optimizer strategies."""

    def __getitem__(self, name: str) -> type[DataParallelOptimizer]:
        if name not in pairs.OPTIMIZER_CLASSES:
            raise KeyError(name)
        cls = getattr(importlib.import_module("dtlab.optimizers"), pairs.optimizer_class_name(name))
        if not (isinstance(cls, type) and issubclass(cls, DataParallelOptimizer)):
            raise TypeError(
                f"dtlab.optimizers.{pairs.optimizer_class_name(name)} is not a DataParallelOptimizer"
            )
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(pairs.optimizer_names())

    def __len__(self) -> int:
        return len(pairs.OPTIMIZER_CLASSES)


#: ``{"ddp": DDPOptimizer, ..., "zero3": ZeRO3Optimizer}``, in the table's order
OPTIMIZER_STRATEGIES: Mapping[str, type[DataParallelOptimizer]] = _OptimizerClasses()


def get_optimizer_strategy(name: str) -> type[DataParallelOptimizer]:
    """The optimizer strategy class for ``name`` (one of ``ddp, zero1, zero2, zero3``, ...)."""
    return OPTIMIZER_STRATEGIES[pairs.optimizer_key(name)]


def default_optimizer_strategy(model_name: str) -> type[DataParallelOptimizer]:
    """The optimizer strategy that fits model strategy ``model_name`` (``fsdp`` -> ZeRO3Optimizer)."""
    return OPTIMIZER_STRATEGIES[pairs.default_optimizer(model_name)]
