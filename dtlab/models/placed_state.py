"""Every model strategy's checkpoint state: placed shards in the format every strategy reads.

A rank writes what it holds: tensors held whole as even flat slices (over dp, or the dp x tp ranks of
its stage), ZeRO-3/FSDP flat shards as they are, tensors sharded over tp as boxes of the full tensor.
Every full tensor is covered exactly once, so a checkpoint loads under any mesh, any data-parallel
strategy, or into the plain module (``dtlab/core/shard_index.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Placement, Replicate, Shard
from dtlab.core.shard_index import ShardIndex, add_placed_slice, add_slice, even_range, read_placed
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError

if TYPE_CHECKING:
    from dtlab.models.dp.flat import FlatUnit

__all__ = ["FlatShard", "given_state", "load_placed_state", "write_placed_state"]

_WHOLE = Replicate()


def given_state(who: str, state_dict: object) -> dict[str, Any]:
    """``state_dict`` keyed like the plain module's (a torch DDP checkpoint's ``module.`` prefix dropped),
    after refusing what is not a mapping (torch: "Expected state_dict to be dict-like")."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{who}.load_state_dict() takes a mapping of names to tensors, as the plain module's "
            f"state_dict() gives, got {type(state_dict).__name__}; read a file first (torch.load(path, "
            "weights_only=True), safetensors.torch.load_file(path)) or use dtlab.checkpoint.load_pretrained"
        )
    given = dict(state_dict)
    if given and all(isinstance(k, str) and k.startswith("module.") for k in given):
        given = {k.removeprefix("module."): v for k, v in given.items()}
    return given


class FlatShard(Protocol):
    """What ZeRO-3/FSDP keep per flat unit (``dtlab.models.dp._sharded_units.ShardUnit``)."""

    unit: FlatUnit
    shard: torch.Tensor
    flat: torch.Tensor | None


def _tp_coord(placement: Placement, tp: CommunicationBackend | None) -> tuple[int, int]:
    return (tp.rank, tp.world_size) if tp is not None and isinstance(placement, Shard) else (0, 1)


def write_placed_state(
    state: ShardedState,
    whole: Mapping[str, torch.Tensor],
    flat_units: Iterable[FlatShard],
    placements: Mapping[str, Placement],
    dp: CommunicationBackend,
    tp: CommunicationBackend | None = None,
    span: CommunicationBackend | None = None,
    skip: Collection[str] = (),
) -> ShardedState:
    """Add this rank's pieces to ``state``: ``whole`` (tensors this rank holds whole: parameters of
    DDP/ZeRO-1/2, buffers and frozen parameters; parameters as ``nn.Parameter``, ``keep_vars=True``)
    and ``flat_units`` (ZeRO-3/FSDP shards); not the
    tensors named in ``skip`` (another rank writes them: replicated buffers, tied copies). A tensor
    ``placements`` does not name is replicated; ``tp``: the axis of the ``Shard`` placements (none
    without tensor parallelism); ``span``: the ranks a replicated parameter is split over (default dp).
    A replicated buffer is written whole by ``span``'s rank 0: the ranks' copies may differ (BatchNorm's
    running statistics, each rank's from its own batch until the next forward broadcasts rank 0's), and
    slices of each would stitch a buffer no rank holds."""
    span = dp if span is None else span
    for key, t in whole.items():
        if key in skip:
            continue
        placement = placements.get(key, _WHOLE)
        flat = t.detach().reshape(-1)
        if isinstance(placement, Shard):
            s, e = even_range(t.numel(), dp.world_size, dp.rank)
            coord, size = _tp_coord(placement, tp)
            add_placed_slice(state, key, t.shape, placement, coord, size, t.dtype, s, e, flat[s:e])
        elif isinstance(t, torch.nn.Parameter):
            s, e = even_range(t.numel(), span.world_size, span.rank)
            add_slice(state, key, t.shape, t.dtype, s, e, flat[s:e])
        elif span.rank == 0:  # a buffer: rank 0's values, those the next forward broadcasts
            add_slice(state, key, t.shape, t.dtype, 0, t.numel(), flat)
    for st in flat_units:
        for slot, a, b, so in st.unit.shard_slots():
            placement = placements.get(slot.name, _WHOLE)
            if slot.name in skip or (not isinstance(placement, Shard) and tp is not None and tp.rank != 0):
                continue  # another rank's, or the same values on every tp rank: written once
            coord, size = _tp_coord(placement, tp)
            piece = st.shard[so : so + b - a]
            add_placed_slice(state, slot.name, slot.shape, placement, coord, size, st.unit.dtype, a, b, piece)
    return state


def load_placed_state(
    shards: Sequence[ShardedState],
    whole: Mapping[str, torch.Tensor],
    flat_units: Iterable[FlatShard],
    placements: Mapping[str, Placement],
    dp: CommunicationBackend,
    tp: CommunicationBackend | None = None,
    tied: Mapping[str, str] | None = None,
) -> None:
    """Fill this rank's tensors from the shards of any saved mesh or strategy (or a plain module's);
    the arguments as for :func:`write_placed_state`. A tensor under several names (tied) loads once;
    ``tied`` (a tied weight's other names -> its first) reads a name the shards lack from the first."""
    index = ShardIndex(shards)
    index.alias(tied or {})
    seen: set[int] = set()
    with torch.no_grad():
        for key, t in whole.items():
            if id(t) not in seen:
                seen.add(id(t))
                data = _read(index, key, t.shape, placements, tp, 0, t.numel())
                t.data.copy_(data.view(t.shape).to(device=t.device, dtype=t.dtype))
        units = list(flat_units)
        bufs = []  # every unit read before any gather: a read that fails leaves no rank in a collective
        for st in units:
            buf = torch.zeros_like(st.shard)
            for slot, a, b, so in st.unit.shard_slots():
                buf[so : so + b - a].copy_(_read(index, slot.name, slot.shape, placements, tp, a, b))
            bufs.append(buf)
        for st, buf in zip(units, bufs, strict=True):
            st.shard.copy_(buf)
            if st.flat is not None:
                dp.all_gather(st.flat, st.shard)


def _read(
    index: ShardIndex,
    key: str,
    shape: Sequence[int],
    placements: Mapping[str, Placement],
    tp: CommunicationBackend | None,
    start: int,
    end: int,
) -> torch.Tensor:
    """Elements ``[start, end)`` of this rank's local ``key`` (of local ``shape``), checked present
    (and, unless sharded over tp, of the saved shape)."""
    placement = placements.get(key, _WHOLE)
    if key not in index:
        raise CheckpointError(
            f"the checkpoint has no entry for {key!r}; it was saved from another model (strategies in it: "
            f"{sorted(index.strategies)})"
        )
    if not isinstance(placement, Shard) and index.shape(key) != [int(s) for s in shape]:
        raise CheckpointError(
            f"{key!r} has shape {index.shape(key)} in the checkpoint but {list(shape)} in the model"
        )
    coord, size = _tp_coord(placement, tp)
    return read_placed(index, key, shape, placement, coord, size, start, end)
