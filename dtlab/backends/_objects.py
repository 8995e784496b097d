"""``broadcast_object`` and ``all_gather_object`` of :class:`~dtlab.backends.base.CommunicationBackend`
(a part of it): pickled objects over the engine's tensor operations, bytes counted like every operation."""

from __future__ import annotations

import pickle
from time import perf_counter
from typing import Any

import torch

from dtlab.backends._engine import Engine

__all__ = ["ObjectExchange"]


class ObjectExchange(Engine):
    """Object exchange; an engine may replace the ``_broadcast_object``/``_all_gather_object`` defaults."""

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (pickled; only exchange trusted objects)."""
        src = self._check_root(src, "broadcast_object", "src")
        if self._checked:
            self._agree(("broadcast_object", src))
        t0 = perf_counter()
        result, nbytes = self._broadcast_object(obj, src)
        dt = perf_counter() - t0
        p = self.world_size
        sent = nbytes if (p > 1 and self.rank != (src - 1) % p) else 0
        received = nbytes if (p > 1 and self.rank != src) else 0
        self._stats.record("broadcast_object", sent, received, dt)
        return result

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj`` in rank order."""
        if self._checked:
            self._agree(("all_gather_object",))
        t0 = perf_counter()
        result, sizes = self._all_gather_object(obj)
        dt = perf_counter() - t0
        sent, received = self._all_gather_v_bytes(sizes, 1)  # the pickles travel by all_gather_v
        self._stats.record("all_gather_object", sent, received, dt)
        return result

    # ------------------------------------------------------------------ engine defaults
    def _broadcast_object(self, obj: Any, src: int) -> tuple[Any, int]:
        """Default: pickle to a byte tensor, broadcast its size then its bytes."""
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(buf, src)
        result = obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())
        return result, int(size.item())

    def _all_gather_object(self, obj: Any) -> tuple[list[Any], list[int]]:
        """Default: pickle to a byte tensor and use the variable-sized all-gather."""
        payload = pickle.dumps(obj)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        flat, counts = self._all_gather_v(buf)
        data = flat.cpu().numpy().tobytes()
        out: list[Any] = []
        offset = 0
        for c in counts:
            out.append(pickle.loads(data[offset : offset + c]))
            offset += c
        return out, counts
