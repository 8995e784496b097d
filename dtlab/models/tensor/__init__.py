"""Tensor parallelism's parts (Megatron-LM's): plans and styles, the parallel layers, their collectives.

``_plan.py``: the plan (``{"fqn-pattern": style}``), its styles and ``transformer_plan``; ``_auto.py``:
the plan a model declares (``plan="auto"``: its ``tp_plan()``, Hugging Face's, dtlab's GPT-2 recipe,
:func:`gpt2_plan`); ``_layers.py``:
the tensor-parallel layers and the vocabulary-parallel cross-entropy; ``_comm.py``: the autograd
collectives (Megatron's f/g pairs, sequence-parallel all-gather/reduce-scatter). The model that applies
a plan is :class:`~dtlab.models.TensorParallelModel` (:mod:`dtlab.models.compose`).
"""

from dtlab.models.tensor._auto import gpt2_plan
from dtlab.models.tensor._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dtlab.models.tensor._plan import (
    ColwiseParallel,
    HeadsParallel,
    Plan,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallel,
    transformer_plan,
)

__all__ = [
    "ColumnParallelLinear",
    "ColwiseParallel",
    "HeadsParallel",
    "Plan",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "VocabParallel",
    "VocabParallelEmbedding",
    "gpt2_plan",
    "transformer_plan",
    "vocab_parallel_cross_entropy",
]
