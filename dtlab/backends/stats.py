"""Per-rank communication counters: calls, bytes sent and bytes received per kind of operation."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(slots=True)
class OpStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class CommStats:
    """Counters of one backend (one rank). A sub-group's counters also feed its parent's."""

    def __init__(self, parent: CommStats | None = None) -> None:
        self._ops: dict[str, OpStats] = {}
        self._parent = parent
        self._lock = threading.Lock()

    def record(self, kind: str, sent: int, received: int, seconds: float = 0.0) -> None:
        """Count one call of ``kind`` (on every call of every operation: kept to a few attribute adds)."""
        with self._lock:
            s = self._ops.get(kind)
            if s is None:
                s = self._ops[kind] = OpStats()
            s.calls += 1
            s.bytes_sent += sent
            s.bytes_received += received
            s.seconds += seconds
        if self._parent is not None:
            self._parent.record(kind, sent, received, seconds)

    def __getitem__(self, kind: str) -> OpStats:
        with self._lock:
            s = self._ops.get(kind, OpStats())
            return OpStats(s.calls, s.bytes_sent, s.bytes_received, s.seconds)

    def __contains__(self, kind: str) -> bool:
        return kind in self._ops

    def kinds(self) -> list[str]:
        with self._lock:
            return sorted(self._ops)

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(s.bytes_sent for s in self._ops.values())

    @property
    def bytes_received(self) -> int:
        with self._lock:
            return sum(s.bytes_received for s in self._ops.values())

    @property
    def seconds(self) -> float:
        """Wall time spent inside communication calls (for non-blocking calls: until they returned)."""
        with self._lock:
            return sum(s.seconds for s in self._ops.values())

    @property
    def calls(self) -> int:
        with self._lock:
            return sum(s.calls for s in self._ops.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict copy: ``{kind: {"calls", "bytes_sent", "bytes_received"}}`` (no timings)."""
        with self._lock:
            return {
                k: {"calls": s.calls, "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received}
                for k, s in sorted(self._ops.items())
            }

    def reset(self) -> None:
        """Zero this backend's counters (a parent's counters are left as they are)."""
        with self._lock:
            self._ops.clear()

    def __repr__(self) -> str:
        return f"CommStats(sent={self.bytes_sent}, received={self.bytes_received}, ops={self.snapshot()})"
