"""PowerSGD's three passes (dtlab.compression.powersgd_kernels): the torch fallbacks against the
products they stand for, and the compiled kernels against the fallbacks.

The kernels sum in another order than MKL (eight lanes per row, fused multiply-adds), so they agree
with the fallbacks to float32 round-off: every result within 1e-5 of its largest magnitude (a few
1e-7 seen); elements outside the compressed matrices are never touched by either.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_compression_kernels import needs_native

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import CompressedReducer, PowerSGD
from dtlab.compression import powersgd_kernels as PK
from dtlab.compression.state_io import Buffers
from dtlab.testing import run_world

# (offset, numel, rows, cols): rows not a multiple of 4, columns not a multiple of 8, a short matrix
# (a buffer zero-padded to its near-square shape: 71 * 71 > 4993), one too narrow for the rank
TABLE = [
    [0, 37 * 53, 37, 53],
    [2000, 9 * 300, 9, 300],
    [5000, 3 * 7, 3, 7],
    [6000, 4993, 71, 71],
    [11000, 2 * 100, 100, 2],
    [12000, 64 * 104, 64, 104],
]
NUMEL = 20_000
TOL = 1e-5


def _passes(acc: torch.Tensor, table: list[list[int]], rank: int, world: int) -> list[torch.Tensor]:
    """P, Q, the residual and the average of one step (``acc`` is left unchanged)."""
    acc, mats, bufs = acc.clone(), torch.tensor(table, dtype=torch.int64), Buffers()
    shapes = PK.factor_shapes(table, rank)
    n_p, n_q = sum(rows * r for rows, _, r in shapes), sum(cols * r for _, cols, r in shapes)
    g = torch.Generator().manual_seed(5)
    q, p_orth = torch.randn(n_q, generator=g), torch.randn(n_p, generator=g)
    p, q_local = torch.empty(n_p), torch.empty(n_q)
    PK.project(acc, mats, rank, q, p, bufs)
    PK.back(acc, mats, rank, p_orth, q_local, bufs)
    out = torch.full_like(acc, 7.0)
    PK.finish(acc, out, mats, rank, (p_orth, q_local, q_local * 1.5 - 0.25), world, bufs)
    return [p, q_local, acc, out]


def _matrix(acc: torch.Tensor, entry: list[int]) -> torch.Tensor:
    offset, size, rows, cols = entry
    m = torch.zeros(rows * cols)
    m[:size] = acc[offset : offset + size]
    return m.view(rows, cols)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * float(b.abs().max())


def test_fallbacks_compute_the_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    acc = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    rank, world = 3, 4
    p, q_local, res, out = _passes(acc, TABLE, rank, world)
    shapes = PK.factor_shapes(TABLE, rank)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(c * r for _, c, r in shapes), generator=g)
    p_orth = torch.randn(sum(rows * r for rows, _, r in shapes), generator=g)
    qs = PK.split(q, [(c, r) for _, c, r in shapes])
    pos = PK.split(p_orth, [(rows, r) for rows, _, r in shapes])
    ps = PK.split(p, [(rows, r) for rows, _, r in shapes])
    qls = PK.split(q_local, [(c, r) for _, c, r in shapes])
    covered = torch.zeros(NUMEL, dtype=torch.bool)
    for entry, qi, pi, po, ql in zip(TABLE, qs, ps, pos, qls, strict=True):
        offset, size, _, _ = entry
        m = _matrix(acc, entry)
        assert _close(pi, m @ qi) and _close(ql, m.t() @ po)
        approx = (po @ ql.t()).reshape(-1)[:size]
        assert _close(res[offset : offset + size], acc[offset : offset + size] - approx)
        assert _close(out[offset : offset + size], ((po / world) @ (ql * 1.5 - 0.25).t()).reshape(-1)[:size])
        covered[offset : offset + size] = True
    assert torch.equal(res[~covered], acc[~covered]) and bool((out[~covered] == 7.0).all())


@needs_native
@pytest.mark.parametrize("rank", [1, 2, 4, 5, 8, 9])
def test_kernels_match_the_fallbacks_to_round_off(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """Ranks 1-8 run the kernels (rows in blocks of 4 and 2, then one at a time), rank 9 the fallback."""
    acc = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "1")
    native = _passes(acc, TABLE, rank, 3)
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    plain = _passes(acc, TABLE, rank, 3)
    for a, b in zip(native, plain, strict=True):
        assert _close(a, b)
        if rank > 8:
            assert torch.equal(a, b)
    outside = torch.ones(NUMEL, dtype=torch.bool)
    for offset, size, _, _ in TABLE:
        outside[offset : offset + size] = False
    assert torch.equal(native[2][outside], acc[outside]) and bool((native[3][outside] == 7.0).all())


@needs_native
def test_a_matrix_too_large_for_the_cache_is_written_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """2048 x 2048 (4M elements): the average is written with streaming stores, the same values."""
    n = 2048 * 2048
    acc = torch.randn(n + 5, generator=torch.Generator().manual_seed(2))
    table = [[5, n, 2048, 2048]]  # offset 5: rows not 32-byte aligned, plain stores
    aligned = [[0, n, 2048, 2048]]
    for tab in (table, aligned):
        monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "1")
        native = _passes(acc, tab, 4, 2)
        monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
        plain = _passes(acc, tab, 4, 2)
        for a, b in zip(native, plain, strict=True):
            assert _close(a, b)


@needs_native
@pytest.mark.parametrize("rank", [4, 8, 9])
def test_the_error_feedback_pass_projects_as_project(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """add_project: ``out = a + b`` everywhere (matrices, the elements between them, after them), its
    NaN/Inf counted, and ``P`` of the sum bit for bit as :func:`project` computes it; ``None`` and
    nothing written where the kernels do not run (rank 9, or turned off)."""
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    mats, shapes = torch.tensor(TABLE, dtype=torch.int64), PK.factor_shapes(TABLE, rank)
    q = torch.randn(sum(c * r for _, c, r in shapes), generator=g)
    n_p = sum(rows * r for rows, _, r in shapes)
    fused, alone, out = torch.empty(n_p), torch.empty(n_p), torch.full((NUMEL,), 7.0)
    bad = PK.add_project(a, b, out, mats, rank, (q, fused), Buffers())
    if rank > 8:
        assert bad is None and bool((out == 7.0).all())
        return
    assert bad == 0 and torch.equal(out, a + b)
    PK.project(out, mats, rank, q, alone, Buffers())
    assert torch.equal(fused, alone)
    b[3], b[2100], b[NUMEL - 1] = float("inf"), float("nan"), float("-inf")  # a gap, a matrix, the end
    assert PK.add_project(a, b, out, mats, rank, (q, fused), Buffers()) == 3
    assert torch.equal(out.nan_to_num(), (a + b).nan_to_num())
    monkeypatch.setenv("DTLAB_NATIVE_KERNELS", "0")
    out.fill_(7.0)
    assert PK.add_project(a, b, out, mats, rank, (q, fused), Buffers()) is None and bool((out == 7.0).all())


# a conv weight (6 x 18), a bias, a linear weight (20 x 30), a skipped matrix, padding
LAYOUT: list[tuple[int, tuple[int, ...]]] = [(0, (6, 2, 3, 3)), (108, (20,)), (128, (20, 30)), (728, (3, 4))]


def _powersgd_steps(backend: CommunicationBackend) -> list[torch.Tensor]:
    red = CompressedReducer(backend, PowerSGD(rank=2, warmup_steps=1), dense_below=0, layouts={"b": LAYOUT})
    outs = []
    for step in range(5):
        grad = torch.randn(745, generator=torch.Generator().manual_seed(100 * step + backend.rank))
        red.all_reduce("b", grad).wait()
        res = red.error_feedback.residual("b")
        outs += [grad, res.clone() if res is not None else torch.zeros(0)]
    return outs


@needs_native
def test_projecting_in_the_error_feedback_pass_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """PowerSGD through the reducer (2 ranks, a dense step, then 4 compressed): ``P`` made in the
    error-feedback pass (from the third step, once ``Q`` exists and a residual is kept) gives the same
    results and residuals, bit for bit, as the separate pass."""
    import dtlab.compression.powersgd as psgd

    calls: list[int | None] = []

    def counting(*args: Any) -> int | None:
        calls.append(PK.add_project(*args))
        return calls[-1]

    monkeypatch.setattr(psgd, "add_project", counting)
    fused = run_world(2, _powersgd_steps)
    assert len(calls) == 2 * 3 and all(c == 0 for c in calls)
    monkeypatch.setattr(PowerSGD, "prefilter", lambda *_: None)
    alone = run_world(2, _powersgd_steps)
    for rank in range(2):
        for x, y in zip(fused[rank], alone[rank], strict=True):
            assert torch.equal(x, y), rank
