"""Assemble full tensors from every rank's flat shards; ``dtlab consolidate`` writes one safetensors file.

Shards follow the format shared by all data-parallel strategies: ``ShardedState.tensors[key]`` is a
flat slice of the full tensor ``key`` and ``metadata["entries"][key] = {"shape", "dtype", "start",
"end"}`` says which elements ``[start, end)`` it covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dtlab.checkpoint.files import durable_write
from dtlab.errors import CheckpointError
from dtlab.models.base import ShardedState

__all__ = ["consolidate", "full_tensors_from_shards"]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in shard metadata")
    return dt


def full_tensors_from_shards(shards: Sequence[ShardedState]) -> dict[str, torch.Tensor]:
    """Every full tensor, checked to be covered exactly once by the shards' ranges."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for shard in shards:
        entries = shard.metadata.get("entries")
        if not isinstance(entries, dict):
            raise CheckpointError(
                f"shard of rank {shard.metadata.get('rank')} has no 'entries' metadata; cannot reshard it"
            )
        for key, e in entries.items():
            shape = [int(s) for s in e["shape"]]
            if key not in out:
                out[key] = torch.empty(shape, dtype=_dtype(str(e["dtype"])))
                covered[key] = 0
            start, end = int(e["start"]), int(e["end"])
            if end <= start:
                continue
            piece = shard.tensors.get(key)
            if piece is None or piece.numel() != end - start:
                raise CheckpointError(
                    f"shard of rank {shard.metadata.get('rank')}: tensor {key!r} should hold elements "
                    f"[{start}, {end}) but holds {None if piece is None else piece.numel()}"
                )
            out[key].view(-1)[start:end] = piece.reshape(-1).to(out[key].dtype)
            covered[key] += end - start
    missing = {k: (covered[k], out[k].numel()) for k in out if covered[k] != out[k].numel()}
    if missing:
        raise CheckpointError(f"shards do not cover every element exactly once (covered, total): {missing}")
    return out


def consolidate(checkpoint: str | Path, output: str | Path) -> Path:
    """Write the full model of a checkpoint (any strategy, any world size) as one safetensors file."""
    from dtlab.checkpoint.load import read_checkpoint

    ckpt = read_checkpoint(checkpoint, with_optimizer=False)
    tensors = full_tensors_from_shards(ckpt.model)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    strategy = ckpt.meta.get("strategy", {})
    metadata = {"step": str(ckpt.step), "source": str(ckpt.path), "strategy": str(strategy)}
    durable_write(out, st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))
    return out
