"""``QSGD``: stochastic quantization to ``levels`` levels per bucket (Alistarh et al., 2017).

Each bucket of ``bucket_size`` values is sent as its L2 norm (float32) and one int8 per value,
``sign * floor(|v| / norm * levels + u)`` with ``u ~ U[0, 1)`` (unbiased). The int8 codes and norms
travel by all-gather and every rank dequantizes and sums all ranks' codes in rank order (identical
results on every rank). Per rank: ``(P-1) * (n + 4 n / bucket_size)`` bytes instead of the dense
``8 (P-1) n / P``: smaller up to ``P = 8``. With error feedback the quantization error is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression.base import Compressor, Exchange
from dtlab.errors import ConfigError

__all__ = ["QSGD"]


@dataclass(frozen=True, kw_only=True)
class QSGD(Compressor):
    """Stochastic int8 quantization with per-bucket norms, exchanged by all-gather."""

    name: ClassVar[str] = "qsgd"
    levels: int = 127
    bucket_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or not 1 <= self.levels <= 127:
            raise ConfigError(
                f"QSGD: levels must be an integer in [1, 127] (int8 codes), got {self.levels!r}"
            )
        if (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size < 1
        ):
            raise ConfigError(f"QSGD: bucket_size must be an integer >= 1, got {self.bucket_size!r}")

    def new_state(self, key: str, numel: int) -> dict[str, Any]:
        return {"t": 0}

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p, me, n, b = backend.world_size, backend.rank, acc.numel(), self.bucket_size
        dev = acc.device
        t0 = time.perf_counter()
        nb = -(-n // b)
        padded = torch.zeros(nb * b, dtype=torch.float32, device=dev)
        padded[:n] = acc
        buckets = padded.view(nb, b)
        norms = torch.linalg.vector_norm(buckets, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + me * 65_537 + state["t"])
        state["t"] += 1
        noise = torch.rand(buckets.shape, generator=gen).to(dev)
        levels = torch.floor(buckets.abs() / safe[:, None] * self.levels + noise).clamp_(max=self.levels)
        codes = (torch.sign(buckets) * levels).to(torch.int8).view(-1)
        select_s = time.perf_counter() - t0

        def decode(c: torch.Tensor, nrm: torch.Tensor) -> torch.Tensor:
            return (c.view(nb, b).to(torch.float32) * (nrm[:, None] / self.levels)).view(-1)[:n]

        contributed = decode(codes, norms)
        all_codes = torch.empty(p * nb * b, dtype=torch.int8, device=dev)
        all_norms = torch.empty(p * nb, dtype=torch.float32, device=dev)
        backend.all_gather(all_codes, codes)
        backend.all_gather(all_norms, norms.contiguous())
        result = torch.zeros(n, dtype=torch.float32, device=dev)
        for r in range(p):
            result += decode(all_codes[r * nb * b : (r + 1) * nb * b], all_norms[r * nb : (r + 1) * nb])
        result.div_(p)
        sent = int(torch.count_nonzero(codes))
        return Exchange(result, contributed, sent, int(torch.count_nonzero(result)), select_s)
