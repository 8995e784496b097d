"""ZeRO-3/FSDP ranks that ran different modules (``find_unused_parameters=True``).

Each unit is gathered by a collective all-gather, matched with the other ranks' by order alone. When
ranks route their batches through different modules (a branch taken on some ranks, experts chosen per
rank) they gather different units at the same point: with units of equal size the engines do not
notice, and every rank receives a mix of the units' shards, computing its forward and gradients with
those (silently wrong). :class:`~dtlab.models.dp._sharded_units.UnitGatherer` keeps a fingerprint of
the units each rank gathered; :func:`same_gathers` compares it across the group before the gradients
are reduced (one all-reduce of two float64), and every rank refuses together on a difference.
"""

from __future__ import annotations

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError

__all__ = ["same_gathers"]


def same_gathers(group: CommunicationBackend, trace: int, who: str) -> None:
    """Refuse, on every rank of ``group`` at once, unless every rank's ``trace`` is the same."""
    buf = torch.tensor([float(trace), -float(trace)], dtype=torch.float64, device=group.device)
    group.all_reduce(buf, ReduceOp.MAX)
    if float(buf[0]) == -float(buf[1]):
        return
    raise StrategyError(
        f"{who} on rank {group.rank}: the ranks of the data-parallel group gathered different units since "
        "the last synchronized backward: they ran different modules of the model, or in another order "
        "(a branch taken on some ranks only, experts chosen per rank). A gather is collective, so a rank "
        "gathering one unit while another gathers an other of the same size receives a mix of both: "
        "this step's forward and gradients are wrong, and nothing was reduced. Under ZeRO-3/FSDP every "
        "rank must run the same modules in the same order: run every branch on every rank (an expert "
        "without tokens on an empty batch), put the branches in one FSDP unit (a wrap_policy on their "
        "parent), or use DDPModel, ZeRO1Model or ZeRO2Model, whose parameters are whole on every rank"
    )
