"""Model strategies: DDP, ZeRO-1/2/3, FSDP, tensor, pipeline and hybrid (3-D) parallelism."""

from collections.abc import Mapping
from types import MappingProxyType

from dtlab.core import pairs
from dtlab.core.plan import TpBatchCheck
from dtlab.core.reducer import DenseReducer, GradientReducer
from dtlab.core.shard_index import ShardIndex
from dtlab.core.state import ShardedState
from dtlab.models.base import ModelStrategy
from dtlab.models.compose._plan import apply_tensor_plan
from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.compose.single_axis import PipelineParallelModel, TensorParallelModel
from dtlab.models.dp._materialize import init_empty_weights
from dtlab.models.dp.data_parallel import DataParallelModel
from dtlab.models.dp.ddp import DDPModel
from dtlab.models.dp.fsdp import FSDPModel, ModuleClassPolicy, SizePolicy, WrapPolicy
from dtlab.models.dp.zero1 import ZeRO1Model
from dtlab.models.dp.zero2 import ZeRO2Model
from dtlab.models.dp.zero3 import ZeRO3Model
from dtlab.models.pipeline import plot_schedule
from dtlab.models.tensor import (
    ColumnParallelLinear,
    ColwiseParallel,
    HeadsParallel,
    RowParallelLinear,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
    VocabParallelEmbedding,
    bart_plan,
    bert_plan,
    gpt2_plan,
    transformer_plan,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "ColwiseParallel",
    "DDPModel",
    "DataParallelModel",
    "DenseReducer",
    "FSDPModel",
    "GradientReducer",
    "HeadsParallel",
    "HybridShardedModel",
    "MODEL_STRATEGIES",
    "ModelStrategy",
    "ModuleClassPolicy",
    "PipelineParallelModel",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "ShardIndex",
    "ShardedState",
    "SizePolicy",
    "TensorParallelModel",
    "TpBatchCheck",
    "VocabParallel",
    "VocabParallelEmbedding",
    "WrapPolicy",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
    "apply_tensor_plan",
    "bart_plan",
    "bert_plan",
    "get_model_strategy",
    "init_empty_weights",
    "gpt2_plan",
    "plot_schedule",
    "transformer_plan",
    "vocab_parallel_cross_entropy",
]

#: ``{"ddp": DDPModel, ..., "hybrid": HybridShardedModel}``: the pairing table's class names, in its order
MODEL_STRATEGIES: Mapping[str, type[ModelStrategy]] = MappingProxyType(
    {name: globals()[pairs.model_class_name(name)] for name in pairs.model_names()}
)


def get_model_strategy(name: str) -> type[ModelStrategy]:
    """The model strategy class for ``name`` (case-insensitive; unknown names raise, naming the choices)."""
    return MODEL_STRATEGIES[pairs.pairing(name).model]
