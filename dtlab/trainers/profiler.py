"""``Profiler``: where step time goes — compute per phase vs communication per kind of operation.

Each phase is timed on the wall clock; the communication seconds the backend recorded during the phase
(``backend.stats``, per operation kind) are subtracted, so ``compute`` is the phase's time outside
collectives. On the in-memory backend, time waiting for a slower rank counts as communication.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from dtlab.backends.stats import CommStats
from dtlab.errors import ArgumentTypeError

__all__ = ["Profiler"]


class Profiler:
    def __init__(self, stats: CommStats) -> None:
        if not isinstance(stats, CommStats):
            raise ArgumentTypeError(
                f"Profiler: stats must be a backend's CommStats (backend.stats), got {stats!r} "
                f"({type(stats).__name__})"
            )
        self.stats = stats
        self.compute: dict[str, float] = defaultdict(float)
        self.comm: dict[str, float] = defaultdict(float)
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self.wall = 0.0

    def _comm_snapshot(self) -> dict[str, tuple[float, int]]:
        out = {}
        for kind in self.stats.kinds():
            s = self.stats[kind]
            out[kind] = (s.seconds, s.bytes_sent)
        return out

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = self._comm_snapshot()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            comm_dt = 0.0
            for kind, (sec, sent) in self._comm_snapshot().items():
                s0, b0 = before.get(kind, (0.0, 0))
                self.comm[kind] += sec - s0
                self.comm_bytes[kind] += sent - b0
                comm_dt += sec - s0
            self.compute[name] += max(0.0, dt - comm_dt)
            self.wall += dt

    def summary(self) -> dict[str, Any]:
        total = self.wall or 1.0
        rows = {f"compute/{k}": v for k, v in self.compute.items()}
        rows.update({f"comm/{k}": v for k, v in self.comm.items() if v > 0 or self.comm_bytes[k] > 0})
        return {
            "wall_seconds": self.wall,
            "compute_seconds": sum(self.compute.values()),
            "comm_seconds": sum(self.comm.values()),
            "phases": {k: {"seconds": v, "fraction": v / total} for k, v in sorted(rows.items())},
            "comm_bytes_sent": dict(sorted(self.comm_bytes.items())),
        }

    def table(self) -> str:
        return self.table_from_summary(self.summary())

    @staticmethod
    def table_from_summary(s: dict[str, Any]) -> str:
        lines = [f"{'where step time goes':<28}{'seconds':>10}{'share':>8}"]
        for name, row in sorted(s["phases"].items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(f"{name:<28}{row['seconds']:>10.3f}{100 * row['fraction']:>7.1f}%")
        lines.append(f"{'total':<28}{s['wall_seconds']:>10.3f}{100.0:>7.1f}%")
        return "\n".join(lines)
