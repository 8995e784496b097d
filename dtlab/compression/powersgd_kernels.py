"""PowerSGD's passes over a buffer's compressed matrices: fused CPU kernels, with torch fallbacks.

Per step PowerSGD reads each compressed matrix ``M`` (a view of the accumulated gradient ``acc``)
three times, and each function here is one of those passes over all matrices of the buffer:

- :func:`project`: ``P = M Q``; :func:`add_project` makes this pass the error-feedback add's
  (``acc = grad + residual``, written as it is read);
- :func:`back`: ``Q' = M^T P`` (``P`` orthonormalised, all-reduced);
- :func:`finish`: the residual ``acc - P Q'^T`` in place and the average ``(P / world) Q_sum^T``
  written into the gradient, in one pass (``Q'`` this rank's, ``Q_sum`` every rank's sum).

The kernels (:mod:`~dtlab.compression.powersgd_source`) read ``M`` once per pass, row by row, with
the rank-``r`` factors in cache: ``P``'s rows are dot products with ``Q^T``'s ``r`` rows, ``Q'``
is accumulated as an ``r x cols`` block over ``M``'s rows in order, and ``finish`` writes both
results of an element from the same read. MKL's products on these skinny shapes run far below
streaming speed; these run at about the speed of a streaming read or write.

The factors are laid out as PowerSGD keeps them (every matrix's ``P``, ``rows x r``, one after the
other, the ``Q``'s as ``cols x r``), so the bytes sent do not change. The kernels' sums run in a fixed
order with fused multiply-adds, the fallback's (``torch.mm``: MKL on CPUs) in another, so the two
differ by float32 round-off (tested to a relative 1e-5 of each result's scale); every rank of a
machine type runs the same one, so the ranks agree bit for bit (ranks on different CPU types, or
with ``DTLAB_NATIVE_KERNELS`` set differently, agree to round-off, as MKL's would). The fallback
runs for GPU tensors, ranks above :data:`~dtlab.compression.powersgd_source.MAX_RANK`, without a C
compiler and with ``DTLAB_NATIVE_KERNELS=0``.
"""

from __future__ import annotations

import ctypes

import torch

from dtlab.compression.native import native
from dtlab.compression.powersgd_source import MAX_RANK
from dtlab.compression.state_io import Buffers

__all__ = ["add_project", "back", "factor_shapes", "finish", "project", "split"]


def factor_shapes(mats: list[list[int]], rank: int) -> list[tuple[int, int, int]]:
    """``(rows, cols, r)`` of every matrix of the table, ``r = min(rank, rows, cols)``."""
    return [(rows, cols, min(rank, rows, cols)) for _, _, rows, cols in mats]


def _kernel(
    mats: torch.Tensor, rank: int, *tensors: torch.Tensor
) -> tuple[ctypes.CDLL, list[tuple[int, int, int]], int] | None:
    """The library, the factor shapes and the scratch floats one pass needs, or ``None`` (fallback)."""
    if any(t.dtype != torch.float32 for t in tensors) or mats.dtype != torch.int64:
        return None
    lib = native(mats, *tensors)
    shapes = factor_shapes(mats.tolist(), rank)
    if lib is None or max(r for _, _, r in shapes) > MAX_RANK:
        return None
    return lib, shapes, max(r * cols for _, cols, r in shapes)


def _factors(
    table: list[list[int]], rank: int, p: torch.Tensor, *qs: torch.Tensor
) -> list[list[torch.Tensor]]:
    """The fallbacks' per-matrix views: of the flat ``p`` (each ``rows x r``), then of every flat ``q``
    (each ``cols x r``)."""
    shapes = factor_shapes(table, rank)
    return [split(p, [(rows, r) for rows, _, r in shapes])] + [
        split(q, [(cols, r) for _, cols, r in shapes]) for q in qs
    ]


def _views(acc: torch.Tensor, mats: list[list[int]], bufs: Buffers) -> list[torch.Tensor]:
    """Every matrix as a ``rows x cols`` view of ``acc`` (a short one copied, zero-padded)."""
    out = []
    for i, (offset, size, rows, cols) in enumerate(mats):
        seg = acc[offset : offset + size]
        if size < rows * cols:  # no layout: the buffer zero-padded to a near-square matrix
            padded = bufs.get(f"padded{i}", rows * cols, torch.float32, acc.device)
            padded[:size].copy_(seg)
            padded[size:].zero_()
            seg = padded
        out.append(seg.view(rows, cols))
    return out


