"""``Dense``: the uncompressed baseline (a plain all-reduce or reduce-scatter, no error feedback)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression.base import Compressor, Exchange, dense_exchange

__all__ = ["Dense"]


@dataclass(frozen=True, kw_only=True)
class Dense(Compressor):
    """Every element travels; through a compressed reducer it reproduces the dense reducer bit for bit."""

    name: ClassVar[str] = "dense"
    error_feedback: bool = False

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return dense_exchange(acc, backend, shard=False)

    def reduce_scatter(
        self,
        state: dict[str, Any],  # noqa: ARG002 - the Compressor interface; dense keeps no state
        acc: torch.Tensor,
        backend: CommunicationBackend,
    ) -> Exchange:
        return dense_exchange(acc, backend, shard=True)
