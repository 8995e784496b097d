"""Shared pieces of the conformance suite: case data, deterministic inputs, comparisons, failures.

Nothing here talks to a concrete backend; only :class:`~dtlab.backends.CommunicationBackend` is used.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from dtlab.backends.base import ReduceOp
from dtlab.errors import ArgumentError, DtlabError

__all__ = [
    "Case",
    "ConformanceFailure",
    "Problems",
    "SizesCase",
    "case_input",
    "expected_reduction",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
HALF_DTYPES = (torch.float16, torch.bfloat16)


class ConformanceFailure(DtlabError, AssertionError):
    """A backend computed something other than the direct computation (the message has the values)."""


@dataclass(frozen=True)
class Case:
    """One collective call: tensor ``shape`` and ``dtype``, reduce ``op``, ``root`` and input ``seed``.

    ``root`` is taken modulo the world size, so one case fits every world size. For ``reduce_scatter``
    ``shape`` is the output's shape; for ``all_gather`` it is the input's.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ALL_DTYPES:
            raise ArgumentError(f"Case: dtype {self.dtype} is not one of {ALL_DTYPES}")
        if any(d < 0 for d in self.shape):
            raise ArgumentError(f"Case: shape {self.shape} has a negative dimension")
        if self.op is ReduceOp.AVG and self.dtype in INT_DTYPES:
            raise ArgumentError(f"Case: ReduceOp.AVG needs a floating dtype, got {self.dtype}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"shape={self.shape} dtype={dtype} op={self.op.name} root={self.root}"


@dataclass(frozen=True)
class SizesCase:
    """Per-rank element counts for ``all_gather_v`` and ``all_to_all``, cycled over ranks (pairs).

    Rank ``r`` contributes ``counts[r % len(counts)]`` elements to ``all_gather_v``; in ``all_to_all``
    rank ``i`` sends ``counts[(i * P + j) % len(counts)]`` elements to rank ``j``.
    """

    counts: tuple[int, ...]
    dtype: torch.dtype
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.counts or any(c < 0 for c in self.counts):
            raise ArgumentError(
                f"SizesCase: counts must be a non-empty tuple of counts >= 0, got {self.counts}"
            )
        if self.dtype not in ALL_DTYPES:
            raise ArgumentError(f"SizesCase: dtype {self.dtype} is not one of {ALL_DTYPES}")

    def count(self, index: int) -> int:
        return self.counts[index % len(self.counts)]


def _generator(*key: object) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()))
    return g


def case_input(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, rank: int, op: ReduceOp = ReduceOp.SUM
) -> torch.Tensor:
    """Rank ``rank``'s input (on the CPU): small integers, so every reduction is exact in every dtype.

    Values lie in [-4, 4] (sums of 8 ranks stay exact even in bfloat16); for PRODUCT they are
    +-1 or +-2, so products are powers of two. The same (shape, dtype, seed, rank) gives the same
    tensor in every process.
    """
    g = _generator("input", seed, rank, shape, str(dtype))
    if op is ReduceOp.PRODUCT:
        choices = torch.tensor([-2, -1, 1, 2], dtype=torch.int64)
        idx = torch.randint(0, 4, shape, generator=g, dtype=torch.int64)
        return choices[idx].to(dtype)
    return torch.randint(-4, 5, shape, generator=g, dtype=torch.int64).to(dtype)


def expected_reduction(inputs: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    """The direct computation: reduce in float64 (exact for :func:`case_input` data), cast to ``dtype``."""
    stack = torch.stack([t.to(torch.float64) for t in inputs])
    if op is ReduceOp.SUM:
        out = stack.sum(0)
    elif op is ReduceOp.AVG:
        out = stack.sum(0) / len(inputs)
    elif op is ReduceOp.MAX:
        out = stack.max(0).values
    elif op is ReduceOp.MIN:
        out = stack.min(0).values
    else:
        out = stack.prod(0)
    return out.to(dtype)


def tolerance(dtype: torch.dtype, op: ReduceOp) -> tuple[float, float] | None:
    """``(rtol, atol)`` for a comparison, or ``None`` for an exact (bitwise) one.

    Integer-valued data make SUM/MAX/MIN/PRODUCT exact in any reduction order; AVG divides once
    (engines may divide before or after summing) and half types get a tolerance for engines that
    reduce them through another dtype.
    """
    if dtype in HALF_DTYPES:
        return (1e-2, 1e-2) if dtype is torch.bfloat16 else (2e-3, 2e-3)
    if op is ReduceOp.AVG:
        return (1e-6, 1e-6) if dtype is torch.float32 else (1e-12, 1e-12)
    return None


class Problems:
    """Collects failures of one check so every rank finishes the check's communication first."""

    def __init__(self, check: str, rank: int) -> None:
        self.check, self.rank = check, rank
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.items.append(message)

    def compare(
        self, what: str, actual: torch.Tensor, expected: torch.Tensor, op: ReduceOp = ReduceOp.SUM
    ) -> None:
        """Record a failure unless ``actual`` equals ``expected`` (exactly or within :func:`tolerance`)."""
        actual = actual.detach().cpu()
        expected = expected.detach().cpu()
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            self.add(
                f"{what}: got dtype {actual.dtype} shape {tuple(actual.shape)}, expected dtype "
                f"{expected.dtype} shape {tuple(expected.shape)}"
            )
            return
        tol = tolerance(expected.dtype, op)
        if tol is None:
            ok = torch.equal(actual, expected)
        else:
            ok = torch.allclose(actual.double(), expected.double(), rtol=tol[0], atol=tol[1])
        if not ok:
            diff = (actual.double() - expected.double()).abs()
            where = int(diff.reshape(-1).argmax()) if diff.numel() else 0
            self.add(
                f"{what}: got {_show(actual)}, expected {_show(expected)} "
                f"(max |difference| {float(diff.max()) if diff.numel() else 0.0:g} at flat index {where})"
            )

    def raise_if_any(self) -> None:
        if self.items:
            shown = self.items[:5]
            more = f" (and {len(self.items) - 5} more)" if len(self.items) > 5 else ""
            raise ConformanceFailure(f"{self.check} on rank {self.rank}: " + "; ".join(shown) + more)


def _show(t: torch.Tensor, limit: int = 8) -> str:
    flat = t.reshape(-1)
    values = flat[:limit].tolist()
    return f"{values}{' ...' if flat.numel() > limit else ''}"
