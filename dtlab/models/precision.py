"""``MixedPrecisionPolicy``: the three dtypes of FSDP2's policy of that name."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DTYPES", "MixedPrecisionPolicy"]

#: config names of the floating-point dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: the compute dtype (``torch.autocast``; the parameters stay fp32 masters, what the
    optimizer steps); ``reduce_dtype``: the dtype every model strategy sends and sums gradients in (its
    ``reduce_dtype`` argument); ``output_dtype``: the dtype the loss sees. ``None`` leaves each as is."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    @classmethod
    def from_names(cls, precision: str, reduce_dtype: str | None = None) -> MixedPrecisionPolicy:
        """``train.precision`` (fp32, bf16, fp16) and ``strategy.reduce_dtype``: compute in
        ``precision`` (the loss sees the output as computed, as under ``torch.autocast``; the built-in
        losses work in float32); gradients travel in ``reduce_dtype`` (default: as computed)."""
        return cls(
            param_dtype=None if precision == "fp32" else DTYPES[precision],
            reduce_dtype=None if reduce_dtype is None else DTYPES[reduce_dtype],
        )

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """Compute in ``param_dtype`` inside the block (a no-op without one)."""
        if self.param_dtype is None or self.param_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.param_dtype)

    def cast_output(self, output: Any) -> Any:
        """The model's output in ``output_dtype`` (floating-point tensors only)."""
        if self.output_dtype is not None and isinstance(output, torch.Tensor) and output.is_floating_point():
            return output.to(self.output_dtype)
        return output
