"""Tensor parallelism's parts: plans and their styles, the parallel layers, their collectives (what each
file holds: docs/architecture.md, section "Model strategies"); :class:`~dtlab.models.TensorParallelModel`
applies a plan."""

from dtlab.models.tensor._auto import bart_plan, bert_plan, gpt2_plan, hugging_face_plan
from dtlab.models.tensor._layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
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
from dtlab.models.tensor._split_logits import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    whole_cross_entropy,
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
    "bart_plan",
    "bert_plan",
    "gpt2_plan",
    "hugging_face_plan",
    "transformer_plan",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "whole_cross_entropy",
]
