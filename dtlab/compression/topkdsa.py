"""``TopkDSA``: sparse reduce over equal regions, then an all-gather of the union (SparCML's DSA).

Every rank selects its exact local top-k and sends each entry to the owner of its equal region
(``numel / P`` elements); owners sum what they receive. The gather phase moves the union of the
reduced entries with ``all_gather_v``, or, when the union is so dense that index-value pairs would
cost more than the values themselves (``2 * union >= numel``), a dense all-gather of the regions.
The result is exactly the average over ranks of every rank's local top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression.base import Exchange
from dtlab.compression.sparse import (
    LocalTopk,
    all_gather_counts,
    local_topk,
    pack,
    split_and_reduce,
    unpack,
)

__all__ = ["TopkDSA"]


def equal_bounds(n: int, p: int) -> list[int]:
    return [n * j // p for j in range(p + 1)]


@dataclass(frozen=True, kw_only=True)
class TopkDSA(LocalTopk):
    """Local top-k, sparse split-and-reduce over equal regions, sparse-or-dense all-gather."""

    name: ClassVar[str] = "topkdsa"

    def _reduce(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float]:
        t0 = time.perf_counter()
        idx, _ = local_topk(acc, self.k(acc.numel()), state["work"])
        select_s = time.perf_counter() - t0
        bounds = equal_bounds(acc.numel(), backend.world_size)
        ridx, rvals = split_and_reduce(backend, acc, idx, bounds)
        return idx, ridx, rvals, bounds, select_s

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p, me, n = backend.world_size, backend.rank, acc.numel()
        idx, ridx, rvals, bounds, select_s = self._reduce(state, acc, backend)
        union = int(all_gather_counts(backend, [ridx.numel()]).sum()) if p > 1 else ridx.numel()
        if 2 * union >= n:  # dense fallback: the regions as values, padded to equal size
            result = torch.empty(n, dtype=torch.float32, device=acc.device)
            width = -(-n // p)
            region = torch.zeros(width, dtype=torch.float32, device=acc.device)
            region[ridx] = rvals
            out = torch.empty(width * p, dtype=torch.float32, device=acc.device)
            backend.all_gather(out, region)
            for j in range(p):
                result[bounds[j] : bounds[j + 1]] = out[j * width : j * width + bounds[j + 1] - bounds[j]]
            return Exchange(result.div_(p), None, idx.numel(), union, select_s, sent=idx)
        flat, _ = backend.all_gather_v(pack(ridx + bounds[me], rvals))
        gidx, gvals = unpack(flat)
        return Exchange.sparse(gidx, gvals.div_(p), idx, idx.numel(), union, select_s)

    def reduce_scatter(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> Exchange:
        """The regions are the strategy's equal shards: each owner keeps its reduced shard."""
        p = backend.world_size
        idx, ridx, rvals, _bounds, select_s = self._reduce(state, acc, backend)
        return Exchange.sparse(ridx, rvals.div_(p), idx, idx.numel(), None, select_s)
