"""``Cast``: gradients travel in float16 or bfloat16 (torch DDP's fp16/bf16 compress hooks).

Each rank divides by ``P`` first (so the low-precision sum cannot overflow where the average does
not), casts, and the all-reduce (or reduce-scatter) sums in that dtype; the result is cast back.
With error feedback the rounding error of this rank's cast is kept for the next step; the rounding
of the sum itself is not recoverable and is not counted as anyone's contribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Compressor, Exchange
from dtlab.errors import ConfigError

__all__ = ["BF16", "Cast", "FP16"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class Cast(Compressor):
    """Communicate in ``dtype`` (``"float16"`` or ``"bfloat16"``)."""

    name: ClassVar[str] = "cast"
    dtype: str = "float16"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in _DTYPES:
            raise ConfigError(f"Cast: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    def _cast(self, acc: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        t0 = time.perf_counter()
        low = (acc / p).to(_DTYPES[self.dtype])
        contributed = low.to(torch.float32) * p
        return low, contributed, time.perf_counter() - t0

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        low, contributed, select_s = self._cast(acc, backend.world_size)
        backend.all_reduce(low, ReduceOp.SUM)
        return Exchange(low.to(torch.float32), contributed, acc.numel(), acc.numel(), select_s)

    def reduce_scatter(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> Exchange:
        low, contributed, select_s = self._cast(acc, backend.world_size)
        out = torch.empty(acc.numel() // backend.world_size, dtype=low.dtype, device=acc.device)
        backend.reduce_scatter(out, low, ReduceOp.SUM)
        return Exchange(out.to(torch.float32), contributed, acc.numel(), None, select_s)


def FP16(**kw: Any) -> Cast:
    """``Cast(dtype="float16")``."""
    return Cast(dtype="float16", **kw)


def BF16(**kw: Any) -> Cast:
    """``Cast(dtype="bfloat16")``."""
    return Cast(dtype="bfloat16", **kw)
