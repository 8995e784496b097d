"""Compatibility alias: the gradient reducer moved to :mod:`dtlab.core.reducer` (the neutral layer)."""

from dtlab.core.reducer import DenseReducer, GradientReducer

__all__ = ["DenseReducer", "GradientReducer"]
