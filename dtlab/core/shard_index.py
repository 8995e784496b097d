"""The checkpoint format every data-parallel strategy shares: flat slices of named full tensors.

A rank's :class:`~dtlab.core.state.ShardedState` holds, for each full tensor it covers, one flat
slice in ``tensors[key]`` and ``metadata["entries"][key] = {"shape", "dtype", "start", "end"}``: the
slice is elements ``[start, end)`` of the full tensor flattened. Keys are the module's
``state_dict()`` keys; optimizer state uses ``"<param name>.<state key>"`` (``"fc.weight.exp_avg"``)
and keeps 0-dimensional values (``step``) in ``metadata["scalars"]``. Because every strategy writes
the same thing, :class:`ShardIndex` rebuilds any range of any tensor from the shards of every saved
rank, whatever strategy and world size wrote them (DDP <-> ZeRO-1/2/3 <-> FSDP, 4 ranks -> 2).

A parameter sharded on a mesh (:mod:`dtlab.core.placement`) is written as pieces of boxes of the full
tensor: the entry adds ``"box": {"offsets", "sizes"}`` and ``[start, end)`` is then a flat range of
that box; ``"key"`` names the tensor when one rank writes several pieces of it (stored as
``"<key>#<n>"``). :func:`add_placed_slice` and :func:`read_placed` translate a flat range of a rank's
local shard, so tensor-parallel checkpoints load at another tp size, into DDP or the plain module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from dtlab.core._shard_index_checks import DTYPES, check_entries
from dtlab.core._shard_reads import Piece, read_region
from dtlab.core.placement import Box, Placement, Replicate, Shard, local_regions
from dtlab.core.state import LazyTensors, ShardedState, tensor_info
from dtlab.errors import CheckpointError
from dtlab.untrusted import summary

__all__ = [
    "DTYPES",
    "ShardIndex",
    "add_placed_slice",
    "add_scalar",
    "add_slice",
    "check_entries",
    "dtype_from_str",
    "even_range",
    "full_shape_of",
    "new_state",
    "read_placed",
]


def new_state(strategy: str, world_size: int, rank: int, **extra: Any) -> ShardedState:
    """An empty state with the metadata every strategy writes."""
    meta: dict[str, Any] = {
        "strategy": strategy,
        "world_size": world_size,
        "rank": rank,
        "entries": {},
        "scalars": {},
    }
    meta.update(extra)
    return ShardedState(tensors={}, metadata=meta)


def even_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s part ``[start, end)`` of ``numel`` elements split in ``world_size`` chunks."""
    chunk = -(-numel // world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel)


def dtype_from_str(name: str) -> torch.dtype:
    if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
        raise CheckpointError(
            f"dtype {summary(name)} in checkpoint metadata is not one a checkpoint holds "
            f"({', '.join(sorted(DTYPES))})"
        )
    return cast(torch.dtype, getattr(torch, name.removeprefix("torch.")))


def add_slice(
    state: ShardedState,
    key: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    start: int,
    end: int,
    data: torch.Tensor,
) -> None:
    """Record elements ``[start, end)`` of the full tensor ``key`` (``data`` holds exactly those)."""
    if data.numel() != end - start:
        raise ValueError(
            f"add_slice({summary(key)}): data has {data.numel()} elements, range [{start}, {end})"
        )
    numel = 1
    for s in shape:
        numel *= int(s)
    if end <= start and numel > 0:
        return  # this rank holds nothing of it
    state.tensors[key] = data.detach().reshape(-1).to(device="cpu", dtype=dtype, copy=True)
    state.metadata["entries"][key] = {
        "shape": [int(s) for s in shape],
        "dtype": str(dtype).removeprefix("torch."),
        "start": int(start),
        "end": int(end),
    }


def _add_box_slice(
    state: ShardedState,
    key: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    box: Box,
    start: int,
    end: int,
    data: torch.Tensor,
) -> None:
    """Record elements ``[start, end)`` of ``box`` of the full tensor ``key`` flattened."""
    if tuple(box.offsets) == (0,) * len(shape) and tuple(box.sizes) == tuple(int(s) for s in shape):
        if key not in state.tensors:
            add_slice(state, key, shape, dtype, start, end, data)
            return
    if end <= start:
        return
    store, n = key, 0
    while store in state.tensors:
        n += 1
        store = f"{key}#{n}"
    state.tensors[store] = data.detach().reshape(-1).to(device="cpu", dtype=dtype, copy=True)
    state.metadata["entries"][store] = {
        "key": key,
        "shape": [int(s) for s in shape],
        "dtype": str(dtype).removeprefix("torch."),
        "start": int(start),
        "end": int(end),
        "box": {"offsets": list(box.offsets), "sizes": list(box.sizes)},
    }


def full_shape_of(local_shape: Sequence[int], placement: Placement, size: int) -> list[int]:
    """The full tensor's shape from a local shard's shape (``size``: ranks on the placement's axis)."""
    shape = [int(s) for s in local_shape]
    if isinstance(placement, Shard):
        shape[placement.dim] *= size
    return shape


def add_placed_slice(
    state: ShardedState,
    key: str,
    local_shape: Sequence[int],
    placement: Placement,
    coord: int,
    size: int,
    dtype: torch.dtype,
    start: int,
    end: int,
    data: torch.Tensor,
) -> None:
    """Record elements ``[start, end)`` of this rank's local shard of ``key`` (coordinate ``coord`` of
    ``size`` on the placement's axis) as pieces of the full tensor."""
    full = full_shape_of(local_shape, placement, size)
    flat = data.reshape(-1)
    for box, bs, be, off in local_regions(placement, full, coord, size, start, end):
        _add_box_slice(state, key, full, dtype, box, bs, be, flat[off - start : off - start + be - bs])


def read_placed(
    index: ShardIndex,
    key: str,
    local_shape: Sequence[int],
    placement: Placement,
    coord: int,
    size: int,
    start: int,
    end: int,
) -> torch.Tensor:
    """Elements ``[start, end)`` of this rank's local shard of ``key``, from whatever the checkpoint holds."""
    if isinstance(placement, Replicate) or size == 1:
        return index.read(key, start, end)
    full = full_shape_of(local_shape, placement, size)
    if list(index.shape(key)) != full:
        raise CheckpointError(
            f"{summary(key)} has shape {index.shape(key)} in the checkpoint but {full} in the model "
            f"({placement} over {size} ranks)"
        )
    parts = [
        index.read_box(key, box, bs, be)
        for box, bs, be, _ in local_regions(placement, full, coord, size, start, end)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def add_scalar(state: ShardedState, key: str, value: torch.Tensor | float | int) -> None:
    """Record a 0-dimensional value (e.g. an optimizer's ``step``) in ``metadata["scalars"]``."""
    if isinstance(value, torch.Tensor):
        state.metadata["scalars"][key] = {
            "value": value.item(),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    else:
        state.metadata["scalars"][key] = {"value": value, "dtype": None}


class ShardIndex:
    """Every saved rank's slices, indexed by key; reads any flat range of any full tensor."""

    def __init__(self, shards: Sequence[ShardedState]) -> None:
        if isinstance(shards, ShardedState):
            raise TypeError(
                "load_sharded_state_dict expects the list of every saved rank's ShardedState, "
                "got a single ShardedState; pass [state] for a one-rank checkpoint"
            )
        ok = isinstance(shards, Sequence) and not isinstance(shards, str | bytes)
        if bad := [type(x).__name__ for x in shards if not isinstance(x, ShardedState)] if ok else [shards]:
            raise TypeError(
                "load_sharded_state_dict expects the list of every saved rank's ShardedState "
                f"(model.sharded_state_dict() on each), got {summary(bad)}"
            )
        if len(shards) == 0:
            raise CheckpointError("load_sharded_state_dict got an empty list of shards")
        #: per key, the saved pieces: flat ranges of the full tensor or of a box of it
        self.pieces: dict[str, list[Piece]] = {}
        self.meta: dict[str, tuple[list[int], str]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        self.strategies: set[str] = set()
        self.extra: dict[str, Any] = {}
        for i, shard in enumerate(shards):
            md = shard.metadata
            if not isinstance(md, dict) or "entries" not in md:
                raise CheckpointError(
                    f"shard {i} has no metadata['entries']; it was not written by a dtlab data-parallel "
                    f"strategy (metadata keys: {summary(sorted(md) if isinstance(md, dict) else md)})"
                )
            check_entries(shard, f"shard {i}")
            self.strategies.add(str(md.get("strategy")))
            for key, value in md.items():
                if key not in ("entries", "scalars", "rank"):
                    self.extra.setdefault(key, value)
            self.scalars.update(md.get("scalars", {}))
            for store, e in md["entries"].items():
                key = e.get("key", store)
                self._add(i, shard, store, key, e)
        tied = self.extra.get("tied", {})
        if not isinstance(tied, dict):
            raise CheckpointError(f"metadata['tied'] must map names to names, got {summary(tied)}")
        self.alias(tied)

    def _add(self, i: int, shard: ShardedState, store: str, key: str, e: dict[str, Any]) -> None:
        """Index entry ``store`` of shard ``i`` (its tensor is not read: a lazy one is checked against
        its entry when its file is verified)."""
        lazy = isinstance(shard.tensors, LazyTensors) and shard.tensors.pending(store)
        held = None if lazy else tensor_info(shard.tensors, store)
        if not lazy and held is None:
            raise CheckpointError(f"shard {i} lists entry {summary(store)} but holds no tensor for it")
        if held is not None and held[0] != e["end"] - e["start"]:
            raise CheckpointError(
                f"shard {i}: {summary(key)} covers [{e['start']}, {e['end']}) but holds {held[0]} elements"
            )
        prev = self.meta.setdefault(key, (list(e["shape"]), e["dtype"]))
        if prev[0] != list(e["shape"]):
            raise CheckpointError(
                f"{summary(key)} has shape {prev[0]} in one shard and {e['shape']} in another"
            )
        box = Box(tuple(e["box"]["offsets"]), tuple(e["box"]["sizes"])) if "box" in e else None
        piece = Piece(box, int(e["start"]), int(e["end"]), shard.tensors, store)
        self.pieces.setdefault(key, []).append(piece)

    def alias(self, tied: Mapping[str, str]) -> None:
        """Read a tied weight's other names (``{other: first}``) from its first name where the shards
        lack them: a pipeline stores a weight tied across stages once, a model without one under its
        first name; its optimizer state (``first.exp_avg``, ``first.step``) likewise."""
        for other, first in tied.items():
            if not (isinstance(other, str) and isinstance(first, str)):
                raise CheckpointError(f"tied names must map names to names, got {summary(tied)}")
            for key in [k for k in self.meta if k == first or k.startswith(f"{first}.")]:
                to = other + key[len(first) :]
                if to in self.meta:
                    continue
                self.meta[to] = self.meta[key]
                if key in self.pieces:
                    self.pieces[to] = self.pieces[key]
            for key in [k for k in self.scalars if k.startswith(f"{first}.")]:
                self.scalars.setdefault(other + key[len(first) :], self.scalars[key])

    def __contains__(self, key: str) -> bool:
        return key in self.meta

    def keys(self) -> list[str]:
        return list(self.meta)

    def shape(self, key: str) -> list[int]:
        return self._require(key)[0]

    def read(self, key: str, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened full tensor ``key``, assembled from the slices."""
        shape, dtype = self._require(key)
        numel = 1
        for s in shape:
            numel *= s
        stop = numel if end is None else end
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"range [{start}, {stop}) is outside {summary(key)} of {numel} elements")
        self._check_held(key, stop - start)
        return read_region(key, shape, dtype_from_str(dtype), self.pieces.get(key, []), None, start, stop)

    def full(self, key: str) -> torch.Tensor:
        return self.read(key).reshape(self.shape(key))

    def read_box(self, key: str, box: Box, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``box`` of the full tensor ``key`` flattened (only the saved
        pieces that overlap them are read)."""
        shape, dtype = self._require(key)
        if len(box.sizes) != len(shape) or any(
            o < 0 or o + n > d for o, n, d in zip(box.offsets, box.sizes, shape, strict=False)
        ):
            raise CheckpointError(f"box {box} is outside {summary(key)} of shape {shape}")
        if not 0 <= start <= end <= box.numel:
            raise CheckpointError(f"range [{start}, {end}) is outside box {box} of {summary(key)}")
        self._check_held(key, end - start)
        return read_region(key, shape, dtype_from_str(dtype), self.pieces.get(key, []), box, start, end)

    def check_complete(self, where: str) -> None:
        """A :class:`CheckpointError` unless the shards hold at least every element of every tensor
        (what a checkpoint holding every saved rank's shards must), checked without allocating."""
        for key in self.meta:
            try:
                self._check_held(key, math.prod(self.meta[key][0]))
            except CheckpointError as exc:
                raise CheckpointError(f"{where} is corrupted: {exc}") from None

    def _check_held(self, key: str, needed: int) -> None:
        """Before allocating ``needed`` elements of ``key``: the shards must hold at least that many
        (so what a loader allocates is bounded by what the files hold, whatever a shape says)."""
        held = sum(p.end - p.start for p in self.pieces.get(key, []))
        if held < needed:
            raise CheckpointError(
                f"the checkpoint's shards cover only {held} elements of {summary(key)}, fewer than the "
                f"{needed} "
                f"asked for (shape {self.meta[key][0]}); pass the shards of every saved rank, or the "
                "checkpoint is corrupted"
            )

    def _require(self, key: str) -> tuple[list[int], str]:
        if key not in self.meta:
            known = sorted(self.meta)
            raise CheckpointError(
                f"the checkpoint has no tensor {summary(key)} (it holds {len(known)} tensors, e.g. "
                f"{summary(known[:5])}); "
                "was it saved from the same model?"
            )
        return self.meta[key]
