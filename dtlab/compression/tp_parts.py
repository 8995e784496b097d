"""One buffer compressed as two under tensor parallelism.

On a mesh with tp > 1 each tp rank's data-parallel buffers hold its own tp shards beside the parameters
every tp rank holds whole, whose gradient is the same on every tp rank and must stay so. A compressor
that selects or rounds over a whole buffer (top-k, QSGD) would treat those elements differently on each
tp rank, because the rest of the buffer differs. :class:`TpParts` cuts such a buffer into the elements
of the whole parameters (``key + WHOLE``: the same input on every tp rank, so every tp rank of a dp
position makes the same selection from the same dp exchange) and the rest (``key + OWN``), each
compressed as a buffer of its own with its own error-feedback residual and compressor state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from dtlab.compression.base import Layout
from dtlab.errors import ConfigError

__all__ = ["OWN", "WHOLE", "TpParts"]

#: the suffixes of the two parts' keys
WHOLE, OWN = ".tp_whole", ".tp_own"

Ranges = Sequence[tuple[int, int]]


class TpParts:
    """``ranges``: per buffer key, the ``(offset, numel)`` of each parameter in it whose gradient is the
    same on every tp rank (ascending, disjoint); a key absent, or with no range, is compressed whole."""

    def __init__(self, ranges: Mapping[str, Ranges] | None = None) -> None:
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for key, rs in (ranges or {}).items():
            at = 0
            for off, num in rs:
                if off < at or num < 0:
                    raise ConfigError(
                        f"tp_whole[{key!r}]: the (offset, numel) ranges must be ascending and disjoint, "
                        f"got {list(rs)!r}"
                    )
                at = off + num
            if any(num for _, num in rs):
                self.ranges[key] = [(off, num) for off, num in rs if num]
        self._index: dict[tuple[str, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def split(self, key: str, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The element indices of buffer ``key`` (``n`` elements) in its whole part and in its own
        part, or None when the buffer is not cut (no whole parameter in it, or nothing else)."""
        rs = self.ranges.get(key)
        if rs is None or rs[-1][0] + rs[-1][1] > n:
            return None
        cached = self._index.get((key, n, device))
        if cached is None:
            mask = torch.zeros(n, dtype=torch.bool)
            for off, num in rs:
                mask[off : off + num] = True
            if bool(mask.all()):
                return None
            whole, own = mask.nonzero().view(-1), (~mask).nonzero().view(-1)
            cached = self._index[(key, n, device)] = (whole.to(device), own.to(device))
        return cached

    def other_layout(self, keys: Iterable[str]) -> list[str]:
        """The ``keys`` (of restored state) this cut never reduces: a buffer it cuts, saved whole (before
        the cut, or at tp = 1), or a part of a buffer it does not cut (saved on another mesh)."""
        out = []
        for key in keys:
            base = next((key[: -len(s)] for s in (WHOLE, OWN) if key.endswith(s)), None)
            if key in self.ranges or (base is not None and base not in self.ranges):
                out.append(key)
        return out

    def layouts(self, key: str, layout: Layout) -> tuple[Layout, Layout]:
        """Buffer ``key``'s ``(offset, shape)`` layout as the two parts' layouts: each parameter at its
        offset in the part that holds it (PowerSGD then compresses each matrix on its own there too)."""
        starts = {off for off, _ in self.ranges.get(key, [])}
        whole: list[tuple[int, tuple[int, ...]]] = []
        own: list[tuple[int, tuple[int, ...]]] = []
        before = 0  # elements of the whole part before this parameter
        for off, shape in layout:
            numel = 1
            for d in shape:
                numel *= d
            if off in starts:
                whole.append((before, shape))
                before += numel
            else:
                own.append((off - before, shape))
        return whole, own
