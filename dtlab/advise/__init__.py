"""``dtlab advise``: which mesh and strategy to train a transformer with on a cluster.

A cost model of dtlab's own strategies: for every plan (data-parallel strategy, dp, tp, pp,
pipeline schedule, micro-batches, activation checkpointing) it predicts the memory per rank
(parameters, gradients, optimizer state, activations), the bytes each rank sends per mesh axis and
the step time, and ranks the plans that fit by step time. The formulas are documented in
docs/strategies.md, section "Choosing a mesh: the cost model"; the tests hold the predictions to
dtlab's own runs (memory reports and backend byte counters).

This package sits beside the trainers: it reads the pairing table and nothing below imports it.
"""

from dtlab.advise.precision import PRECISIONS, Precision
from dtlab.advise.predict import AxisCost, Memory, Prediction, predict
from dtlab.advise.search import Advice, Limits, advise, candidates, runnable
from dtlab.advise.spec import (
    CHECKPOINTING,
    DP_STRATEGIES,
    SCHEDULES,
    Candidate,
    ClusterSpec,
    ModelSpec,
    OptimizerSpec,
    StrategyOptions,
)

__all__ = [
    "CHECKPOINTING",
    "DP_STRATEGIES",
    "PRECISIONS",
    "SCHEDULES",
    "Advice",
    "AxisCost",
    "Candidate",
    "ClusterSpec",
    "Limits",
    "Memory",
    "ModelSpec",
    "OptimizerSpec",
    "Precision",
    "Prediction",
    "StrategyOptions",
    "advise",
    "candidates",
    "predict",
    "runnable",
]
