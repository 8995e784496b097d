"""PowerSGD per parameter: a buffer's layout splits it into matrices (compressed, each with its own
warm-started ``Q``) and everything else (sent dense), as torch's ``powerSGD_hook`` does.

Each world returns what every rank saw; the checks run on the main thread.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.compression import CompressedReducer, PowerSGD
from dtlab.compression.base import check_layout
from dtlab.errors import ConfigError
from dtlab.models import DDPModel, FSDPModel, SizePolicy, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.optimizers.compression import GradientCompressionOptimizer, bucket_layouts
from dtlab.testing import run_world

P, R = 4, 2
# a conv weight (viewed 6 x 18), a bias, a linear weight, a matrix too small to compress at rank 2
# (2 * 2 * (3 + 4) >= 12), a norm weight, then 3 padding elements
LAYOUT: list[tuple[int, tuple[int, ...]]] = [
    (0, (6, 2, 3, 3)),
    (108, (20,)),
    (128, (20, 30)),
    (728, (3, 4)),
    (740, (5,)),
]
NUMEL = 748
MATRICES = [(0, 6, 18), (128, 20, 30)]  # (offset, rows, cols) of the compressed ones
DENSE = [(108, 20), (728, 20)]  # (offset, numel): the bias; the skipped matrix, norm weight and padding


def _low_rank_grad(rank: int, step: int) -> torch.Tensor:
    """Every matrix is ``U_i C V_i^T`` with ``U_i``, ``V_i`` shared by all ranks and steps and ``C``
    (``R x R``, near the identity) drawn per rank and step: the average is exactly rank ``R``, a
    stationary subspace as the warm start assumes (a random ``C`` would make ``V^T Q`` arbitrarily
    ill-conditioned and amplify fp32 round-off by its condition number)."""
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))
    for i, (offset, rows, cols) in enumerate(MATRICES):
        u = torch.randn(rows, R, generator=torch.Generator().manual_seed(77 + i))
        v = torch.randn(cols, R, generator=torch.Generator().manual_seed(88 + i))
        noise = torch.randn(R, R, generator=torch.Generator().manual_seed(500 + 1000 * step + 10 * rank + i))
        g[offset : offset + rows * cols] = (u @ (torch.eye(R) + 0.3 * noise) @ v.t()).reshape(-1)
    return g


def _random_grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(31 + 1000 * step + rank))


def _steps(backend: CommunicationBackend, low_rank: bool, steps: int) -> list[dict[str, Any]]:
    red = CompressedReducer(backend, PowerSGD(rank=R, warmup_steps=0), dense_below=0, layouts={"b": LAYOUT})
    out = []
    for s in range(steps):
        g = _low_rank_grad(backend.rank, s) if low_rank else _random_grad(backend.rank, s)
        old = red.error_feedback.residual("b")
        acc = g + (old if old is not None else 0.0)
        dense_avg = acc.clone()
        backend.all_reduce(dense_avg, ReduceOp.SUM)  # the reference average, summed like the reducer
        dense_avg.div_(P)
        red.start_step()
        buf = g.clone()
        red.all_reduce("b", buf).wait()
        res = red.error_feedback.residual("b")
        out.append(
            {
                "acc": acc,
                "avg": dense_avg,
                "result": buf,
                "res": res.clone() if res is not None else torch.zeros(NUMEL),
                "stats": red.step_statistics(),
            }
        )
    return out


def test_state_follows_the_layout_and_the_skip_rule_per_tensor() -> None:
    state = PowerSGD(rank=R).new_state_for_layout("b", NUMEL, LAYOUT)
    assert state["matrices"].tolist() == [[o, r * c, r, c] for o, r, c in MATRICES]
    assert state["dense"].tolist() == [list(d) for d in DENSE]
    assert state["q"] is None
    # torch's rule: compress when min_compression_rate * r * (rows + cols) < rows * cols
    assert PowerSGD(rank=4).compresses(64, 64) and not PowerSGD(rank=4).compresses(5, 8)
    assert not PowerSGD(rank=4).compresses(8, 12)  # 2 * 4 * 20 = 160 >= 96
    assert PowerSGD(rank=4, min_compression_rate=1).compresses(8, 12)  # 4 * 20 = 80 < 96
    assert PowerSGD(rank=4).compresses(1000, 3) is False  # r = min(4, 3): 2 * 3 * 1003 > 3000
    only_vectors = PowerSGD(rank=R).new_state_for_layout("v", 50, [(0, (30,)), (30, (20, 1))])
    assert only_vectors["matrices"].numel() == 0 and only_vectors["dense"].tolist() == [[0, 50]]


def test_rank_r_gradients_are_reproduced_and_vectors_are_exact() -> None:
    res = run_world(P, _steps, True, 3)
    for step in range(3):  # step 0: random orthonormal Q; steps 1, 2: warm-started Q
        per_rank = [res[r][step] for r in range(P)]
        result, avg = per_rank[0]["result"], per_rank[0]["avg"]
        for r in range(1, P):
            assert torch.equal(per_rank[r]["result"], result), f"rank {r} differs at step {step}"
        for offset, rows, cols in MATRICES:
            sl = slice(offset, offset + rows * cols)
            torch.testing.assert_close(result[sl], avg[sl], rtol=1e-5, atol=1e-5, msg=f"matrix at {offset}")
            for pr in per_rank:  # nothing left behind: each rank's matrix lies in the shared basis
                assert pr["res"][sl].abs().max() < 1e-5
        for offset, size in DENSE:  # 1-D tensors, the skipped matrix and the padding: exact
            sl = slice(offset, offset + size)
            assert torch.equal(result[sl], avg[sl]), f"dense range at {offset}"
            assert all(not pr["res"][sl].any() for pr in per_rank)


def test_bytes_are_the_factors_plus_the_dense_rest_and_statistics_are_finite() -> None:
    res = run_world(P, _steps, False, 2)
    n_p = sum(R * rows for _, rows, _ in MATRICES) + sum(size for _, size in DENSE)  # 1st all-reduce
    n_q = sum(R * cols for _, _, cols in MATRICES)  # 2nd all-reduce
    flag = 2 * (P - 1) * 4 * P // P  # the reducer's non-finite check: P int32 all-reduced
    expected = 2 * (P - 1) * 4 * n_p // P + 2 * (P - 1) * 4 * n_q // P + flag
    sent = n_p + n_q
    assert sent == R * (6 + 18) + R * (20 + 30) + 40
    for rank in res:
        for step in rank:
            st = step["stats"]
            assert st["bytes_sent"] == expected, (st, expected)
            assert st["local_density"] == st["density"] == sent / NUMEL
            assert st["compression_ratio"] == 2 * (P - 1) * 4 * NUMEL // P / expected
            assert not any(isinstance(v, float) and math.isnan(v) for v in st.values()), st


def test_full_rank_gradients_conserve_mass_with_error_feedback() -> None:
    res = run_world(P, _steps, False, 4)
    for step in range(4):
        per_rank = [res[r][step] for r in range(P)]
        result = per_rank[0]["result"]
        assert all(torch.equal(pr["result"], result) for pr in per_rank)
        torch.testing.assert_close(
            P * result + sum(pr["res"] for pr in per_rank),
            sum(pr["acc"] for pr in per_rank),
            rtol=1e-5,
            atol=1e-5,
        )
        for offset, rows, cols in MATRICES:  # per parameter: each matrix of the result has rank <= R
            m = result[offset : offset + rows * cols].view(rows, cols)
            assert int(torch.linalg.matrix_rank(m)) == R
            assert not torch.allclose(m, per_rank[0]["avg"][offset : offset + rows * cols].view(rows, cols))
            assert all(pr["res"][offset : offset + rows * cols].abs().sum() > 0 for pr in per_rank)


def _reduce_scatter(backend: CommunicationBackend) -> dict[str, Any]:
    """A layout whose second matrix crosses the shard boundary at P = 4 (187 elements per shard)."""
    red = CompressedReducer(backend, PowerSGD(rank=R, warmup_steps=0), dense_below=0, layouts={"b": LAYOUT})
    red_vec = CompressedReducer(
        backend, PowerSGD(rank=R, warmup_steps=0), dense_below=0, layouts={"v": [(0, (8,))]}
    )
    g = _low_rank_grad(backend.rank, 0)
    shard = torch.empty(NUMEL // P)
    red.reduce_scatter("b", g.clone(), shard).wait()
    avg = g.clone()
    backend.all_reduce(avg, ReduceOp.SUM)
    vec = torch.zeros(NUMEL // P)
    red_vec.reduce_scatter("v", torch.arange(8.0).repeat(NUMEL // 8 + 1)[:NUMEL].contiguous(), vec).wait()
    return {
        "shard": shard,
        "avg": avg / P,
        "stats": red.step_statistics(),
        "vec_stats": red_vec.step_statistics(),
    }


def test_reduce_scatter_hands_each_rank_its_shard_of_the_low_rank_average() -> None:
    res = run_world(P, _reduce_scatter)
    full = torch.cat([r["shard"] for r in res])
    torch.testing.assert_close(full, res[0]["avg"], rtol=1e-5, atol=1e-5)
    for r in res:
        assert r["stats"]["reduce_scatter_calls"] == 1
        vs = r["vec_stats"]  # nothing to compress: a plain dense reduce-scatter (+ the non-finite check)
        assert vs["bytes_sent"] == (P - 1) * NUMEL * 4 // P + 2 * (P - 1) * 4
        assert vs["density"] == 1.0


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 10), nn.LayerNorm(10))


def _strategy_layouts(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("ddp", "zero3", "fsdp"):
        if kind == "ddp":
            opt: Any = DDPOptimizer(DDPModel(_net(), backend), torch.optim.SGD, lr=0.1)
        elif kind == "zero3":
            opt = ZeRO3Optimizer(
                ZeRO3Model(_net(), backend, persistence_threshold=0), torch.optim.SGD, lr=0.1
            )
        else:
            fsdp = FSDPModel(_net(), backend, wrap_policy=SizePolicy(min_num_params=100))
            opt = ZeRO3Optimizer(fsdp, torch.optim.SGD, lr=0.1)
        wrapped = GradientCompressionOptimizer(opt, PowerSGD(rank=1, warmup_steps=0), dense_below=0)
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(backend.rank))
        wrapped.zero_grad()
        wrapped.model.train_step((x, torch.zeros(4, dtype=torch.long)), nn.functional.cross_entropy)
        wrapped.step()
        states = wrapped.reducer._states
        out[kind] = {
            "layouts": bucket_layouts(wrapped.model),
            "matrices": {k: s["matrices"].tolist() for k, s in states.items()},
            "params": {k: v.clone() for k, v in wrapped.model.full_state_dict().items()},
            "stats": wrapped.statistics,
        }
    return out


def test_strategies_hand_their_bucket_layouts_to_the_compressor() -> None:
    res = run_world(2, _strategy_layouts)
    shapes = {(4, 2, 3, 3), (4,), (10, 64), (10,)}
    for kind in ("ddp", "zero3", "fsdp"):
        layouts = res[0][kind]["layouts"]
        assert {s for layout in layouts.values() for _, s in layout} == shapes, (kind, layouts)
        matrices = [m for ms in res[0][kind]["matrices"].values() for m in ms]
        # the conv weight (4 x 18) and the linear weight (10 x 64) are compressed, nothing else
        assert sorted((rows, cols) for _, _, rows, cols in matrices) == [(4, 18), (10, 64)], kind
        for name, t in res[0][kind]["params"].items():
            assert torch.equal(res[1][kind]["params"][name], t), (kind, name)
        assert res[0][kind]["stats"]["bytes_sent"] < res[0][kind]["stats"]["dense_bytes"], kind


def test_bad_layouts_and_settings_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="offset 10 with shape \\(3, 4\\)"):
        check_layout([(0, (4, 4)), (10, (3, 4))], 100, "b")  # overlaps the previous parameter
    with pytest.raises(ConfigError, match="in \\[16, 20\\)"):
        check_layout([(0, (4, 4)), (16, (5,))], 20, "b")  # runs past the buffer
    with pytest.raises(ConfigError, match="min_compression_rate"):
        PowerSGD(min_compression_rate=0.5)
    with pytest.raises(ConfigError, match="rank must be"):
        PowerSGD(rank=0)


def _sync_world(backend: CommunicationBackend) -> list[dict[str, torch.Tensor]]:
    from dtlab.compression import GradientSynchronizer

    sync = GradientSynchronizer(PowerSGD(rank=R, warmup_steps=0), backend, dense_below=0)
    out = []
    for step in range(3):
        flat = _low_rank_grad(backend.rank, step)
        grads = {f"p{i}": flat[o : o + math.prod(s)].view(s).clone() for i, (o, s) in enumerate(LAYOUT)}
        out.append(sync.sync(grads))
    assert sync.reducer.layouts["gradients"] == LAYOUT, sync.reducer.layouts
    return out


def test_gradient_synchronizer_passes_each_gradient_shape_to_powersgd() -> None:
    """With the layout, every exactly-rank-R matrix comes back as the exact average (no residual); a
    whole-buffer matrix (no layout) would not be low rank and could not."""
    results = run_world(P, _sync_world, timeout=60)
    for step in range(3):
        for i, (o, s) in enumerate(LAYOUT):
            want = sum(_low_rank_grad(r, step)[o : o + math.prod(s)] for r in range(P)).view(s) / P
            for rank in range(P):
                got = results[rank][step][f"p{i}"]
                assert got.shape == torch.Size(s)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
