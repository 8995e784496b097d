"""Assemble full tensors from every rank's flat shards; ``dtlab consolidate`` writes one safetensors file.

Shards follow the format shared by all data-parallel strategies (``dtlab/core/shard_index.py``):
``ShardedState.tensors[key]`` is a flat slice of the full tensor ``key`` and
``metadata["entries"][key] = {"shape", "dtype", "start", "end"}`` says which elements it covers. The
assembly is :class:`dtlab.core.shard_index.ShardIndex`, the same code the strategies load with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from dtlab.checkpoint.safe_files import write_output
from dtlab.core.shard_index import ShardIndex
from dtlab.core.state import ShardedState
from dtlab.errors import UnsafePathError, check_path

__all__ = ["consolidate", "full_tensors_from_shards"]


def full_tensors_from_shards(shards: Sequence[ShardedState]) -> dict[str, torch.Tensor]:
    """Every full tensor keyed like the plain module's ``state_dict()`` (a tied weight under each of
    its names); a :class:`~dtlab.errors.CheckpointError` if an element is not covered."""
    index = ShardIndex(shards)
    out = {key: index.full(key) for key in index.keys()}
    for alias, key in dict(index.extra.get("aliases") or {}).items():  # tied weights: every name
        if alias not in out and key in out:
            out[alias] = out[key].clone()
    return out


def consolidate(checkpoint: str | Path, output: str | Path) -> Path:
    """Write the full model of a checkpoint (any strategy, any world size) as one safetensors file."""
    from dtlab.checkpoint.load import read_checkpoint

    check_path("consolidate", "checkpoint", checkpoint, "a checkpoint directory")
    check_path("consolidate", "output", output, "the safetensors file to write")
    out = Path(output)
    _check_output(out)  # before reading anything
    ckpt = read_checkpoint(checkpoint, with_optimizer=False)
    tensors = full_tensors_from_shards(ckpt.model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UnsafePathError(f"-o {out}: its directory cannot be created: {exc.strerror or exc}") from None
    strategy = ckpt.meta.get("strategy", {})
    metadata = {"step": str(ckpt.step), "source": str(ckpt.path), "strategy": str(strategy)[:4096]}
    data = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    write_output(out, data, f"-o {out}")
    return out


def _check_output(out: Path) -> None:
    """``out`` must name a file whose directory is (or can become) a directory."""
    if out.is_dir() and not out.is_symlink():
        raise UnsafePathError(f"-o {out} is a directory; give a file name, e.g. {out / 'model.safetensors'}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UnsafePathError(f"-o {out}: {parent} is a file, not a directory")
            break
