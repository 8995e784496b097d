"""The checkpoint format every data-parallel strategy shares: flat slices of named full tensors.

A rank's :class:`~dtlab.core.state.ShardedState` holds, for each full tensor it covers, one flat
slice in ``tensors[key]`` and ``metadata["entries"][key] = {"shape", "dtype", "start", "end"}``: the
slice is elements ``[start, end)`` of the full tensor flattened. Keys are the module's
``state_dict()`` keys; optimizer state uses ``"<param name>.<state key>"`` (``"fc.weight.exp_avg"``)
and keeps 0-dimensional values (``step``) in ``metadata["scalars"]``. Because every strategy writes
the same thing, :class:`ShardIndex` rebuilds any range of any tensor from the shards of every saved
rank, whatever strategy and world size wrote them (DDP <-> ZeRO-1/2/3 <-> FSDP, 4 ranks -> 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtlab.core.state import ShardedState
from dtlab.errors import CheckpointError

__all__ = ["ShardIndex", "add_slice", "add_scalar", "dtype_from_str", "even_range", "new_state"]


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
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


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
        raise ValueError(f"add_slice({key!r}): data has {data.numel()} elements, range [{start}, {end})")
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
        if len(shards) == 0:
            raise CheckpointError("load_sharded_state_dict got an empty list of shards")
        self.pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self.meta: dict[str, tuple[list[int], str]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        self.strategies: set[str] = set()
        self.extra: dict[str, Any] = {}
        for i, shard in enumerate(shards):
            md = shard.metadata
            if "entries" not in md:
                raise CheckpointError(
                    f"shard {i} has no metadata['entries']; it was not written by a dtlab data-parallel "
                    f"strategy (metadata keys: {sorted(md)})"
                )
            self.strategies.add(str(md.get("strategy")))
            for key, value in md.items():
                if key not in ("entries", "scalars", "rank"):
                    self.extra.setdefault(key, value)
            self.scalars.update(md.get("scalars", {}))
            for key, e in md["entries"].items():
                if key not in shard.tensors:
                    raise CheckpointError(f"shard {i} lists entry {key!r} but holds no tensor for it")
                t = shard.tensors[key].reshape(-1)
                if t.numel() != e["end"] - e["start"]:
                    raise CheckpointError(
                        f"shard {i}: {key!r} covers [{e['start']}, {e['end']}) but holds {t.numel()} elements"
                    )
                prev = self.meta.setdefault(key, (list(e["shape"]), e["dtype"]))
                if prev[0] != list(e["shape"]):
                    raise CheckpointError(
                        f"{key!r} has shape {prev[0]} in one shard and {e['shape']} in another"
                    )
                self.pieces.setdefault(key, []).append((int(e["start"]), int(e["end"]), t))

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
            raise CheckpointError(f"range [{start}, {stop}) is outside {key!r} of {numel} elements")
        out = torch.empty(stop - start, dtype=dtype_from_str(dtype))
        covered = 0
        for s, e, t in self.pieces[key]:
            lo, hi = max(s, start), min(e, stop)
            if lo < hi:
                out[lo - start : hi - start].copy_(t[lo - s : hi - s])
                covered += hi - lo
        if covered < stop - start:
            raise CheckpointError(
                f"the checkpoint's shards cover only {covered} of elements [{start}, {stop}) of {key!r}; "
                "pass the shards of every saved rank"
            )
        return out

    def full(self, key: str) -> torch.Tensor:
        return self.read(key).reshape(self.shape(key))

    def _require(self, key: str) -> tuple[list[int], str]:
        if key not in self.meta:
            known = sorted(self.meta)
            raise CheckpointError(
                f"the checkpoint has no tensor {key!r} (it holds {len(known)} tensors, e.g. {known[:5]}); "
                "was it saved from the same model?"
            )
        return self.meta[key]
