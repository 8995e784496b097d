"""The composition's own communication (the layers' collectives and the sequence-parallel sum are in
``dtlab.models.tensor._comm``, the stage messages in ``dtlab.models.pipeline._comm``, the dp reduction
in the data-parallel strategies), and where a strategy's synchronized gradients lie (:func:`grads_of`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Shard
from dtlab.models.compose._build import Entries
from dtlab.models.pipeline._comm import broadcast_over_pp
from dtlab.models.tensor._comm import gather_over_tp

if TYPE_CHECKING:
    from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["gather_whole_state", "grads_of"]


def grads_of(
    dp: DataParallelModel, wanted: Callable[[str], bool], whole: bool | None = None
) -> list[torch.Tensor]:
    """This rank's synchronized gradient of every parameter whose name ``wanted`` accepts: the whole
    ``.grad`` where ``whole`` (default: where the strategy keeps whole gradients, DDP and ZeRO-1), else
    the pieces of its flat gradient shards (each rank holds the average of its own slice). The list
    has the same layout on every rank with the same local shapes (the same buckets and units)."""
    if dp.keeps_whole_grads if whole is None else whole:
        return [g for n, g in dp.whole_grads() if wanted(n)]
    out: list[torch.Tensor] = []
    for unit in dp.shard_units():
        g = dp.shard_grad(unit)
        out.extend(g[off : off + b - a] for slot, a, b, off in unit.shard_slots() if wanted(slot.name))
    return out


def gather_whole_state(
    local: Mapping[str, torch.Tensor], entries: Entries, tp: CommunicationBackend, pp: CommunicationBackend
) -> dict[str, torch.Tensor]:
    """Every tensor of the whole model on every rank, from each pipeline rank's ``local`` tensors (whole
    over dp): tp shards gathered, then each tensor broadcast from the pipeline rank holding it."""
    out = {}
    for key, (shape, dtype, owner, placement) in entries.items():
        mine: torch.Tensor | None = None
        if owner == pp.rank:
            mine = local[key]
            if isinstance(placement, Shard):
                mine = gather_over_tp(mine, placement, tp)
        out[key] = broadcast_over_pp(mine, shape, dtype, owner, pp)
    return out
