"""Per-step statistics of a compressed reducer: density, bytes, compression ratio, time split.

A metric with no sample is absent from the dict, never NaN: ``compression_ratio`` only when this
rank sent bytes, ``density`` only when every reduced buffer knows its global selection, ``variant``
only when an algorithm ran in its reduced form under reduce-scatter semantics (Ok-Topk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepStatistics"]


@dataclass
class StepStatistics:
    """Accumulates the calls of one step; :meth:`as_dict` reports them."""

    algorithm: str
    #: the compressor's ``reduce_scatter_variant``: reported when a compressed reduce-scatter ran
    reduce_scatter_variant: str | None = None
    #: the compressor's dense warm-up: this many reductions of each buffer are dense before compression
    warmup_steps: int = 0
    calls: int = 0
    numel: int = 0
    local_selected: int = 0
    global_selected: int = 0
    global_known: bool = True
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    select_seconds: float = 0.0
    comm_seconds: float = 0.0
    dense_calls: int = 0
    reduce_scatter_calls: int = 0
    compressed_reduce_scatter_calls: int = 0
    nonfinite_values: int = 0
    nonfinite_keys: list[str] = field(default_factory=list)

    def add(
        self,
        *,
        numel: int,
        local_selected: int,
        global_selected: int | None,
        bytes_sent: int,
        bytes_received: int,
        dense_bytes: int,
        select_seconds: float,
        total_seconds: float,
        dense: bool,
        sharded: bool = False,
    ) -> None:
        self.calls += 1
        self.numel += numel
        self.local_selected += local_selected
        if global_selected is None:
            self.global_known = False
        else:
            self.global_selected += global_selected
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received
        self.dense_bytes += dense_bytes
        self.select_seconds += select_seconds
        self.comm_seconds += max(0.0, total_seconds - select_seconds)
        self.dense_calls += int(dense)
        self.reduce_scatter_calls += int(sharded)
        self.compressed_reduce_scatter_calls += int(sharded and not dense)

    def as_dict(self) -> dict[str, Any]:
        if self.calls == 0 and not self.nonfinite_keys:
            return {}
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "calls": self.calls,
            "numel": self.numel,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "dense_bytes": self.dense_bytes,
            "select_seconds": self.select_seconds,
            "comm_seconds": self.comm_seconds,
            "dense_calls": self.dense_calls,
            "dense_warmup_steps": self.warmup_steps,
            "reduce_scatter_calls": self.reduce_scatter_calls,
            "nonfinite_values": self.nonfinite_values,
        }
        if self.numel > 0:
            out["local_density"] = self.local_selected / self.numel
            if self.global_known:
                out["density"] = self.global_selected / self.numel
        if self.bytes_sent > 0:
            out["compression_ratio"] = self.dense_bytes / self.bytes_sent
        if self.nonfinite_keys:
            out["nonfinite_keys"] = list(self.nonfinite_keys)
        if self.warmup_steps and self.calls and self.dense_calls == self.calls:
            out["warmup"] = f"dense warm-up: compression starts after {self.warmup_steps} dense steps"
        if self.reduce_scatter_variant and self.compressed_reduce_scatter_calls:
            out["variant"] = self.reduce_scatter_variant
        return out
