"""Assemble full tensors from every rank's flat shards; ``dtlab consolidate`` writes one safetensors file.

Shards follow the format shared by all data-parallel strategies (``dtlab/models/state.py``):
``ShardedState.tensors[key]`` is a flat slice of the full tensor ``key`` and
``metadata["entries"][key] = {"shape", "dtype", "start", "end"}`` says which elements it covers. The
assembly is :class:`dtlab.models.state.ShardIndex`, the same code the strategies load with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dtlab.checkpoint.files import durable_write
from dtlab.core.state import ShardedState
from dtlab.models.state import ShardIndex

__all__ = ["consolidate", "full_tensors_from_shards"]


def full_tensors_from_shards(shards: Sequence[ShardedState]) -> dict[str, torch.Tensor]:
    """Every full tensor; a :class:`~dtlab.errors.CheckpointError` if an element is not covered."""
    index = ShardIndex(shards)
    return {key: index.full(key) for key in index.keys()}


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
