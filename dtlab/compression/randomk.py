"""``RandomK``: the same ``k`` random indices on every rank (shared seed), all-reduced as k values.

Indices are drawn from a generator seeded by ``seed``, the buffer's key and the iteration, so all
ranks draw the same ones without communicating; only the ``k`` values travel (a dense all-reduce of
``k`` floats). Unselected values stay in the error-feedback residual.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Exchange, SparseCompressor

__all__ = ["RandomK", "uniform_subset"]


def uniform_subset(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices of ``[0, n)``, sorted, every ``k``-subset equally likely.

    Sparse draws (``4k < n``) avoid an ``n``-sized permutation: the distinct values of ``~1.125 k``
    uniform draws form a uniform random subset, and a random ``k`` of them stay (never the ``k``
    smallest, which would starve the end of the buffer). Dense draws, or a short draw, permute.
    """
    if 4 * k < n:
        uniq = torch.unique(torch.randint(0, n, (k + k // 8 + 16,), generator=gen))
        if uniq.numel() >= k:
            return torch.sort(uniq[torch.randperm(uniq.numel(), generator=gen)[:k]]).values
    return torch.sort(torch.randperm(n, generator=gen)[:k]).values


@dataclass(frozen=True, kw_only=True)
class RandomK(SparseCompressor):
    """Random-k sparsification with indices shared through a common seed."""

    name: ClassVar[str] = "randomk"
    seed: int = 0

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return {"t": 0, "key_hash": zlib.crc32(key.encode())}

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        n, k = acc.numel(), self.k(acc.numel())
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + state["key_hash"]) * 65_537 + state["t"])
        state["t"] += 1
        idx = uniform_subset(n, k, gen).to(acc.device)
        vals = acc.index_select(0, idx)
        select_s = time.perf_counter() - t0
        if backend.world_size > 1:
            backend.all_reduce(vals, ReduceOp.SUM)
        return Exchange.sparse(idx, vals.div_(backend.world_size), idx, idx.numel(), idx.numel(), select_s)
