"""Look up a data-parallel model strategy by its short name (configs, the trainer, checkpoints)."""

from __future__ import annotations

from dtlab.models._common import DataParallelModel
from dtlab.models.ddp import DDPModel
from dtlab.models.fsdp import FSDPModel
from dtlab.models.zero1 import ZeRO1Model
from dtlab.models.zero2 import ZeRO2Model
from dtlab.models.zero3 import ZeRO3Model

__all__ = ["MODEL_STRATEGIES", "get_model_strategy"]

MODEL_STRATEGIES: dict[str, type[DataParallelModel]] = {
    "ddp": DDPModel,
    "zero1": ZeRO1Model,
    "zero2": ZeRO2Model,
    "zero3": ZeRO3Model,
    "fsdp": FSDPModel,
}


def get_model_strategy(name: str) -> type[DataParallelModel]:
    """The model strategy class for ``name`` (one of ``ddp, zero1, zero2, zero3, fsdp``)."""
    key = str(name).lower()
    if key not in MODEL_STRATEGIES:
        raise ValueError(f"unknown model strategy {name!r}; choose one of {', '.join(MODEL_STRATEGIES)}")
    return MODEL_STRATEGIES[key]
