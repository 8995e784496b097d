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

__all__ = ["RandomK"]


@dataclass(frozen=True, kw_only=True)
class RandomK(SparseCompressor):
    """Random-k sparsification with indices shared through a common seed."""

    name: ClassVar[str] = "randomk"
    seed: int = 0

    def new_state(self, key: str, numel: int) -> dict[str, Any]:
        return {"t": 0, "key_hash": zlib.crc32(key.encode())}

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        n, k = acc.numel(), self.k(acc.numel())
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + state["key_hash"]) * 65_537 + state["t"])
        state["t"] += 1
        if k == n:
            idx = torch.arange(n)
        else:  # sorted k distinct indices without an n-sized permutation
            draw = torch.randint(0, n, (k + k // 8 + 16,), generator=gen)
            idx = torch.unique(draw)[:k]
        idx = idx.to(acc.device)
        vals = acc[idx].contiguous()
        select_s = time.perf_counter() - t0
        if backend.world_size > 1:
            backend.all_reduce(vals, ReduceOp.SUM)
        return Exchange.sparse(idx, vals.div_(backend.world_size), idx, idx.numel(), idx.numel(), select_s)
