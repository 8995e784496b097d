"""One region of a full tensor read from a checkpoint's pieces (:mod:`dtlab.core.shard_index`), reading
only the parts of the pieces it overlaps: a piece is a flat range of the full tensor or of a box of it,
held in memory or in a :class:`~dtlab.core.state.LazyTensors` whose file is read only where needed.

Where the region and a piece are ranges of the same box (of the full tensor: flat slices; the same tp
layout: the same box) the overlap is one flat range, read as such. Otherwise the two boxes' intersection
is walked in slabs of about :data:`CHUNK` elements along its first dimension, with the flat positions of
each slab's elements in the region and in the piece: what a reader holds at once is bounded by a slab,
not by the full tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dtlab.core.placement import Box
from dtlab.core.state import LazyTensors
from dtlab.errors import CheckpointError
from dtlab.untrusted import summary

__all__ = ["CHUNK", "Piece", "read_region"]

#: elements of a box intersection handled at a time
CHUNK = 1 << 20


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of ``box`` (``None``: the full tensor) flattened, stored in
    ``holder[store]`` (flat)."""

    box: Box | None
    start: int
    end: int
    holder: Mapping[str, torch.Tensor]
    store: str

    def part(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of what the piece stores (relative to ``start``)."""
        if isinstance(self.holder, LazyTensors):
            return self.holder.read(self.store, lo, hi)
        return self.holder[self.store].reshape(-1)[lo:hi]


def _stride0(box: Box) -> int:
    return math.prod(box.sizes[1:])


def _flat_index(inter: Box, within: Box) -> torch.Tensor:
    """Flat positions in ``within`` of the elements of ``inter`` (a box inside it), row-major."""
    idx = torch.zeros(inter.sizes, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(inter.sizes))):
        view = [1] * len(inter.sizes)
        view[d] = inter.sizes[d]
        idx += ((torch.arange(inter.sizes[d]) + (inter.offsets[d] - within.offsets[d])) * stride).view(view)
        stride *= within.sizes[d]
    return idx.reshape(-1)


def _corner(inter: Box, within: Box, last: bool) -> int:
    pos, stride = 0, 1
    for d in reversed(range(len(inter.sizes))):
        c = inter.offsets[d] + (inter.sizes[d] - 1 if last else 0) - within.offsets[d]
        pos += c * stride
        stride *= within.sizes[d]
    return pos


def _intersection(a: Box, b: Box) -> Box | None:
    lo = [max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True)))


def _copy_boxes(
    out: torch.Tensor, seen: torch.Tensor, want: Box, start: int, stop: int, piece: Piece, have: Box
) -> None:
    """Copy the elements of ``piece`` (of box ``have``) that lie in elements ``[start, stop)`` of ``want``."""
    inter = _intersection(want, have)
    if inter is None:
        return
    for ra, pa in ((want, (start, stop)), (have, (piece.start, piece.end))):
        if _corner(inter, ra, True) < pa[0] or _corner(inter, ra, False) >= pa[1]:
            return
    rows = max(1, CHUNK // max(_stride0(want), _stride0(have), 1)) if inter.sizes else 1
    first = inter.sizes[0] if inter.sizes else 1
    for r0 in range(0, first, rows):
        slab = inter
        if inter.sizes:
            n = min(rows, first - r0)
            slab = Box((inter.offsets[0] + r0, *inter.offsets[1:]), (n, *inter.sizes[1:]))
        ridx, pidx = _flat_index(slab, want), _flat_index(slab, have)
        keep = (ridx >= start) & (ridx < stop) & (pidx >= piece.start) & (pidx < piece.end)
        if not bool(keep.any()):
            continue
        ridx, pidx = ridx[keep] - start, pidx[keep] - piece.start
        if bool(seen[ridx].all()):
            continue
        lo, hi = int(pidx.min()), int(pidx.max()) + 1
        out[ridx] = piece.part(lo, hi)[pidx - lo]
        seen[ridx] = True


def read_region(
    key: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    pieces: Sequence[Piece],
    box: Box | None,
    start: int,
    stop: int,
) -> torch.Tensor:
    """Elements ``[start, stop)`` of ``box`` (``None``: the full tensor ``key`` of ``shape``) flattened,
    from ``pieces`` (which may overlap, as replicated state saved by each tp rank does: a piece whose
    overlap was read already from another is not read again); a :class:`CheckpointError` when they
    do not cover it."""
    full = Box((0,) * len(shape), tuple(int(s) for s in shape))
    want = full if box is None else box
    out = torch.empty(stop - start, dtype=dtype)
    seen = torch.zeros(stop - start, dtype=torch.bool)
    for piece in pieces:
        have = full if piece.box is None else piece.box
        if have == want:  # the same box: one flat range
            lo, hi = max(piece.start, start), min(piece.end, stop)
            if lo < hi and not bool(seen[lo - start : hi - start].all()):  # a copy already read: skipped
                out[lo - start : hi - start].copy_(piece.part(lo - piece.start, hi - piece.start))
                seen[lo - start : hi - start] = True
        else:
            _copy_boxes(out, seen, want, start, stop, piece, have)
    covered = int(seen.sum())
    if covered < stop - start:
        where = "" if box is None else f" of box {list(box.offsets)}+{list(box.sizes)}"
        raise CheckpointError(
            f"the checkpoint's shards cover only {covered} of elements [{start}, {stop}){where} of "
            f"{summary(key)}; pass the shards of every saved rank"
        )
    return out
