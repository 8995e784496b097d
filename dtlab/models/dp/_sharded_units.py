"""The pieces of ZeRO-3/FSDP's sharded parameters: what a flat unit keeps at rest and while gathered,
the reference that replaces a saved tensor aliasing a gathered buffer, and the unit's checkpoint state
(this rank's flat shards as slices of the full tensors; buffers and frozen parameters whole)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, Work
from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError, StrategyError
from dtlab.models.dp.flat import FlatUnit
from dtlab.models.shard_index import ShardIndex, add_slice, even_range

__all__ = [
    "SavedRef",
    "ShardUnit",
    "UnitPlan",
    "partial_load_error",
    "partial_state_error",
    "read_flat_state",
    "write_flat_state",
]


@dataclass(frozen=True)
class UnitPlan:
    """One flat unit to build: its key, its parameters and whether it stays gathered."""

    key: str
    params: list[tuple[str, nn.Parameter]]
    persistent: bool = False


@dataclass
class ShardUnit:
    """A flat unit at rest as this rank's shard, with its gathered buffer while in use."""

    unit: FlatUnit
    shard: torch.Tensor
    grad_shard: torch.Tensor
    persistent: bool
    index: int
    flat: torch.Tensor | None = None
    work: Work | None = None
    ready: set[int] = field(default_factory=set)
    reduced: bool = False


@dataclass(frozen=True)
class SavedRef:
    """A saved tensor that aliases a gathered buffer: re-gathered on unpack."""

    unit: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def write_flat_state(
    state: ShardedState, units: Sequence[ShardUnit], other: Mapping[str, torch.Tensor], p: int, r: int
) -> ShardedState:
    """This rank's flat shards, and its ``1/p`` slice of the tensors held whole (``other``)."""
    for st in units:
        for slot, a, b, so in st.unit.shard_slots():
            add_slice(state, slot.name, slot.shape, st.unit.dtype, a, b, st.shard[so : so + b - a])
    for key, t in other.items():
        s, e = even_range(t.numel(), p, r)
        add_slice(state, key, t.shape, t.dtype, s, e, t.detach().reshape(-1)[s:e])
    return state


def read_flat_state(
    index: ShardIndex, units: Sequence[ShardUnit], other: Mapping[str, torch.Tensor], dp: CommunicationBackend
) -> None:
    """Fill the flat shards (re-gathering the units gathered now) and the whole tensors from ``index``."""
    with torch.no_grad():
        for st in units:
            buf = torch.zeros_like(st.shard)
            for slot, a, b, so in st.unit.shard_slots():
                if slot.name in index and index.shape(slot.name) != list(slot.shape):
                    raise CheckpointError(
                        f"{slot.name!r} has shape {index.shape(slot.name)} in the checkpoint but "
                        f"{list(slot.shape)} in the model"
                    )
                buf[so : so + b - a].copy_(index.read(slot.name, a, b))
            st.shard.copy_(buf)
            if st.flat is not None:
                dp.all_gather(st.flat, st.shard)
        for key, t in other.items():
            full = index.full(key)
            if tuple(full.shape) != tuple(t.shape):
                raise CheckpointError(
                    f"{key!r}: checkpoint shape {tuple(full.shape)}, model {tuple(t.shape)}"
                )
            t.data.copy_(full.to(device=t.device, dtype=t.dtype))


def partial_state_error(who: str, freed: list[str], world: int) -> StrategyError:
    return StrategyError(
        f"{who}.state_dict(): parameters {freed[:3]}{' ...' if len(freed) > 3 else ''} ({len(freed)} units) "
        f"are sharded: this rank holds 1/{world} of each, so state_dict() would return empty tensors. Call "
        "model.full_state_dict() on every rank (collective; whole tensors keyed like the plain module's "
        "state_dict()) or model.sharded_state_dict() for this rank's shard (what dtlab.checkpoint saves "
        "and loads under any world size)"
    )


def partial_load_error(who: str, freed: list[str]) -> StrategyError:
    return StrategyError(
        f"{who}.load_state_dict(): parameters {freed[:3]} are sharded (empty tensors on this rank between "
        "uses); load with model.load_sharded_state_dict(shards) or dtlab.checkpoint (any world size, any "
        "data-parallel strategy)"
    )
