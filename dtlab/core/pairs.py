"""The one table of which model strategy pairs with which optimizer strategy.

The config (``strategy.model`` / ``strategy.optimizer`` and their default), both registries
(:func:`dtlab.models.get_model_strategy`, :func:`dtlab.optimizers.get_optimizer_strategy`), each
optimizer strategy's ``compatible_models`` and the error messages all read it
(docs/architecture.md, section "The pairing table").

A new model strategy is one line in :data:`PAIRINGS` (its class exported from :mod:`dtlab.models`);
a new optimizer strategy is one line in :data:`OPTIMIZER_CLASSES` (its class exported from
:mod:`dtlab.optimizers`) plus its name in the pairings it drives. Names are lower case.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dtlab.errors import ArgumentError

__all__ = [
    "DATA_PARALLEL",
    "MODEL_PARALLEL",
    "OPTIMIZER_CLASSES",
    "PAIRINGS",
    "SCHEDULES",
    "Pairing",
    "default_optimizer",
    "model_class_name",
    "model_names",
    "models_for",
    "optimizer_class_name",
    "optimizer_key",
    "optimizer_names",
    "optimizers_for",
    "pairing",
]


@dataclass(frozen=True)
class Pairing:
    """Model strategy ``model`` (class ``model_class`` in :mod:`dtlab.models`) is driven by the
    optimizer strategies ``optimizers``; the first one is the default."""

    model: str
    model_class: str
    optimizers: tuple[str, ...]

    @property
    def default_optimizer(self) -> str:
        return self.optimizers[0]


#: optimizer strategy name -> its class name in :mod:`dtlab.optimizers`
OPTIMIZER_CLASSES: Mapping[str, str] = MappingProxyType(
    {
        "ddp": "DDPOptimizer",
        "zero1": "ZeRO1Optimizer",
        "zero2": "ZeRO2Optimizer",
        "zero3": "ZeRO3Optimizer",
    }
)


def _table(*rows: Pairing) -> Mapping[str, Pairing]:
    table: dict[str, Pairing] = {}
    for row in rows:
        if row.model in table or row.model != row.model.lower() or not row.optimizers:
            raise ArgumentError(f"pairing table: bad or repeated row {row}")
        unknown = [o for o in row.optimizers if o not in OPTIMIZER_CLASSES]
        if unknown:
            raise ArgumentError(f"pairing table: {row.model!r} names unknown optimizer strategies {unknown}")
        table[row.model] = row
    return MappingProxyType(table)


#: the data-parallel strategies, by the one name config, registry, advise and benchmarks use (the dp
#: axis of a mesh runs any of them)
DATA_PARALLEL: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp")
#: the model-parallel strategies (classes built from a run plan's sizes; never a ``strategy.model``)
MODEL_PARALLEL: tuple[str, ...] = ("tensor", "pipeline", "hybrid")
#: the pipeline schedules, by the one name config, models, advise and benchmarks use
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

#: model strategy name -> its pairing, in the order configs and messages list them
PAIRINGS: Mapping[str, Pairing] = _table(
    Pairing("ddp", "DDPModel", ("ddp",)),
    Pairing("zero1", "ZeRO1Model", ("zero1",)),
    Pairing("zero2", "ZeRO2Model", ("zero2",)),
    Pairing("zero3", "ZeRO3Model", ("zero3",)),
    Pairing("fsdp", "FSDPModel", ("zero3",)),
    Pairing("tensor", "TensorParallelModel", ("ddp", "zero1")),
    Pairing("pipeline", "PipelineParallelModel", ("ddp", "zero1")),
    # which one drives a given model follows its data_parallel choice (HybridShardedModel checks it)
    Pairing("hybrid", "HybridShardedModel", ("ddp", "zero1", "zero2", "zero3")),
)


def model_names() -> tuple[str, ...]:
    """Every model strategy name (``ddp, zero1, zero2, zero3, fsdp``, ...)."""
    return tuple(PAIRINGS)


def optimizer_names() -> tuple[str, ...]:
    """Every optimizer strategy name (``ddp, zero1, zero2, zero3``, ...)."""
    return tuple(OPTIMIZER_CLASSES)


def pairing(model: str) -> Pairing:
    """The row of model strategy ``model`` (case-insensitive); unknown names raise, naming the choices."""
    key = str(model).lower()
    if key not in PAIRINGS:
        raise ArgumentError(f"unknown model strategy {model!r}; choose one of {', '.join(PAIRINGS)}")
    return PAIRINGS[key]


def optimizer_key(optimizer: str) -> str:
    """The table's name for ``optimizer`` (case-insensitive); unknown names raise, naming the choices."""
    key = str(optimizer).lower()
    if key not in OPTIMIZER_CLASSES:
        raise ArgumentError(
            f"unknown optimizer strategy {optimizer!r}; choose one of {', '.join(OPTIMIZER_CLASSES)}"
        )
    return key


def optimizers_for(model: str) -> tuple[str, ...]:
    """The optimizer strategies that can drive model strategy ``model``, the default first."""
    return pairing(model).optimizers


def default_optimizer(model: str) -> str:
    """The optimizer strategy a config picks for ``model`` when none is set (``fsdp`` -> ``zero3``)."""
    return pairing(model).default_optimizer


def models_for(optimizer: str) -> tuple[str, ...]:
    """The model strategies optimizer strategy ``optimizer`` can drive (its ``compatible_models``)."""
    key = optimizer_key(optimizer)
    return tuple(p.model for p in PAIRINGS.values() if key in p.optimizers)


def model_class_name(model: str) -> str:
    """``"fsdp"`` -> ``"FSDPModel"`` (for messages and the registry)."""
    return pairing(model).model_class


def optimizer_class_name(optimizer: str) -> str:
    """``"zero3"`` -> ``"ZeRO3Optimizer"`` (for messages and the registry)."""
    return OPTIMIZER_CLASSES[optimizer_key(optimizer)]
