"""ZeRO-1: parameters and gradients replicated (as DDP), optimizer state sharded.

The model side is DDP's: bucketed, overlapped all-reduce of the gradients (all-reduce semantics, so
every rank holds the averaged gradient). :class:`~dtlab.optimizers.ZeRO1Optimizer` then steps only
this rank's ``1/P`` of every bucket and all-gathers the updated parameters. Communication per step is
therefore all-reduce + all-gather, ``3(P-1)/P`` of the gradient bytes (ZeRO-2 does the same work for
``2(P-1)/P`` by reduce-scattering instead); memory saved: ``(P-1)/P`` of the optimizer state.
"""

from __future__ import annotations

from typing import ClassVar

from dtlab.models.ddp import DDPModel

__all__ = ["ZeRO1Model"]


class ZeRO1Model(DDPModel):
    """DDP gradients (all-reduce) for an optimizer whose state is sharded; same options as DDPModel."""

    strategy_name: ClassVar[str] = "zero1"
