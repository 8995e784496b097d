"""DDPOptimizer: every rank steps the whole (replicated) model with the averaged gradients."""

from __future__ import annotations

from typing import ClassVar

from dtlab.core import pairs
from dtlab.core.shard_index import even_range
from dtlab.models.dp._grad_guard import GradientStandIn
from dtlab.optimizers._common import DataParallelOptimizer, Piece
from dtlab.optimizers._groups import Entry
from dtlab.optimizers._hooks import local_step

__all__ = ["DDPOptimizer"]


class DDPOptimizer(DataParallelOptimizer):
    """``DDPOptimizer(ddp_model, torch.optim.AdamW, lr=...)`` or ``DDPOptimizer(ddp_model,
    torch.optim.AdamW(groups, lr=...))``: the torch optimizer on every rank, over the parameters.

    The state is replicated; ``sharded_state_dict()`` still writes only ``1/P`` of each state tensor
    per rank (so a checkpoint holds one copy), in the format every strategy reads.
    """

    strategy_name: ClassVar[str] = "ddp"
    compatible_models: ClassVar[tuple[str, ...]] = pairs.models_for("ddp")

    def _build(self) -> list[Entry]:
        indexed = self._indexed()
        out = []
        for _, p in self.dp_model.trainable_parameters():
            if id(p) in indexed:
                i, gi, name = indexed[id(p)]
                out.append(Entry(i, name, p, p.numel(), tuple(p.shape), p, 0, p.numel(), gi))
        return sorted(out, key=lambda e: e.index)

    @property
    def _pieces(self) -> list[list[Piece]]:
        """A checkpoint holds one copy: this rank writes ``1/P`` of each (replicated) state tensor."""
        backend = self.dp_model.dp_backend
        out = []
        for e in self._entries:
            s, end = even_range(e.numel, backend.world_size, backend.rank)
            out.append([Piece(e.name, e.shape, s, end, s)] if end > s else [])
        return out

    def _needed_pieces(self) -> list[list[Piece]]:
        return [[Piece(e.name, e.shape, 0, e.numel, 0)] for e in self._entries]

    def _step_local(self, skip: frozenset[int]) -> None:
        held = [(e.param, e.param.grad) for e in self._entries if id(e.param) in skip]
        for p, _ in held:  # torch's optimizer skips a .grad of None
            p.grad = None
        # a pipeline rank's (a tp piece's) .grad refuses norms, meant for clip_grad_norm_ over
        # model.parameters(); the optimizer's own norms of one parameter (Adafactor's row norms on a
        # stage's whole parameter) are right: it steps the gradients themselves
        guarded = [
            (e.param, g)
            for e in self._entries
            if isinstance(g := e.param.grad, GradientStandIn) and g.piece is not None
        ]
        for p, g in guarded:
            p.grad = g.piece
        try:
            local_step(self._opt)
        finally:
            for p, g in held:
                p.grad = g
            for p, g in guarded:
                if p.grad is g.piece:
                    p.grad = g
