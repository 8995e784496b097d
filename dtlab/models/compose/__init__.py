"""The one model-parallel composition: stages, tensor parallelism inside each, data parallelism over them.

``hybrid.py``: ``HybridShardedModel``; ``tensor_parallel.py`` and ``pipeline_parallel.py``:
``TensorParallelModel`` and ``PipelineParallelModel``, the composition with the other axes of size 1;
``_build.py``: the mesh rule and the layout before data parallelism; ``_tree.py``: this rank's stages
under the whole model's names; ``_placed_state.py``: placed checkpoint state and the whole-state
gather; ``_comm.py``: tp sums, pp broadcasts, where a strategy's synchronized gradients lie;
``_tied.py``: weights tied across stages.
"""

from dtlab.models.compose.hybrid import HybridShardedModel
from dtlab.models.compose.pipeline_parallel import PipelineParallelModel
from dtlab.models.compose.tensor_parallel import TensorParallelModel

__all__ = ["HybridShardedModel", "PipelineParallelModel", "TensorParallelModel"]
