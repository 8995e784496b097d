"""The neutral layer: interfaces that both model strategies and compression build on.

It imports only ``torch``, :mod:`dtlab.backends`, :mod:`dtlab.errors` and :mod:`dtlab.untrusted`, so
everything above (compression, models, optimizers, checkpoints, the config) can import it downwards
(docs/architecture.md, section "Layers").

- :mod:`dtlab.core.reducer`: :class:`GradientReducer` (the seam gradients travel through) and
  :class:`DenseReducer` (the uncompressed one);
- :mod:`dtlab.core.state`: :class:`ShardedState`, one rank's piece of a model or optimizer state;
- :mod:`dtlab.core.shard_index`: how a ``ShardedState`` maps onto whole tensors, the one checkpoint
  format of model strategies, optimizer strategies and :mod:`dtlab.checkpoint` (:class:`ShardIndex`);
- :mod:`dtlab.core.placement`: :class:`Replicate` / :class:`Shard` and :func:`placement_of`, where
  each parameter lives on a mesh (read by clipping, finite checks, memory reports, checkpoints);
- :mod:`dtlab.core.pairs`: which model strategy pairs with which optimizer strategy (no torch, so
  the config can read it without importing torch);
- :mod:`dtlab.core.backward`: :class:`~dtlab.core.backward.BackwardPass`, whether a backward pass that
  reached a strategy's gradient hooks finished or raised partway (its gradients then partial);
- :mod:`dtlab.core.rng`: :func:`seeded_init`, reproducible model initialisation from generators of its
  own, whatever other in-memory ranks (threads) draw from torch's global RNG meanwhile.
- :mod:`dtlab.core.random_ops`: the dispatch mode giving random ops generators of their own (shared by
  ``seeded_init`` and :mod:`dtlab.core.replayed_draws`, an activation checkpoint's recomputation
  drawing its forward's numbers on in-memory ranks).
- :mod:`dtlab.core.torch_private`: the one place torch's private attributes of modules and tensors
  are read (its hook dicts, a module's non-persistent buffers).
- :mod:`dtlab.core.saved_params`: :class:`SavedParameter`, a parameter a user's custom autograd
  Function saved, handed back through saved-tensor hooks with ``.grad`` the parameter's.

The names below are imported on first use, so ``import dtlab.core.pairs`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtlab.core.placement import Replicate, Shard, placement_of
    from dtlab.core.reducer import DenseReducer, GradientReducer
    from dtlab.core.rng import seeded_init
    from dtlab.core.state import ShardedState

__all__ = [
    "DenseReducer",
    "GradientReducer",
    "Replicate",
    "Shard",
    "ShardedState",
    "placement_of",
    "seeded_init",
]

_HOME = {
    "DenseReducer": "reducer",
    "GradientReducer": "reducer",
    "ShardedState": "state",
    "Replicate": "placement",
    "Shard": "placement",
    "placement_of": "placement",
    "seeded_init": "rng",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"dtlab.core.{_HOME[name]}"), name)
    raise AttributeError(f"module 'dtlab.core' has no attribute {name!r}")