def split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive ``rows x cols`` views of ``flat``."""
    out, pos = [], 0
    for rows, cols in shapes:
        out.append(flat[pos : pos + rows * cols].view(rows, cols))
        pos += rows * cols
    return out


def project(
    acc: torch.Tensor, mats: torch.Tensor, rank: int, q: torch.Tensor, p: torch.Tensor, bufs: Buffers
) -> None:
    """``p`` (flat, every matrix's ``rows x r``) becomes ``M Q`` for every matrix of the table
    ``mats`` (int64 rows ``(offset, numel, rows, cols)``) in ``acc``; ``q``: the ``cols x r`` factors."""
    k = _kernel(mats, rank, acc, q, p)
    if k is not None:
        lib, _, scratch = k
        tmp = bufs.get("kernel_scratch", scratch, torch.float32, acc.device)
        lib.dt_psgd_project(
            acc.data_ptr(), mats.data_ptr(), mats.shape[0], rank, q.data_ptr(), p.data_ptr(), tmp.data_ptr()
        )
        return
    table: list[list[int]] = mats.tolist()
    ps, qs = _factors(table, rank, p, q)
    # Q as the transposed view of a contiguous r x cols matrix: BLAS streams M once per product
    for m, qi, pi in zip(_views(acc, table, bufs), qs, ps, strict=True):
        torch.mm(m, qi.t().contiguous().t(), out=pi)


def add_project(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    mats: torch.Tensor,
    rank: int,
    factors: tuple[torch.Tensor, torch.Tensor],
    bufs: Buffers,
) -> int | None:
    """``out = a + b`` (flat float32, same size) and, in the same pass, :func:`project` of the sum,
    bit for bit (``factors = (q, p)``); returns the number of NaN/Inf values of ``out``, or ``None``
    where the kernel cannot run (nothing is written: the caller makes the two passes)."""
    q, p = factors
    k = _kernel(mats, rank, a, b, out, q, p)
    if k is None or not a.numel() == b.numel() == out.numel():
        return None
    lib, _, scratch = k
    tmp = bufs.get("kernel_scratch", scratch, torch.float32, a.device)
    return int(
        lib.dt_psgd_add_project(
            a.data_ptr(), b.data_ptr(), out.data_ptr(), out.numel(), mats.data_ptr(), mats.shape[0], rank,
            q.data_ptr(), p.data_ptr(), tmp.data_ptr(),
        )
    )  # fmt: skip


def back(
    acc: torch.Tensor, mats: torch.Tensor, rank: int, p: torch.Tensor, q: torch.Tensor, bufs: Buffers
) -> None:
    """``q`` (flat, every matrix's ``cols x r``) becomes ``M^T P`` for every matrix (``p`` flat, each
    ``rows x r``)."""
    k = _kernel(mats, rank, acc, p, q)
    if k is not None:
        lib, _, scratch = k
        tmp = bufs.get("kernel_scratch", scratch, torch.float32, acc.device)
        lib.dt_psgd_back(
            acc.data_ptr(), mats.data_ptr(), mats.shape[0], rank, p.data_ptr(), q.data_ptr(), tmp.data_ptr()
        )
        return
    table: list[list[int]] = mats.tolist()
    ps, qs = _factors(table, rank, p, q)
    # (P^T M)^T: MKL streams M row by row (M^T P directly was 13x slower)
    for m, pi, qi in zip(_views(acc, table, bufs), ps, qs, strict=True):
        qi.copy_(torch.mm(pi.t().contiguous(), m).t())


def finish(
    acc: torch.Tensor,
    out: torch.Tensor,
    mats: torch.Tensor,
    rank: int,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    world: int,
    bufs: Buffers,
) -> None:
    """On every matrix: ``acc`` becomes ``acc - P Q_local^T`` (the residual) and ``out`` (flat, the
    buffer's size) ``(P / world) Q_sum^T`` (the average), ``factors = (P, Q_local, Q_sum)`` flat.
    Elements outside the matrices are left alone."""
    p, q_local, q_sum = factors
    k = _kernel(mats, rank, acc, out, p, q_local, q_sum)
    if k is not None:
        lib, _, scratch = k
        tmp = bufs.get("kernel_scratch", 2 * scratch, torch.float32, acc.device)
        lib.dt_psgd_finish(
            acc.data_ptr(), out.data_ptr(), mats.data_ptr(), mats.shape[0], rank, p.data_ptr(),
            q_local.data_ptr(), q_sum.data_ptr(), world, tmp.data_ptr(),
        )  # fmt: skip
        return
    table: list[list[int]] = mats.tolist()
    ps, qls, qss = _factors(table, rank, p, q_local, q_sum)
    for (offset, size, rows, cols), x, ql, qs in zip(table, ps, qls, qss, strict=True):
        seg, dst = acc[offset : offset + size], out[offset : offset + size]
        xp = x / world  # the small factor scaled: no pass of its own
        if size == rows * cols:  # acc -= P Q^T inside the product
            seg.view(rows, cols).addmm_(x, ql.t(), alpha=-1.0)
            torch.mm(xp, qs.t(), out=dst.view(rows, cols))
        else:
            seg.sub_(_product(bufs, x, ql, rows, cols)[:size])
            dst.copy_(_product(bufs, xp, qs, rows, cols)[:size])


def _product(bufs: Buffers, x: torch.Tensor, q: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x @ q.t()`` (``rows x cols``) flat, in a reused buffer."""
    prod = bufs.get("product", rows * cols, torch.float32, x.device)
    torch.mm(x, q.t(), out=prod.view(rows, cols))
    return prod
