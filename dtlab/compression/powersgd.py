"""``PowerSGD``: rank-``rank`` approximation by one power iteration per step (Vogels et al., 2019).

A flat buffer of ``n`` elements is viewed as a ``rows x cols`` matrix ``M`` (``rows = floor(sqrt(n))``,
zero-padded): reducers see flat buckets, not parameter shapes, so the matrix is a view of the
bucket, not of a layer. Per step: ``P = M Q`` (``Q`` warm-started from the previous step, initialised
from a seed shared by all ranks), all-reduce ``P``, orthonormalise it, ``Q = M^T P``, all-reduce ``Q``;
the average is ``P Q^T / world_size``. A rank's contribution is ``P (M^T P)^T``; with error feedback
the rest stays in its residual.

Skip rule: when ``rank * (rows + cols) >= n`` the factors would not be smaller than the buffer and it
is all-reduced dense. ``warmup_steps`` (default 10) dense iterations come first, as in torch's
``start_powerSGD_iter``.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Compressor, Exchange, dense_exchange
from dtlab.errors import ConfigError

__all__ = ["PowerSGD"]


def matrix_shape(n: int) -> tuple[int, int]:
    rows = max(1, math.isqrt(n))
    return rows, -(-n // rows)


@dataclass(frozen=True, kw_only=True)
class PowerSGD(Compressor):
    """Low-rank compression with warm start, error feedback and a skip rule for small buffers."""

    name: ClassVar[str] = "powersgd"
    rank: int = 4
    warmup_steps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"PowerSGD: rank must be an integer >= 1, got {self.rank!r}")

    def compresses(self, n: int) -> bool:
        rows, cols = matrix_shape(n)
        return self.rank * (rows + cols) < n

    def new_state(self, key: str, numel: int) -> dict[str, Any]:
        return {"q": None, "key_hash": zlib.crc32(key.encode())}

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        n, p = acc.numel(), backend.world_size
        if not self.compresses(n):
            return dense_exchange(acc, backend, shard=False)
        rows, cols = matrix_shape(n)
        r = min(self.rank, rows, cols)
        t0 = time.perf_counter()
        m = torch.zeros(rows * cols, dtype=torch.float32, device=acc.device)
        m[:n] = acc
        m = m.view(rows, cols)
        if state["q"] is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + state["key_hash"])
            state["q"] = torch.randn(cols, r, generator=gen).to(acc.device)
        pm = (m @ state["q"]).contiguous()
        select_s = time.perf_counter() - t0
        backend.all_reduce(pm, ReduceOp.SUM)
        t1 = time.perf_counter()
        pm = torch.linalg.qr(pm).Q.contiguous()
        q_local = (m.t() @ pm).contiguous()
        contributed = (pm @ q_local.t()).reshape(-1)[:n].clone()
        select_s += time.perf_counter() - t1
        q_sum = q_local.clone()
        backend.all_reduce(q_sum, ReduceOp.SUM)
        state["q"] = q_sum
        result = (pm @ q_sum.t()).reshape(-1)[:n].div_(p)
        return Exchange(result, contributed, r * (rows + cols), None, select_s)
