"""DDPOptimizer: every rank steps the whole (replicated) model with the averaged gradients."""

from __future__ import annotations

from typing import ClassVar

import torch

from dtlab.core import pairs
from dtlab.models.state import even_range
from dtlab.optimizers._common import DataParallelOptimizer, Piece

__all__ = ["DDPOptimizer"]


class DDPOptimizer(DataParallelOptimizer):
    """``DDPOptimizer(ddp_model, torch.optim.AdamW, lr=...)``: a plain torch optimizer on every rank.

    The state is replicated; ``sharded_state_dict()`` still writes only ``1/P`` of each state tensor
    per rank (so a checkpoint holds one copy), in the format every strategy reads.
    """

    strategy_name: ClassVar[str] = "ddp"
    compatible_models: ClassVar[tuple[str, ...]] = pairs.models_for("ddp")

    def _build(self) -> tuple[list[torch.Tensor], list[list[Piece]], list[list[str]]]:
        backend = self.dp_model.dp_backend
        tensors: list[torch.Tensor] = []
        pieces: list[list[Piece]] = []
        names: list[list[str]] = []
        for name, p in self.dp_model.trainable_parameters():
            s, e = even_range(p.numel(), backend.world_size, backend.rank)
            tensors.append(p)
            pieces.append([Piece(name, tuple(p.shape), s, e, s)] if e > s else [])
            names.append([name])
        return tensors, pieces, names

    def _needed_pieces(self) -> list[list[Piece]]:
        return [
            [Piece(n[0], tuple(t.shape), 0, t.numel(), 0)]
            for t, n in zip(self._tensors, self._names, strict=True)
        ]

    def step(self) -> None:
        model = self.dp_model
        model.check_grads_ready(type(self).__name__)
        self._opt.step()
        model.after_optimizer_step()
