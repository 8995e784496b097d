"""Look up a model strategy by its short name (configs, the trainer, checkpoints).

The names and class names come from the pairing table (:mod:`dtlab.core.pairs`); a class is looked
up in :mod:`dtlab.models` when first asked for, so a strategy added to the table (and exported from
``dtlab.models``) is found here without another list to edit.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from dtlab.core import pairs
from dtlab.models.base import ModelStrategy

__all__ = ["MODEL_STRATEGIES", "get_model_strategy"]


class _ModelClasses(Mapping[str, type[ModelStrategy]]):
    """Read-only ``{name: class}`` view of the pairing table's model strategies."""

    def __getitem__(self, name: str) -> type[ModelStrategy]:
        if name not in pairs.PAIRINGS:
            raise KeyError(name)
        cls = getattr(importlib.import_module("dtlab.models"), pairs.model_class_name(name))
        if not (isinstance(cls, type) and issubclass(cls, ModelStrategy)):
            raise TypeError(f"dtlab.models.{pairs.model_class_name(name)} is not a ModelStrategy")
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(pairs.model_names())

    def __len__(self) -> int:
        return len(pairs.PAIRINGS)


#: ``{"ddp": DDPModel, ..., "fsdp": FSDPModel}``, in the table's order
MODEL_STRATEGIES: Mapping[str, type[ModelStrategy]] = _ModelClasses()


def get_model_strategy(name: str) -> type[ModelStrategy]:
    """The model strategy class for ``name`` (one of ``ddp, zero1, zero2, zero3, fsdp``, ...)."""
    return MODEL_STRATEGIES[pairs.pairing(name).model]
