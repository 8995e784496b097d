"""A rank's shard of a small whole state, in the format the strategies share (flat slices named in
``metadata["entries"]``), for the checkpoint tests that write and read shards without a model."""

from __future__ import annotations

import torch

from dtlab.core.state import ShardedState


def flat_shard(full: dict[str, torch.Tensor], rank: int, world: int, scale: float = 1.0) -> ShardedState:
    """Rank ``rank``'s of ``world`` contiguous flat slices of every float32 tensor of ``full``, times
    ``scale`` (a different state per step)."""
    tensors, entries = {}, {}
    for k, v in full.items():
        n = v.numel()
        per = -(-n // world)
        s, e = min(n, rank * per), min(n, (rank + 1) * per)
        tensors[k] = v.reshape(-1)[s:e] * scale
        entries[k] = {"shape": list(v.shape), "dtype": "float32", "start": s, "end": e}
    return ShardedState(tensors, {"strategy": "test", "world_size": world, "rank": rank, "entries": entries})
