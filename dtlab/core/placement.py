"""Where a parameter lives on a mesh: :class:`Replicate` or :class:`Shard` along one axis and one dim.

Every parameter a model strategy trains carries a placement (``placement_of(param)``; default
``Replicate()``). Clipping, the finite check, memory reports and checkpoints read placements instead of
asking which strategy made the tensor:

- a norm over the whole model sums each tensor's contribution over the axis it is sharded on and counts
  a replicated tensor once (:func:`counts_in_norm`);
- a checkpoint stores each local shard as boxes of the full tensor (:meth:`Shard.boxes`), so it loads
  under another mesh or into the plain module.

``Shard(axis, dim, sections=k)`` describes a fused tensor (a qkv projection laid out ``(3, heads,
head_dim)``): dim ``dim`` is ``k`` equal consecutive sections and each section is split evenly over the
axis; the local tensor is the concatenation of this rank's part of every section.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dtlab.errors import StrategyError

__all__ = [
    "Box",
    "Placement",
    "Replicate",
    "Shard",
    "counts_in_norm",
    "local_regions",
    "placement_of",
    "set_placement",
]

_ATTR = "_dtlab_placement"


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """The tensor is split evenly along tensor dim ``dim`` over mesh axis ``axis``.

    ``sections > 1``: the dim is ``sections`` equal consecutive parts, each split over the axis (fused
    projections: q, k and v of the same heads on one rank); the local tensor is this coordinate's part
    of each section, concatenated along ``dim``.
    """

    axis: str
    dim: int
    sections: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.axis, str) and self.axis):
            raise StrategyError(f"Shard(axis=...) needs a mesh axis name such as 'tp', got {self.axis!r}")
        if not (isinstance(self.dim, int) and self.dim >= 0):
            raise StrategyError(f"Shard(dim=...) must be a tensor dim >= 0, got {self.dim!r}")
        if not (isinstance(self.sections, int) and self.sections >= 1):
            raise StrategyError(f"Shard(sections=...) must be an int >= 1, got {self.sections!r}")

    def __str__(self) -> str:
        extra = f", sections={self.sections}" if self.sections > 1 else ""
        return f"Shard(axis={self.axis!r}, dim={self.dim}{extra})"

    def check(self, full_shape: Sequence[int], size: int, what: str) -> None:
        """Raise naming ``what`` unless ``full_shape`` splits evenly ``size`` ways."""
        if self.dim >= len(full_shape):
            raise StrategyError(f"{what}: {self} but the tensor has only {len(full_shape)} dims")
        n = int(full_shape[self.dim])
        if n % (self.sections * size):
            parts = f"{self.sections} sections x " if self.sections > 1 else ""
            raise StrategyError(
                f"{what}: dim {self.dim} of size {n} does not split evenly into {parts}{self.axis}={size} "
                f"parts; choose a {self.axis} size that divides {n // self.sections}"
            )

    def local_shape(self, full_shape: Sequence[int], size: int) -> tuple[int, ...]:
        shape = [int(s) for s in full_shape]
        shape[self.dim] //= size
        return tuple(shape)

    def boxes(self, full_shape: Sequence[int], coord: int, size: int) -> list[Box]:
        """The boxes of the full tensor this coordinate holds, in the local tensor's order along ``dim``."""
        n = int(full_shape[self.dim])
        sec = n // self.sections
        part = sec // size
        out = []
        for k in range(self.sections):
            offsets = [0] * len(full_shape)
            sizes = [int(s) for s in full_shape]
            offsets[self.dim] = k * sec + coord * part
            sizes[self.dim] = part
            out.append(Box(tuple(offsets), tuple(sizes)))
        return out

    def local_shard(self, full: torch.Tensor, coord: int, size: int) -> torch.Tensor:
        """This coordinate's shard of ``full`` (a new contiguous tensor)."""
        pieces = [full[b.slices()] for b in self.boxes(full.shape, coord, size)]
        return torch.cat(pieces, dim=self.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


Placement = Replicate | Shard


@dataclass(frozen=True)
class Box:
    """The block ``full[offsets[0]:offsets[0]+sizes[0], ...]`` of a full tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def placement_of(param: torch.Tensor) -> Placement:
    """The placement recorded on ``param`` (``Replicate()`` when none was set)."""
    placement = getattr(param, _ATTR, None)
    return Replicate() if placement is None else placement


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    if not isinstance(placement, Replicate | Shard):
        raise StrategyError(f"a placement is Replicate() or Shard(axis, dim), got {placement!r}")
    setattr(param, _ATTR, placement)


def counts_in_norm(placement: Placement, coords: Mapping[str, int], axes: Iterable[str]) -> bool:
    """Whether this rank's copy of a tensor counts in a sum over the ranks of ``axes``.

    A tensor sharded along an axis counts on every coordinate of it (each holds a different part); on
    an axis it is replicated along, only coordinate 0 counts, so a norm summed over the mesh counts a
    replicated tensor once (summing it on every tensor-parallel rank is Megatron #1446's bug).
    """
    sharded_on = placement.axis if isinstance(placement, Shard) else None
    return all(coords.get(a, 0) == 0 for a in axes if a != sharded_on)


def local_regions(
    placement: Placement, full_shape: Sequence[int], coord: int, size: int, start: int, end: int
) -> list[tuple[Box, int, int, int]]:
    """Elements ``[start, end)`` of this coordinate's flattened local tensor, as pieces of full-tensor
    boxes: ``(box, box_start, box_end, local_offset)`` = elements ``[box_start, box_end)`` of ``box``
    flattened lie at ``local_offset`` of the local flat tensor."""
    full = tuple(int(s) for s in full_shape)
    if isinstance(placement, Replicate) or size == 1:
        return [(Box((0,) * len(full), full), start, end, start)] if end > start else []
    out = []
    base = 0
    for box in _flat_order(placement.boxes(full, coord, size), placement.dim):
        lo, hi = max(start, base), min(end, base + box.numel)
        if lo < hi:
            out.append((box, lo - base, hi - base, lo))
        base += box.numel
    return out


def _flat_order(boxes: list[Box], dim: int) -> list[Box]:
    """``boxes`` (concatenated along ``dim`` in the local tensor) as boxes in the local tensor's
    flattened order: one box is the whole local tensor, and boxes along dim 0 follow each other; along
    a later dim they interleave, so each is cut into its rows over the dims before ``dim``."""
    if len(boxes) == 1 or dim == 0:
        return boxes
    lead = boxes[0].sizes[:dim]
    out = []
    for idx in itertools.product(*(range(n) for n in lead)):
        for box in boxes:
            out.append(Box(idx + box.offsets[dim:], (1,) * dim + box.sizes[dim:]))
    return out
