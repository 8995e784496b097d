"""What ZeRO-1, ZeRO-2 and ZeRO-3 optimizers share: a torch optimizer over this rank's shards.

The model strategy lays parameters in flat units padded to a multiple of ``P`` (see
:mod:`dtlab.models.dp.flat`); this rank's optimizer steps element ``[r*c, (r+1)*c)`` of each unit with
the matching gradient shard, so its state is ``1/P`` of the replicated optimizer's. Element-wise
optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) give the same result as on whole parameters;
optimizers whose update couples elements of one parameter (LAMB's trust ratio, Adafactor, Muon,
Shampoo) would not, and are refused when the optimizer strategy is built
(:mod:`dtlab.optimizers._elementwise`). Each param group of the user's optimizer is one group of the
local optimizer, over this rank's slices of that group's parameters (views into the shard), so every group
keeps its own options.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from dtlab.optimizers._common import DataParallelOptimizer
from dtlab.optimizers._groups import Entry
from dtlab.optimizers._hooks import local_step

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(DataParallelOptimizer):
    """Steps this rank's shard of every flat unit, then lets the model publish the new values."""

    strategy_name: ClassVar[str] = "zero"

    _sharded_state: ClassVar[bool] = True

    def _pieces_kind(self) -> str | None:
        return "flat"

    def _build(self) -> list[Entry]:
        model = self.dp_model
        indexed = self._indexed()
        out = []
        for unit in model.shard_units():
            shard = model.shard_param(unit)
            for p, slot, a, b, off in unit.shard_params():
                if id(p) in indexed:
                    i, gi, name = indexed[id(p)]
                    view = shard[off : off + b - a]
                    if not slot.shape:  # a 0-dim parameter (a logit scale): stepped, and its state
                        view = view.view(())  # shaped, as torch's (a torch state dict loads into it)
                    out.append(Entry(i, name, p, slot.numel, tuple(slot.shape), view, a, b, gi))
        return out

    def _grads(self) -> list[torch.Tensor]:
        """Each entry's slice of this rank's synchronized gradient shard."""
        model = self.dp_model
        grads: dict[int, torch.Tensor] = {}
        out = []
        for unit in model.shard_units():
            g = model.shard_grad(unit)
            for p, _, a, b, off in unit.shard_params():
                grads[id(p)] = g[off : off + b - a]
        for e in self._entries:
            g = grads[id(e.param)]
            out.append(g if e.tensor.dim() else g.view(()))  # a 0-dim parameter's as its shape
        return out

    def _step_local(self, skip: frozenset[int]) -> None:
        for e, g in zip(self._entries, self._grads(), strict=True):
            e.tensor.grad = None if id(e.param) in skip else g  # torch's optimizer skips None
        try:
            local_step(self._opt)
        finally:
            for e in self._entries:
                e.tensor.grad = None
        self._publish()

    def _publish(self) -> None:
        """Make the updated shards visible to the forward (ZeRO-1/2: all-gather the parameters)."""
