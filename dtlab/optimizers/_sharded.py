"""What ZeRO-1, ZeRO-2 and ZeRO-3 optimizers share: a torch optimizer over this rank's shards.

The model strategy lays parameters in flat units padded to a multiple of ``P`` (see
:mod:`dtlab.models.flat`); this rank's optimizer steps element ``[r*c, (r+1)*c)`` of each unit with
the matching gradient shard, so its state is ``1/P`` of the replicated optimizer's. Element-wise
optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) give the same result as on whole parameters;
optimizers whose update couples elements of one parameter (LAMB's trust ratio, Adafactor, Shampoo)
would not, and are not supported. One parameter group (same hyperparameters for all parameters).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dtlab.optimizers._common import DataParallelOptimizer, Piece

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(DataParallelOptimizer):
    """Steps this rank's shard of every flat unit, then lets the model publish the new values."""

    strategy_name: ClassVar[str] = "zero"

    def _build(self) -> tuple[list[torch.Tensor], list[list[Piece]], list[list[str]]]:
        model = self.dp_model
        self._units = model.shard_units()
        tensors, pieces, names = [], [], []
        for unit in self._units:
            tensors.append(model.shard_param(unit))
            pieces.append([Piece(s.name, tuple(s.shape), a, b, off) for s, a, b, off in unit.shard_slots()])
            names.append([s.name for s in unit.slots])
        return tensors, pieces, names

    def step(self) -> None:
        model = self.dp_model
        model.check_grads_ready(type(self).__name__)
        for t, unit in zip(self._tensors, self._units, strict=True):
            t.grad = model.shard_grad(unit)
        try:
            self._opt.step()
        finally:
            for t in self._tensors:
                t.grad = None
        self._publish()
        model.after_optimizer_step()

    def _publish(self) -> None:
        """Make the updated shards visible to the forward (ZeRO-1/2: all-gather the parameters)."""
