"""Checks of the flat-slice checkpoint format (:mod:`dtlab.core.shard_index`) before anything is allocated:
every entry's shape, dtype, range and box, against the tensor the shard holds (for a state read lazily
from a checkpoint, against its file's header once the file is verified)."""

from __future__ import annotations

import math
from typing import Any

import torch

from dtlab.core.state import LazyTensors, ShardedState, tensor_info
from dtlab.errors import CheckpointError
from dtlab.untrusted import summary

__all__ = ["DTYPES", "check_entries"]

#: the dtypes a checkpoint entry may name: those safetensors stores and torch computes with
DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
    | {"float8_e4m3fn", "float8_e5m2"}
)
_MAX_DIMS = 32
_MAX_NUMEL = 2**48


def _ints(value: Any, n: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= _MAX_DIMS
        and (n is None or len(value) == n)
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_NUMEL for v in value)
    )


def _entry_problem(e: Any, held: tuple[int, torch.dtype] | None, pending: bool) -> str | None:
    """What is wrong with one entry of ``metadata["entries"]`` and its tensor (``held``: its elements and
    dtype; ``pending``: in a file not verified yet, which checks it then); ``None``: sound."""
    if not isinstance(e, dict):
        return f"is {summary(e)}, not an object"
    shape: Any = e.get("shape")
    if not _ints(shape):
        return f"has shape {summary(shape)}, not a list of at most {_MAX_DIMS} sizes"
    numel = math.prod(shape)
    if numel > _MAX_NUMEL:
        return f"has shape {shape}: {numel} elements, more than {_MAX_NUMEL}"
    if not isinstance(e.get("dtype"), str) or e["dtype"] not in DTYPES:
        return f"has dtype {summary(e.get('dtype'))}, not one of {', '.join(sorted(DTYPES))}"
    start: Any = e.get("start")
    end: Any = e.get("end")
    span = numel
    if "box" in e:
        box = e["box"]
        if not isinstance(box, dict) or not _ints(box.get("offsets"), len(shape)):
            return f"has box {summary(box)}, not {{offsets, sizes}} with one of each per dimension"
        if not _ints(box.get("sizes"), len(shape)) or any(
            o + s > d for o, s, d in zip(box["offsets"], box["sizes"], shape, strict=True)
        ):
            return f"has box {summary(box)}, which does not fit in shape {shape}"
        span = math.prod(box["sizes"])
    if not (_ints([start, end]) and start <= end <= span):
        return f"covers [{summary(start)}, {summary(end)}), not a range inside its {span} elements"
    if "key" in e and not isinstance(e["key"], str):
        return f"has key {summary(e['key'])}, not a string"
    if pending:
        return None
    if held is None:
        return "has no tensor in the shard file"
    numel, dtype = held
    if numel != end - start:
        return f"covers [{start}, {end}) but its tensor holds {numel} elements"
    if str(dtype).removeprefix("torch.") != e["dtype"]:
        return f"is {e['dtype']} but its tensor is {str(dtype).removeprefix('torch.')}"
    return None


def check_entries(shard: ShardedState, where: str) -> None:
    """A :class:`CheckpointError` naming ``where`` and the entry when a shard's ``entries`` or
    ``scalars`` metadata is not sound (types, shapes, ranges, dtypes, and each entry's tensor): checked
    before any full tensor is assembled, so a crafted shape cannot make a loader allocate."""
    md = shard.metadata
    if not isinstance(md, dict):
        raise CheckpointError(f"{where}: shard metadata {summary(md)} is not an object")
    entries, scalars = md.get("entries", {}), md.get("scalars", {})
    if not isinstance(entries, dict) or not isinstance(scalars, dict):
        raise CheckpointError(f"{where}: shard metadata's entries/scalars are not objects")
    lazy = shard.tensors if isinstance(shard.tensors, LazyTensors) else None
    for store, e in entries.items():
        pending = lazy is not None and lazy.pending(store)
        problem = _entry_problem(e, None if pending else tensor_info(shard.tensors, store), pending)
        if problem is not None:
            raise CheckpointError(f"{where} is corrupted: entry {summary(store)} {problem}")
    for key, s in scalars.items():
        dtype = s.get("dtype") if isinstance(s, dict) else None
        ok = isinstance(s, dict) and (dtype is None or (isinstance(dtype, str) and dtype in DTYPES))
        value = s.get("value") if isinstance(s, dict) else None
        if not ok or not isinstance(value, int | float) or not math.isfinite(value) or abs(value) >= 2**63:
            raise CheckpointError(
                f"{where} is corrupted: scalar {summary(key)} is {summary(s)}, expected "
                "{value: a number, dtype: null or a dtype name}"
            )
