"""``QSGD``: stochastic quantization to ``levels`` levels per bucket (Alistarh et al., 2017).

Each bucket of ``bucket_size`` values is sent as its L2 norm (float32) and one int8 per value,
``sign * floor(|v| / norm * levels + u)`` with ``u ~ U[0, 1)`` (unbiased; ``u`` from a counter-based
hash of the element's position and a per-call key drawn from ``seed``, the rank and the iteration, so
quantization is one pass: :mod:`dtlab.compression.kernels`). The int8 codes and norms
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
from dtlab.compression.kernels import qsgd_decode_mean, qsgd_encode, qsgd_noise_key
from dtlab.compression.state_io import Buffers
from dtlab.errors import ConfigError, integer

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
        levels, bucket = integer(self.levels), integer(self.bucket_size)
        if levels is None or not 1 <= levels <= 127:
            raise ConfigError(
                f"QSGD: levels must be an integer in [1, 127] (int8 codes), got {self.levels!r}"
            )
        if bucket is None or bucket < 1:
            raise ConfigError(f"QSGD: bucket_size must be an integer >= 1, got {self.bucket_size!r}")
        object.__setattr__(self, "levels", levels)  # NumPy integers as Python ones
        object.__setattr__(self, "bucket_size", bucket)

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return {"t": 0, "buffers": Buffers()}

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        p, me, n, b = backend.world_size, backend.rank, acc.numel(), self.bucket_size
        dev = acc.device
        t0 = time.perf_counter()
        nb, full = -(-n // b), n // b
        bufs: Buffers = state["buffers"]
        norms = bufs.get("norms", nb, torch.float32, dev)
        torch.linalg.vector_norm(acc[: full * b].view(full, b), dim=1, out=norms[:full])
        if nb > full:  # the last bucket, zero-padded: its norm is the norm of what it holds
            norms[full] = torch.linalg.vector_norm(acc[full * b :])
        key = qsgd_noise_key(self.seed * 1_000_003 + me * 65_537 + state["t"])
        state["t"] += 1
        codes = bufs.get("codes", nb * b, torch.int8, dev)
        sent = qsgd_encode(acc, b, norms, self.levels, key, codes)  # acc becomes the residual
        select_s = time.perf_counter() - t0
        all_codes = bufs.get("all_codes", p * nb * b, torch.int8, dev)
        all_norms = bufs.get("all_norms", p * nb, torch.float32, dev)
        backend.all_gather(all_codes, codes)
        backend.all_gather(all_norms, norms)
        levels = self.levels

        def decode(out: torch.Tensor) -> int:  # straight into the gradient (Exchange.write)
            return qsgd_decode_mean(all_codes, all_norms, p, b, levels, out)

        return Exchange(None, None, sent, None, select_s, residual_in_place=True, writer=decode)
