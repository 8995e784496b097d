"""The composition's own communication (the layers' collectives and the sequence-parallel sum are in
``dtlab.models.tensor._comm``, the stage messages in ``dtlab.models.pipeline._comm``, the dp reduction
in the data-parallel strategies), and where a strategy's synchronized gradients lie (:func:`grads_of`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Shard
from dtlab.errors import StrategyError
from dtlab.models.compose._build import Entries
from dtlab.models.pipeline._comm import broadcast_over_pp
from dtlab.models.tensor._comm import gather_over_tp

if TYPE_CHECKING:
    from dtlab.models.dp.data_parallel import DataParallelModel

__all__ = ["gather_whole_state", "grads_of", "renamed_message"]


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
    gone = [k for k, (_, _, owner, _) in entries.items() if owner == pp.rank and k not in local]
    # model.module's tensors renamed since wrapping (every rank of a stage changed it alike): refused on
    # every pipeline rank, not only the stage's (the others would wait in the broadcasts below)
    flags = pp.all_gather_object(bool(gone)) if pp.world_size > 1 else [bool(gone)]
    where = [r for r, changed in enumerate(flags) if changed]
    if where:
        raise StrategyError(renamed_message(gone, [k for k in local if k not in entries], where))
    out = {}
    for key, (shape, dtype, owner, placement) in entries.items():
        mine: torch.Tensor | None = None
        if owner == pp.rank:
            mine = local[key]
            if isinstance(placement, Shard):
                mine = gather_over_tp(mine, placement, tp)
        out[key] = broadcast_over_pp(mine, shape, dtype, owner, pp)
    return out


def renamed_message(gone: list[str], new: list[str], ranks: list[int] | None = None) -> str:
    """Why tensors of the wrapped module renamed since wrapping (``gone``, now ``new``; none here: on
    pipeline ranks ``ranks``) are refused."""
    return (
        (
            f"the wrapped module's state no longer has {gone[:5]} (it has {new[:5]} instead)"
            if gone
            else f"the wrapped module's state on pipeline rank(s) {ranks} was renamed (their error names it)"
        )
        + ": model.module was changed after wrapping (torch.nn.utils.prune renames weight to "
        "weight_orig and weight_mask; a parametrization or a layer replaced). The composition laid its "
        "tensors out when it wrapped the module, and on a split layer a mask computed now comes from "
        "this rank's slice only: change the plain module before wrapping it (prune, then prune.remove() "
        "to keep the pruned values), or load model.state_dict() (every rank, before the change) into a "
        "fresh plain module, change that and wrap it"
    )
