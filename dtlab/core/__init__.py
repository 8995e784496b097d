"""The neutral layer: interfaces that both model strategies and compression build on.

It imports only ``torch``, :mod:`dtlab.backends` and :mod:`dtlab.errors`, so everything above
(compression, models, optimizers, checkpoints) can import it downwards (docs/architecture.md).

- :mod:`dtlab.core.reducer`: :class:`GradientReducer` (the seam gradients travel through) and
  :class:`DenseReducer` (the uncompressed one);
- :mod:`dtlab.core.state`: :class:`ShardedState`, one rank's piece of a model or optimizer state.
"""

from dtlab.core.reducer import DenseReducer, GradientReducer
from dtlab.core.state import ShardedState

__all__ = ["DenseReducer", "GradientReducer", "ShardedState"]
