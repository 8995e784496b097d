"""The pieces of ZeRO-3/FSDP's sharded parameters: what a flat unit keeps at rest and while gathered,
the reference that replaces a saved tensor aliasing a gathered buffer, and the errors of a plain
``state_dict()`` while parameters are sharded."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab.backends.base import Work
from dtlab.errors import StrategyError
from dtlab.models.dp.flat import FlatUnit

__all__ = [
    "SavedRef",
    "ShardUnit",
    "UnitPlan",
    "partial_load_error",
    "partial_state_error",
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
