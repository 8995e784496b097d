"""What every gradient compressor offers, and the per-buffer state the reducer keeps for it.

A compressor is a small frozen configuration (``OkTopk(density=0.01)``) plus two exchange methods
that every rank of a data-parallel group calls with the same buffer:

- :meth:`Compressor.all_reduce` turns this rank's accumulated gradient ``acc`` (gradient plus error-
  feedback residual, flat float32) into the *average* over ranks of what the ranks sent;
- :meth:`Compressor.reduce_scatter` does the same for this rank's equal shard only.

Both return an :class:`Exchange`: the averaged result, what this rank *contributed* to it (the error-
feedback mechanism keeps ``acc - contributed`` as the residual), how many elements were selected and
how long the selection took. The mutable per-buffer state (thresholds, region boundaries, step
counters) lives in a dict the reducer owns, never in the compressor object, so one compressor object
can serve many buffers, reducers and in-memory ranks.

A buffer may come with its :data:`Layout`, the ``(offset, shape)`` of every parameter packed in it (a
DDP/ZeRO bucket, a ZeRO-3 parameter, an FSDP unit). Compressors that work per parameter (PowerSGD)
build their state from it in :meth:`Compressor.new_state_for_layout`; the others ignore it.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.finite import FiniteCheck
from dtlab.compression.kernels import write_sparse
from dtlab.compression.prefilter import Prefilter
from dtlab.errors import ConfigError, DtlabError, check_switches, integer, real

__all__ = [
    "Compressor",
    "Exchange",
    "Layout",
    "NonFiniteGradientError",
    "Prefilter",
    "SparseCompressor",
    "check_layout",
]

#: indices travel as int32 next to float32 values; buffers must stay below this many elements
MAX_NUMEL = 2**31 - 1

#: ``(offset, shape)`` of every parameter packed in a flat buffer, in buffer order; elements no
#: parameter covers (padding) are plain gradient elements too
Layout = Sequence[tuple[int, tuple[int, ...]]]


def check_layout(layout: Layout, numel: int, key: str) -> list[tuple[int, tuple[int, ...]]]:
    """``layout`` as a list of ``(offset, shape)`` after checking that its parameters lie inside the
    buffer of ``numel`` elements in ascending, non-overlapping order (a clear error otherwise)."""
    out: list[tuple[int, tuple[int, ...]]] = []
    end = 0
    for i, entry in enumerate(layout):
        offset, shape = int(entry[0]), tuple(int(d) for d in entry[1])
        size = math.prod(shape)
        if offset < end or any(d < 0 for d in shape) or offset + size > numel:
            raise ConfigError(
                f"layout of buffer {key!r}: parameter {i} at offset {offset} with shape {shape} "
                f"({size} elements) must lie in [{end}, {numel}) after the previous parameter; pass the "
                f"(offset, shape) of the parameters packed in the {numel}-element buffer, in order"
            )
        out.append((offset, shape))
        end = offset + size
    return out


class NonFiniteGradientError(DtlabError):
    """A gradient handed to a compressed reducer holds NaN or Inf values (on the ranks named)."""

    def __init__(self, message: str, key: str, counts: list[int]) -> None:
        super().__init__(message)
        self.key = key
        self.counts = counts


@dataclass
class Exchange:
    """Outcome of one compressed exchange on one rank.

    The average over ranks (the full buffer for all-reduce, this rank's shard for reduce-scatter) is
    either dense, ``result``, or sparse, ``result_indices``/``result_values`` (zero elsewhere).
    What this rank put into the sum is either ``sent``, indices at which it contributed its whole
    accumulated value (and nothing elsewhere), or ``contributed``, a dense full-length tensor; with
    neither it contributed everything. ``local_selected``: elements this rank selected to send;
    ``global_selected``: elements of the synchronized result (``None`` where a rank cannot know it
    without extra communication). ``select_seconds``: time spent choosing what to send.
    ``residual_in_place``: the compressor turns ``acc`` into ``acc - contributed`` itself (one pass
    fused with its quantization or cast, or with its ``writer``'s), so error feedback keeps ``acc`` as
    it is once the result is written as the residual.
    ``result`` may be in a lower precision (a cast's sum); :meth:`write` converts it.
    ``writer``: a dense result not yet computed; ``writer(out)`` writes it into a flat float32 ``out``
    and returns how many elements are nonzero (``global_selected``): decoding straight into the
    gradient saves a pass through a separate result buffer.
    """

    result: torch.Tensor | None
    contributed: torch.Tensor | None
    local_selected: int
    global_selected: int | None
    select_seconds: float = 0.0
    sent: torch.Tensor | None = None
    result_indices: torch.Tensor | None = None
    result_values: torch.Tensor | None = None
    residual_in_place: bool = False
    writer: Callable[[torch.Tensor], int] | None = None

    def materialize(self, numel: int, device: torch.device) -> None:
        """Compute a ``writer``'s result into :attr:`result` (a float32 buffer of ``numel``)."""
        if self.writer is not None and self.result is None:
            self.result = torch.empty(numel, dtype=torch.float32, device=device)
            self.global_selected = self.writer(self.result)

    @classmethod
    def sparse(
        cls,
        indices: torch.Tensor,
        values: torch.Tensor,
        sent: torch.Tensor,
        local_selected: int,
        global_selected: int | None,
        select_seconds: float,
    ) -> Exchange:
        return cls(None, None, local_selected, global_selected, select_seconds, sent, indices, values)

    def write(self, out: torch.Tensor, zeroed: bool = False) -> None:
        """Store the average into ``out`` (flat, any floating dtype); ``zeroed``: ``out`` holds zeros
        already (a sparse result is scattered into it, nothing else is written)."""
        if self.writer is not None and self.result is None:
            if out.dtype == torch.float32 and out.is_contiguous():
                self.global_selected = self.writer(out.view(-1))
                return
            self.materialize(out.numel(), out.device)
        if self.result is not None:
            out.copy_(self.result)
            return
        if self.result_indices is not None and self.result_values is not None:
            if zeroed:
                out.view(-1).index_copy_(0, self.result_indices, self.result_values.to(out.dtype))
            else:
                write_sparse(out, self.result_indices, self.result_values)
        elif not zeroed:
            out.zero_()


@dataclass(frozen=True, kw_only=True)
class Compressor(ABC):
    """Base of every compressor; subclasses are frozen dataclasses configured by keyword."""

    #: short name used in benchmarks, statistics and errors
    name: ClassVar[str] = "base"
    #: what this algorithm leaves out under reduce-scatter semantics (ZeRO-1's default, ZeRO-2/3,
    #: FSDP), reported as ``variant`` in the step statistics; ``None``: the same algorithm as under
    #: all-reduce semantics
    reduce_scatter_variant: ClassVar[str | None] = None
    #: dense all-reduce iterations before compression starts (per buffer)
    warmup_steps: int = 0
    #: keep what was not sent and add it to the next gradient (error feedback)
    error_feedback: bool = True

    def __post_init__(self) -> None:
        # seed: RandomK, QSGD, PowerSGD ('x' would fail at the first compression)
        for field in ("warmup_steps", "seed") if hasattr(self, "seed") else ("warmup_steps",):
            v = getattr(self, field)
            n = integer(v)
            if n is None or n < 0:
                raise ConfigError(f"{type(self).__name__}: {field} must be an integer >= 0, got {v!r}")
            object.__setattr__(self, field, n)  # a NumPy integer as a Python one
        check_switches(type(self).__name__, error_feedback=self.error_feedback)

    def validate_numel(self, numel: int, key: str) -> None:
        """Raise a clear error when a buffer of ``numel`` elements cannot be compressed."""
        if numel > MAX_NUMEL:
            raise ConfigError(
                f"{self.name}: buffer {key!r} has {numel} elements; compressed buffers must stay below "
                f"2**31 (indices travel as int32); use smaller buckets"
            )

    def new_state(self, key: str, numel: int) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        """Fresh mutable state for one buffer (thresholds, boundaries, counters)."""
        return {}

    def prefilter(self, state: dict[str, Any], numel: int) -> Prefilter | None:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        """The selection this compressor wants made in the error-feedback pass of its next call
        (:class:`Prefilter`, kept in its state), or ``None`` (default: the compressor selects on its
        own). Called by the reducer right before it accumulates the buffer for a compressed call."""
        return None

    def new_state_for_layout(self, key: str, numel: int, layout: Layout | None) -> dict[str, Any]:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        """Fresh state for a buffer whose parameter :data:`Layout` is known (``None``: unknown).

        Default: the layout is not used (:meth:`new_state`). The state stays a plain dict of tensors,
        ints, floats and ``None``, so a compressor that uses the layout keeps it as tensors.
        """
        return self.new_state(key, numel)

    @abstractmethod
    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        """Average ``acc`` (flat float32) over ranks in compressed form."""

    def reduce_scatter(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> Exchange:
        """Average of chunk ``rank`` of ``acc`` (``acc.numel()`` divisible by the world size).

        Default: the compressed all-reduce, keeping this rank's chunk. Algorithms with a sparse
        reduce-scatter phase (Ok-Topk, TopkDSA) override it and skip their gather phase.
        """
        ex = self.all_reduce(state, acc, backend)
        ex.materialize(acc.numel(), acc.device)
        n, me = acc.numel() // backend.world_size, backend.rank
        if ex.result is not None:
            ex.result = ex.result[me * n : (me + 1) * n]
        elif ex.result_indices is not None and ex.result_values is not None:
            keep = (ex.result_indices >= me * n) & (ex.result_indices < (me + 1) * n)
            ex.result_indices = ex.result_indices[keep] - me * n
            ex.result_values = ex.result_values[keep]
        return ex

    def checked_exchange(
        self,
        state: dict[str, Any],
        acc: torch.Tensor,
        backend: CommunicationBackend,
        check: FiniteCheck,
        *,
        shard: bool,
    ) -> Exchange:
        """:meth:`reduce_scatter` (``shard``) or :meth:`all_reduce`, after the non-finite ``check``
        was decided on every rank. Default: its own all-reduce of the ``P`` counts first; a compressor
        whose first exchange is a count exchange folds the counts into it instead (Ok-Topk)."""
        check.exchange(backend)
        return self.reduce_scatter(state, acc, backend) if shard else self.all_reduce(state, acc, backend)

    def at_step(self, step: int) -> Compressor:  # noqa: ARG002 - the Compressor interface; this algorithm does not use it
        """The configuration in force at compressed iteration ``step`` (counted from the first
        iteration after ``warmup_steps``): ``self``, unless a subclass ramps a parameter."""
        return self

    def describe(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, kw_only=True)
class SparseCompressor(Compressor):
    """A compressor that keeps about ``k = density * numel`` elements of every buffer.

    ``ramp_steps`` (default 0): Deep Gradient Compression's warm-up training. For the first
    ``ramp_steps`` compressed iterations (after the ``warmup_steps`` dense ones) the density falls
    exponentially toward ``density`` in equal stages, 4x sparser each: 25%, 6.25%, 1.5625%, ...
    (stages at or below ``density`` are not used), so error-feedback residuals build up gradually
    instead of all at once when the dense warm-up ends. See :func:`ramp_densities`.
    """

    density: float = 0.01
    ramp_steps: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        d, r = real(self.density), integer(self.ramp_steps)
        if d is None or not 0 < d <= 1:
            raise ConfigError(
                f"{type(self).__name__}: density must be in (0, 1] (the fraction of gradient elements "
                f"sent, e.g. 0.01), got {self.density!r}"
            )
        if r is None or r < 0:
            raise ConfigError(
                f"{type(self).__name__}: ramp_steps must be an integer >= 0 (compressed iterations "
                f"over which the density falls from 25% to density; 0: no ramp), got {self.ramp_steps!r}"
            )
        object.__setattr__(self, "density", d)  # NumPy numbers as Python ones
        object.__setattr__(self, "ramp_steps", r)

    def at_step(self, step: int) -> SparseCompressor:
        """``self`` with the ramp's density at compressed iteration ``step`` while ``step <
        ramp_steps``; ``self`` afterwards (and without a ramp)."""
        if step >= self.ramp_steps:
            return self
        stages = ramp_densities(self.density)
        if not stages:
            return self
        stage = step * len(stages) // self.ramp_steps
        return dataclasses.replace(self, density=stages[stage], ramp_steps=0)

    def k(self, numel: int) -> int:
        return int(self.density * numel)

    def validate_numel(self, numel: int, key: str) -> None:
        super().validate_numel(numel, key)
        if self.k(numel) < 1:
            need = 1.0 / numel
            raise ConfigError(
                f"{self.name}: density={self.density} x {numel} elements of buffer {key!r} rounds to "
                f"k=0 elements; use density >= {need:.3g} or send buffers this small dense "
                f"(raise dense_below above {numel})"
            )


def ramp_densities(density: float) -> list[float]:
    """The ramp's stages above ``density``: 0.25, 0.0625, ... (DGC's 75%, 93.75%, ... sparsity)."""
    stages, d = [], 0.25
    while d > density:
        stages.append(d)
        d /= 4
    return stages


def dense_exchange(acc: torch.Tensor, backend: CommunicationBackend, shard: bool) -> Exchange:
    """Uncompressed average of ``acc`` (used for warm-up iterations and skip rules)."""
    p = backend.world_size
    if shard:
        out = torch.empty(acc.numel() // p, dtype=acc.dtype, device=acc.device)
        backend.reduce_scatter(out, acc, ReduceOp.SUM)
    else:
        out = acc.clone()
        backend.all_reduce(out, ReduceOp.SUM)
    out.div_(p)
    return Exchange(out, None, acc.numel(), acc.numel())
