"""Reduce-scatter semantics (ZeRO-2/3, FSDP), random-k coverage and the dense path's reduce dtype.

In-memory ranks; each test groups its checks into one world and checks on the main thread.
"""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import (
    BF16,
    QSGD,
    CompressedReducer,
    Compressor,
    Dense,
    GaussianK,
    GTopk,
    OkTopk,
    PowerSGD,
    RandomK,
    TopkA,
    TopkDSA,
)
from dtlab.compression.randomk import uniform_subset
from dtlab.models import DDPModel
from dtlab.optimizers import DDPOptimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer
from dtlab.testing import run_world

P, N = 4, 8000


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 1009 + step * 7 + 11)
    return torch.randn(n, generator=g) * torch.linspace(0.1, 2.0, n)


def _local_topk(acc: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(acc.abs(), k).indices
    out = torch.zeros_like(acc)
    out[idx] = acc[idx]
    return out


def _scatter_steps(backend: CommunicationBackend, comp: Compressor, steps: int) -> list[dict[str, Any]]:
    """Per step: acc, this rank's averaged shard, new residual, statistics, bytes of the call."""
    red = CompressedReducer(backend, comp, dense_below=0)
    out = []
    for s in range(steps):
        g = _grad(backend.rank, s, N)
        res = red.error_feedback.residual("g")
        acc = g + (res if res is not None else 0.0)
        shard = torch.empty(N // P)
        red.start_step()
        red.reduce_scatter("g", g.clone(), shard).wait()
        new = red.error_feedback.residual("g")
        out.append(
            {
                "acc": acc,
                "shard": shard,
                "res": new.clone() if new is not None else torch.zeros(N),
                "stats": red.step_statistics(),
            }
        )
    return out


COMPRESSORS: list[Compressor] = [
    TopkA(density=0.02),
    TopkDSA(density=0.02),
    GTopk(density=0.02),
    GaussianK(density=0.02),
    OkTopk(density=0.02, warmup_steps=1, tau=2, tau_prime=2),
    RandomK(density=0.02),
    QSGD(levels=15),
    PowerSGD(rank=2, warmup_steps=1),
    BF16(),
    Dense(),
]


def test_reduce_scatter_conserves_mass_for_every_compressor() -> None:
    """The concatenated shards are one averaged gradient; applied + residuals == gradients + old residuals."""
    for comp in COMPRESSORS:
        res = run_world(P, _scatter_steps, comp, 4)
        for step in range(4):
            per_rank = [res[r][step] for r in range(P)]
            full = torch.cat([r["shard"] for r in per_rank])
            assert torch.isfinite(full).all(), comp.name
            lhs = P * full + sum(r["res"] for r in per_rank)
            tol = 0.1 if comp.name == "cast" else 1e-4  # bf16 rounds the sum itself
            torch.testing.assert_close(lhs, sum(r["acc"] for r in per_rank), rtol=tol, atol=tol)
            for r in per_rank:
                stats = r["stats"]
                assert stats["reduce_scatter_calls"] == stats["calls"] == 1, (comp.name, stats)
                assert stats["dense_bytes"] == (P - 1) * N * 4 // P  # a dense reduce-scatter


def test_sparse_reduce_scatter_is_the_shard_of_the_local_topk_average_and_skips_the_gather() -> None:
    """TopkDSA and Ok-Topk (after warm-up): each owner's shard is exactly its part of the average of every
    rank's local top-k (the sparse split-and-reduce) and nothing else travels: far fewer bytes than the
    all-reduce, which adds the gather phase."""
    k = int(0.02 * N)
    for comp in (TopkDSA(density=0.02), OkTopk(density=0.02, warmup_steps=1, tau=3)):
        res = run_world(P, _scatter_steps, comp, 5)
        for step in range(comp.warmup_steps, 5):
            per_rank = [res[r][step] for r in range(P)]
            full = torch.cat([r["shard"] for r in per_rank])
            if comp.name == "topkdsa" or (step - comp.warmup_steps) % comp.tau == 0:  # type: ignore[attr-defined]
                expected = sum(_local_topk(r["acc"], k) for r in per_rank) / P
                torch.testing.assert_close(full, expected, rtol=0, atol=1e-7)
            # split-and-reduce only: a rank sends at most its own selection (8 bytes a pair), the count
            # exchange and the non-finite check; no gather of the result (~k(P-1)/P pairs more)
            for r in per_rank:
                st = r["stats"]
                meta = 8 * P * P + 8 * P  # all-gather of P int64 counts, the non-finite check
                assert st["bytes_sent"] <= st["local_density"] * N * 8 + meta, (comp.name, step, st)
                assert "density" not in r["stats"] and r["stats"]["local_density"] > 0
                # the statistics say which algorithm ran: Ok-Topk's reduced form, after its warm-up
                assert ("variant" in st) == (comp.name == "oktopk"), st
            if comp.name == "oktopk":
                assert "boundary balancing" in res[0][step]["stats"]["variant"]
        assert "variant" not in res[0][0]["stats"]  # the dense warm-up step is plain dense


def test_random_k_reaches_every_element() -> None:
    """Random-k must draw every index alike (taking the k smallest of the draws starved the buffer's end)."""
    n, k = 10_000, 100
    gen = torch.Generator().manual_seed(1)
    hits = torch.zeros(n)
    for _ in range(500):
        idx = uniform_subset(n, k, gen)
        assert idx.numel() == k and torch.equal(idx, torch.unique(idx))  # k distinct, sorted
        hits[idx] += 1
    tenths = hits.view(10, -1).sum(dim=1)  # expected 5000 per tenth (std ~ 67)
    assert tenths.min() > 4500 and tenths.max() < 5500, tenths.tolist()
    for k_dense in (n // 2, n):  # the permutation path
        idx = uniform_subset(n, k_dense, gen)
        assert idx.numel() == k_dense and torch.unique(idx).numel() == k_dense


def _net() -> nn.Module:
    return filled(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), 0, scale=0.3)


def _reduce_dtype_world(backend: CommunicationBackend, wrap: bool) -> dict[str, torch.Tensor]:
    model = DDPModel(_net(), backend, reduce_dtype=torch.float16)
    opt: Any = DDPOptimizer(model, torch.optim.SGD, lr=0.3)
    if wrap:
        opt = GradientCompressionOptimizer(opt, Dense())
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + backend.rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        model.train_step((x, y), nn.functional.cross_entropy)
        opt.step()
    return {k: v.detach().clone() for k, v in model.full_state_dict().items()}


def test_dense_through_compression_keeps_the_strategy_reduce_dtype() -> None:
    """A float16 reduce dtype rounds the sums: Dense through compression must round them the same way."""
    plain = run_world(2, _reduce_dtype_world, False)[0]
    wrapped = run_world(2, _reduce_dtype_world, True)[0]
    for name, t in plain.items():
        assert torch.equal(wrapped[name], t), name
