"""The dp reduction of a hybrid step, run once after the pipeline schedule (whose backward passes all
ran inside ``no_sync()``), for the two families of data-parallel strategies:

- buckets (DDP, ZeRO-1, ZeRO-2): every bucket's gradient through the reducer, all-reduce or
  reduce-scatter as the strategy does it during a synchronized backward;
- flat units (ZeRO-3, FSDP): every unit's accumulated gradient reduce-scattered into its shard.

:func:`grad_pieces` lists where a set of parameters' synchronized gradients lie (whole ``.grad`` or
pieces of flat gradient shards), for the tp sum of sequence parallelism and the gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtlab.models._sharded import ShardedModel
from dtlab.models.ddp import DDPModel
from dtlab.models.zero1 import ZeRO1Model

__all__ = ["grad_pieces", "sync_buckets", "sync_units"]


def sync_buckets(model: DDPModel) -> None:
    """Average every bucket over the dp group through the model's reducer (DDP, ZeRO-1, ZeRO-2)."""
    if isinstance(model, ZeRO1Model) and model._grad_state == "rescaled":  # kept gradients, summed anew
        model._grad_state = "local"
    model._reducer.start_step()
    for i, unit in enumerate(model._units):
        for q in unit.params:
            model._store_grad(i, q)
    works = [(i, *model._launch(i)) for i in range(len(model._units))]
    for i, work, extra in works:
        work.wait()
        model._complete(i, extra)
    model._grads_synced = True


def sync_units(model: ShardedModel) -> None:
    """Reduce-scatter every unit's accumulated gradient into its shard (ZeRO-3, FSDP)."""
    model._reducer.start_step()
    try:
        for st in model._units:
            model._reduce(st)
        for st, work, out in model._pending:
            work.wait()
            st.grad_shard.add_(out)
    finally:
        model._pending = []
        for st in model._units:
            st.reduced = False
    model._grads_synced = True


def grad_pieces(model: DDPModel | ShardedModel, wanted: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
    """This rank's synchronized gradient of every parameter ``wanted`` accepts: the whole ``.grad``
    where the strategy keeps whole gradients (DDP, ZeRO-1), else the pieces of its flat gradient shards
    (ZeRO-2, ZeRO-3, FSDP: each rank holds the average of its own slice). The list has the same
    layout on every rank with the same local shapes (the same buckets and units)."""
    if isinstance(model, DDPModel) and model._keep_full_grads:
        return [q.grad for _, q in model._trainable if q.grad is not None and wanted(q)]
    out = []
    for unit in model.shard_units():
        g = model.shard_grad(unit)
        for slot, a, b, off in unit.shard_slots():
            if wanted(unit.params[unit.slots.index(slot)]):
                out.append(g[off : off + b - a])
    return out
