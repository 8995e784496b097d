"""Model strategies: DDP, ZeRO-1/2/3, FSDP (and later pipeline, tensor, hybrid)."""

from dtlab.core.reducer import DenseReducer, GradientReducer
from dtlab.core.state import ShardedState
from dtlab.models._common import DataParallelModel
from dtlab.models.base import ModelStrategy
from dtlab.models.ddp import DDPModel
from dtlab.models.fsdp import FSDPModel, ModuleClassPolicy, SizePolicy, WrapPolicy
from dtlab.models.registry import MODEL_STRATEGIES, get_model_strategy
from dtlab.models.state import ShardIndex
from dtlab.models.zero1 import ZeRO1Model
from dtlab.models.zero2 import ZeRO2Model
from dtlab.models.zero3 import ZeRO3Model

__all__ = [
    "DDPModel",
    "DataParallelModel",
    "DenseReducer",
    "FSDPModel",
    "GradientReducer",
    "MODEL_STRATEGIES",
    "ModelStrategy",
    "ModuleClassPolicy",
    "ShardIndex",
    "ShardedState",
    "SizePolicy",
    "WrapPolicy",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
    "get_model_strategy",
]
