"""Compression state across a change of the data-parallel world size (an elastic resize, a resume on
more or fewer ranks): each new rank gets the mean of the old ranks' residuals and velocities.

What error feedback still owes the model is the old ranks' residuals summed and divided by the old
world size ``P`` (the synchronized update is a mean); momentum correction's velocity is likewise the
mean of the ranks' velocities. Giving each of the ``P'`` new ranks that mean keeps both: the mean over
the new ranks is the old mean. With a dense exchange under momentum correction the run then continues
as momentum SGD with its momentum intact. Iteration counts (warm-up) carry over; the compressors' own
state (thresholds, factors, generators) is per rank and starts afresh. Only for a world that is one
data-parallel group, saved by one (``dp_world_size`` in the saved metadata; on a mesh each rank's
buffers are its own slices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dtlab.core.state import LazyTensors, ShardedState

__all__ = ["averaged_state"]

#: the reducer's tensor name prefixes averaged over the old ranks
_AVERAGED = ("residual.", "velocity.")


def averaged_state(
    shards: Sequence[ShardedState],
    prefix: str,
    saved: Sequence[Mapping[str, Any]],
    sizes: Mapping[str, tuple[int, int]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | str:
    """``(tensors, metadata)`` for the reducer's ``load_state_dict`` (residuals and velocities averaged
    over the old ranks, every buffer's size and iteration count), or why that cannot be done.
    ``sizes``: ``{buffer key: (elements, elements with the padding to a multiple of the world size)}``
    of this run's buffers: a saved buffer holding those elements is refitted to the new padding."""
    n = len(shards)
    if any(m.get("dp_world_size") != n for m in saved):
        return "it was not written by one data-parallel group (a mesh, or a checkpoint without that record)"
    sums: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name in list(shard.tensors):  # the averaged tensors only are read
            key = name[len(prefix) :] if name.startswith(prefix) else ""
            if not key.startswith(_AVERAGED):
                continue
            t = shard.tensors.fresh(name) if isinstance(shard.tensors, LazyTensors) else shard.tensors[name]
            flat = t.detach().to(torch.float32).reshape(-1)  # a lazy one read, not held
            held = sums.get(key)
            if held is not None and held.numel() != flat.numel():
                return f"buffer {key!r} has {held.numel()} elements on one rank and {flat.numel()} on another"
            sums[key] = flat.clone() if held is None else held.add_(flat)
    buffers = saved[0].get("buffers", {})
    if not isinstance(buffers, dict):
        return f"its 'buffers' record is {type(buffers).__name__}, not a JSON object"
    meta: dict[str, Any] = {
        "buffers": {
            key: {
                "numel": _fit_numel(key, info.get("numel"), sizes),
                "iterations": info.get("iterations"),
                "state": {},
            }
            for key, info in buffers.items()
            if isinstance(info, dict)
        }
    }
    out = {}
    for name, total in sums.items():
        key = name.split(".", 1)[1]
        real, padded = sizes.get(key, (-1, -1))
        if 0 <= real <= total.numel() and padded != total.numel():  # only the padding differs
            total = torch.cat([total[:real], total.new_zeros(padded - real)])
        out[name] = total.div_(n)
    return out, meta


def _fit_numel(key: str, numel: Any, sizes: Mapping[str, tuple[int, int]]) -> Any:
    real, padded = sizes.get(key, (-1, -1))
    return padded if isinstance(numel, int) and 0 <= real <= numel else numel
