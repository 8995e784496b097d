"""The one model-parallel composition: pipeline stages, tensor parallelism inside each, a data-parallel
strategy over them (what each file holds: docs/architecture.md, section "Model strategies")."""

from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.compose.pipeline_parallel import PipelineParallelModel
from dtlab.models.compose.tensor_parallel import TensorParallelModel

__all__ = ["HybridShardedModel", "PipelineParallelModel", "TensorParallelModel"]
