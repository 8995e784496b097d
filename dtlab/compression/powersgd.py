"""``PowerSGD``: rank-``r`` approximation by one power iteration per step (Vogels et al., 2019).

Per parameter, as torch's ``powerSGD_hook``: the buffer's :data:`~dtlab.compression.base.Layout`
(the ``(offset, shape)`` of the parameters packed in it, given by the model strategy) splits it into
tensors. Each tensor with ``ndim >= 2`` is a matrix ``M`` of shape ``(shape[0], prod(shape[1:]))``
(a conv weight ``(out, in, kh, kw)`` becomes ``(out, in*kh*kw)``) with rank ``r = min(rank, rows,
cols)``; it is compressed when the factors are ``min_compression_rate`` times smaller than the tensor,
``min_compression_rate * r * (rows + cols) < rows * cols`` (torch's rule; the default 2 also makes the
factors' all-reduce cheaper than a dense reduce-scatter). Every other element (1-D tensors such as
biases and norms, skipped matrices, padding) travels dense.

Per step, with ``Q`` warm-started from the previous step (initially random and orthonormal, drawn
from ``seed`` and the buffer key, so identical on every rank):

1. ``P_i = M_i Q_i`` for every compressed matrix; one all-reduce of all ``P_i`` *and* of the dense
   elements, batched in one buffer;
2. each ``P_i`` is orthonormalised (QR); ``Q_i = M_i^T P_i``; one all-reduce of all ``Q_i``;
3. the average is ``P_i Q_i^T / world_size`` per matrix, the dense sum / ``world_size`` elsewhere.

This rank's contribution is ``P_i (M_i^T P_i)^T`` (the projection of its ``M_i`` on the shared
basis) plus its dense elements; with error feedback the rest stays in its residual, written in the
same pass over ``M_i`` as the average. On CPUs the three passes over the matrices are fused kernels
(:mod:`~dtlab.compression.powersgd_kernels`), equal to the ``torch.mm`` fallback to float32
round-off, and the first is made in the error-feedback pass (``acc = grad + residual`` and ``P_i``
from one read; :meth:`PowerSGD.prefilter`). Without a layout (``GradientSynchronizer``, a reducer
built by hand) the whole buffer is one ``floor(sqrt(n))``-row matrix, zero-padded. ``warmup_steps``
(default 10) dense iterations come first (torch's ``start_powerSGD_iter``).

Reduce-scatter semantics (ZeRO-1/2/3, FSDP): low-rank factors cannot be split by shard, so the
factors of every matrix of the buffer are all-reduced and each rank keeps its shard of the
reconstructed average (a matrix crossing a shard boundary is handled like any other); a buffer with
no compressed matrix is reduce-scattered dense.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression.base import Compressor, Exchange, Layout, Prefilter, check_layout, dense_exchange
from dtlab.compression.powersgd_kernels import add_project, back, factor_shapes, finish, project, split
from dtlab.compression.state_io import Buffers
from dtlab.errors import ConfigError, integer, real

__all__ = ["PowerSGD"]


def matrix_shape(n: int) -> tuple[int, int]:
    """The near-square ``rows x cols >= n`` view of a flat buffer without a layout."""
    rows = max(1, math.isqrt(n))
    return rows, -(-n // rows)


@dataclass(frozen=True, kw_only=True)
class PowerSGD(Compressor):
    """Low-rank compression per parameter with warm start, error feedback and a skip rule."""

    name: ClassVar[str] = "powersgd"
    rank: int = 4
    warmup_steps: int = 10
    seed: int = 0
    #: compress a matrix only when its factors are this many times smaller (torch's default: 2)
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        rank, rate = integer(self.rank), real(self.min_compression_rate)
        if rank is None or rank < 1:
            raise ConfigError(f"PowerSGD: rank must be an integer >= 1, got {self.rank!r}")
        if rate is None or rate < 1:
            raise ConfigError(
                f"PowerSGD: min_compression_rate must be a finite number >= 1 (1: compress whenever the "
                f"factors are smaller than the tensor), got {self.min_compression_rate!r}"
            )
        object.__setattr__(self, "rank", rank)  # NumPy numbers as Python ones
        object.__setattr__(self, "min_compression_rate", rate)

    def compresses(self, rows: int, cols: int) -> bool:
        """The skip rule: is a ``rows x cols`` matrix sent as rank-``r`` factors?"""
        r = min(self.rank, rows, cols)
        return self.min_compression_rate * r * (rows + cols) < rows * cols

    def new_state(self, key: str, numel: int) -> dict[str, Any]:
        return self.new_state_for_layout(key, numel, None)

    def new_state_for_layout(self, key: str, numel: int, layout: Layout | None) -> dict[str, Any]:
        """``matrices``: int64 ``[m, 4]`` rows ``(offset, numel, rows, cols)`` of the compressed
        matrices; ``dense``: int64 ``[d, 2]`` rows ``(offset, numel)`` of every other element range;
        ``q``: the warm-start factors of all matrices, flat (``None`` until the first step)."""
        if layout is None:
            rows, cols = matrix_shape(numel)
            matrices = [(0, numel, rows, cols)] if self.compresses(rows, cols) else []
        else:
            matrices = []
            for offset, shape in check_layout(layout, numel, key):
                size = math.prod(shape)
                if len(shape) >= 2 and size > 0 and self.compresses(shape[0], size // shape[0]):
                    matrices.append((offset, size, shape[0], size // shape[0]))
        dense, end = [], 0
        for offset, size, _, _ in matrices:
            if offset > end:
                dense.append((end, offset - end))
            end = offset + size
        if numel > end:
            dense.append((end, numel - end))
        return {
            "matrices": torch.tensor(matrices, dtype=torch.int64).reshape(-1, 4),
            "dense": torch.tensor(dense, dtype=torch.int64).reshape(-1, 2),
            "q": None,
            "key_hash": zlib.crc32(key.encode()),
            "buffers": Buffers(),
            "pass": Prefilter(),
        }

    def prefilter(self, state: dict[str, Any], numel: int) -> Prefilter | None:  # noqa: ARG002 - the Compressor interface; the state knows the size
        """``P = M Q`` computed in the error-feedback pass (:func:`add_project`), from the second
        compressed step on (``Q`` exists) where the kernels run."""
        table: torch.Tensor = state["matrices"]
        q: torch.Tensor | None = state["q"]
        if table.numel() == 0 or q is None:
            return None
        bufs: Buffers = state["buffers"]
        n_p = sum(rows * r for rows, _, r in factor_shapes(table.tolist(), self.rank))
        p = bufs.get("p", n_p, torch.float32, q.device)
        pre: Prefilter = state["pass"]

        def fused(src: torch.Tensor, res: torch.Tensor, acc: torch.Tensor) -> int | None:
            return add_project(src, res, acc, table, self.rank, (q, p), bufs)

        return pre.request_fused(fused)

    def _initial_q(self, state: dict[str, Any], shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(state["key_hash"]))
        qs = [torch.linalg.qr(torch.randn(cols, r, generator=gen)).Q.reshape(-1) for _, cols, r in shapes]
        return torch.cat(qs)

    def reduce_scatter(
        self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend
    ) -> Exchange:
        if state["matrices"].numel() == 0:
            return dense_exchange(acc, backend, shard=True)
        return super().reduce_scatter(state, acc, backend)

    def all_reduce(self, state: dict[str, Any], acc: torch.Tensor, backend: CommunicationBackend) -> Exchange:
        table: torch.Tensor = state["matrices"]
        mats: list[list[int]] = table.tolist()
        if not mats:
            return dense_exchange(acc, backend, shard=False)
        dense: list[list[int]] = state["dense"].tolist()
        p, dev = backend.world_size, acc.device
        bufs: Buffers = state["buffers"]
        t0 = time.perf_counter()
        shapes = factor_shapes(mats, self.rank)
        if state["q"] is None:
            state["q"] = self._initial_q(state, shapes).to(dev)
        n_p = sum(rows * r for rows, _, r in shapes)
        first = torch.empty(n_p + sum(size for _, size in dense), dtype=torch.float32, device=dev)
        pre: Prefilter = state["pass"]
        if pre.take_fused():  # every P = M Q, made in the error-feedback pass
            first[:n_p].copy_(bufs.get("p", n_p, torch.float32, dev))
        else:
            project(acc, table, self.rank, state["q"], first[:n_p], bufs)
        pos = n_p
        for offset, size in dense:
            first[pos : pos + size].copy_(acc[offset : offset + size])
            pos += size
        select_s = time.perf_counter() - t0
        backend.all_reduce(first, ReduceOp.SUM)  # every P and the dense elements, one call
        t1 = time.perf_counter()
        ps = [torch.linalg.qr(x).Q for x in split(first[:n_p], [(rows, r) for rows, _, r in shapes])]
        p_orth = torch.cat([x.reshape(-1) for x in ps])
        q_local = torch.empty(sum(cols * r for _, cols, r in shapes), dtype=torch.float32, device=dev)
        back(acc, table, self.rank, p_orth, q_local, bufs)  # every Q = M^T P
        for offset, size in dense:  # the residual of the dense elements (sent whole)
            acc[offset : offset + size].zero_()
        q_sum = q_local.clone()
        select_s += time.perf_counter() - t1
        backend.all_reduce(q_sum, ReduceOp.SUM)  # every Q, one call
        state["q"] = q_sum
        sent = first.numel() + q_sum.numel()

        def write(out: torch.Tensor) -> int:
            """The average, straight into the gradient: ``(P / p) Q^T`` per matrix, in the same pass
            as the residual ``acc - P Q_local^T`` (in place: error feedback keeps ``acc``), and the
            dense sums ``/ p``."""
            finish(acc, out, table, self.rank, (p_orth, q_local, q_sum), p, bufs)
            pos = n_p
            for offset, size in dense:
                torch.div(first[pos : pos + size], p, out=out[offset : offset + size])
                pos += size
            return sent

        return Exchange(None, None, sent, sent, select_s, residual_in_place=True, writer=write)
