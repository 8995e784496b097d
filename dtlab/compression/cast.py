"""``Cast``: gradients travel in float16 or bfloat16 (torch DDP's fp16/bf16 compress hooks).

Each rank divides by ``P`` first (so the low-precision sum cannot overflow where the average does
not), casts, and the all-reduce (or reduce-scatter) sums in that dtype; the result is cast back when it is
written into the gradient. With error feedback the rounding error of this rank's cast is kept for
the next step (computed in the same pass as the cast); the rounding of the sum itself is not
recoverable and is not counted as anyone's contribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Compressor, Exchange
from dtlab.compression.kernels import cast_with_residual
from dtlab.compression.state_io import Buffers
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

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        return {"buffers": Buffers()}

    def _cast(self, state: dict[str, Any], acc: torch.Tensor, p: int) -> tuple[torch.Tensor, float]:
        """``acc / p`` in the low dtype; ``acc`` becomes the rounding error (the residual), same pass."""
        t0 = time.perf_counter()
        low = state["buffers"].get("low", acc.numel(), _DTYPES[self.dtype], acc.device)
        cast_with_residual(acc, p, low)
        return low, time.perf_counter() - t0

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        n = acc.numel()
        low, select_s = self._cast(state, acc, backend.world_size)
        backend.all_reduce(low, ReduceOp.SUM)
        return Exchange(low, None, n, n, select_s, residual_in_place=True)

    def reduce_scatter(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> Exchange:
        n = acc.numel()
        low, select_s = self._cast(state, acc, backend.world_size)
        out = state["buffers"].get("shard", n // backend.world_size, low.dtype, acc.device)
        backend.reduce_scatter(out, low, ReduceOp.SUM)
        return Exchange(out, None, n, None, select_s, residual_in_place=True)


def FP16(**kw: Any) -> Cast:
    """``Cast(dtype="float16")``."""
    return Cast(dtype="float16", **kw)


def BF16(**kw: Any) -> Cast:
    """``Cast(dtype="bfloat16")``."""
    return Cast(dtype="bfloat16", **kw)
