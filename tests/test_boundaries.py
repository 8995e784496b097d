"""Boundaries: selection at exact ties (thresholds, top-k, the distributed k-th largest, Ok-Topk's
reused thresholds and its region boundaries), and strategies on shards that are empty, one element
long, or uneven because the world size does not divide the tensor (plain SGD against one process)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from filled import filled
from steps import plain_steps
from test_strategies_helpers import STRATEGIES, max_rel_error
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import GaussianK, GTopk, OkTopk, TopkA, TopkDSA
from dtlab.compression.kernels import indices_above
from dtlab.compression.oktopk import GLOBAL_RAISE, LOCAL_SCALE
from dtlab.compression.sparse import (
    GATHER_BELOW,
    Magnitudes,
    distributed_kth_largest,
    local_topk,
    select_by_threshold,
    split_and_reduce,
)
from dtlab.models import FSDPModel, ModuleClassPolicy
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world


# ------------------------------------------------------------------------------------ exact ties
def test_threshold_selection_keeps_every_exact_tie() -> None:
    acc = torch.tensor([0.5, -2.0, 2.0, 0.0, 1.999, -0.5, 2.0, 3.0, -2.0])
    ties_and_above = torch.tensor([1, 2, 6, 7, 8])
    work = Magnitudes()
    assert torch.equal(work.above(work.of(acc), 2.0), ties_and_above)
    assert torch.equal(Magnitudes().above(acc.abs(), 2.0), ties_and_above)  # without the reused mask
    assert torch.equal(select_by_threshold(acc, 2.0), ties_and_above)
    for dtype in (torch.float32, torch.float64):  # the native kernel (float32) and the torch fallback
        assert torch.equal(indices_above(acc.to(dtype), 2.0), ties_and_above), dtype
    nonzero = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])
    assert torch.equal(work.above(work.of(acc), 0.0), nonzero)  # threshold 0: every nonzero
    assert torch.equal(select_by_threshold(acc, 0.0), nonzero)
    assert torch.equal(select_by_threshold(acc, 0.5), nonzero)  # 0.5 and -0.5 are ties too


def test_local_topk_at_ties_and_degenerate_sizes() -> None:
    acc = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.0])
    idx, kth = local_topk(acc, 3)
    assert torch.equal(idx, torch.tensor([1, 2, 4])) and kth == 3.0
    idx, kth = local_topk(acc, 2)  # two of the three tied 3.0s, the k-th magnitude is the tie
    assert idx.numel() == 2 and kth == 3.0 and bool((acc[idx].abs() == 3.0).all())
    idx, kth = local_topk(acc, 10)  # k beyond the size: every nonzero, zeros never selected
    assert torch.equal(idx, torch.tensor([0, 1, 2, 3, 4])) and kth == 1.0
    idx, kth = local_topk(torch.tensor([-4.0]), 1)  # one element
    assert torch.equal(idx, torch.tensor([0])) and kth == 4.0
    idx, kth = local_topk(torch.zeros(3), 2)  # nothing to select
    assert idx.numel() == 0 and kth == 0.0


def _kth(backend: CommunicationBackend, values: list[torch.Tensor], k: int) -> float:
    return distributed_kth_largest(backend, values[backend.rank], k)


def test_distributed_kth_largest_at_ties_gathered_and_by_radix() -> None:
    # few candidates (gathered) and many (radix select over float bits): ties straddling ranks
    for n in (5, GATHER_BELOW):
        mine = [torch.full((n,), 2.0), torch.cat([torch.full((n,), 2.0), torch.full((n,), 1.0)])]
        for k, want in ((1, 2.0), (2 * n, 2.0), (2 * n + 1, 1.0), (3 * n, 1.0), (10 * n, 1.0)):
            assert run_world(2, _kth, mine, k) == [want, want], (n, k)
    # bytes of 0xFF in the float bits (0.99999994 is 0x3F7FFFFF): every digit of the radix counts
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    mine = [torch.full((600,), float(below_one)), torch.full((600,), 0.5)]
    for k, want in ((1, float(below_one)), (600, float(below_one)), (601, 0.5)):
        assert run_world(2, _kth, mine, k) == [want, want], k
    empty = [torch.zeros(0), torch.zeros(4)]
    assert run_world(2, _kth, empty, 3) == [0.0, 0.0]  # nothing positive anywhere


def _oktopk_reuse(backend: CommunicationBackend, n: int, k: int, tied: int) -> tuple[Any, Any, Any]:
    """Step 1 recomputes the thresholds on distinct magnitudes (the k-th is 1.0); step 2 reuses them
    on a buffer whose ``tied`` selected entries all sit exactly at 1.0 (every rank the same buffers)."""
    comp = OkTopk(density=k / n, tau=100, tau_prime=100, warmup_steps=0)
    state = comp.new_state("g", n)
    first = torch.linspace(2.0, 0.01, n)
    first[k - 1] = 1.0
    first[k:] = first[k:].clamp(max=0.5)
    comp.all_reduce(state, first, backend)
    assert state["local_thr"] == 1.0 and state["global_thr"] == float(backend.world_size)
    second = torch.zeros(n)
    ties = torch.arange(1, n, 2)[:tied]  # entries at exactly +-1.0, spread over every region
    second[ties] = torch.where(ties % 4 == 1, 1.0, -1.0)
    second[0] = 0.999  # just below: never selected
    ex = comp.all_reduce(state, second, backend)
    return ties, ex, (state["local_thr"], state["global_thr"])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_oktopk_reused_thresholds_keep_exact_ties(world_size: int) -> None:
    """k ties: all selected, thresholds kept; 11 ties for k = 8 (more than 5k/4): all selected, and
    both thresholds raised by the reference code's factors for the next iteration."""
    n, k = 80, 8
    for tied, scale in ((k, (1.0, 1.0)), (11, (LOCAL_SCALE, GLOBAL_RAISE))):
        for ties, ex, (local, global_) in run_world(world_size, _oktopk_reuse, n, k, tied):
            assert ex.result_indices is not None and ex.result_values is not None
            assert torch.equal(ex.result_indices, ties), ex.result_indices
            assert torch.equal(ex.result_values, torch.where(ties % 4 == 1, 1.0, -1.0))
            assert local == pytest.approx(scale[0], rel=1e-12), (tied, local)
            assert global_ == pytest.approx(world_size * scale[1], rel=1e-12), (tied, global_)


def _picks(n: int, bounds: list[int], rank: int) -> torch.Tensor:
    """Indices at each inner boundary and just before it, and both ends (every other one on odd
    ranks, so the ranks' selections differ)."""
    edges = {0, n - 1} | {b for b in bounds[1:-1]} | {b - 1 for b in bounds[1:-1]}
    picks = sorted(i for i in edges if 0 <= i < n)
    return torch.tensor(picks[rank % 2 :: 1 + rank % 2], dtype=torch.int64)


def _split(backend: CommunicationBackend, n: int, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.arange(n, dtype=torch.float32) + 100.0 * (backend.rank + 1)
    idx = _picks(n, bounds, backend.rank)
    ridx, rvals = split_and_reduce(backend, acc, idx, bounds)
    return ridx + bounds[backend.rank], rvals


def test_region_boundaries_send_each_index_to_exactly_one_owner() -> None:
    """Indices exactly at a region boundary and just before it; an empty region; regions of one."""
    n = 10
    for bounds in ([0, 4, 7, n], [0, 4, 4, n], [0, 1, 2, n], [0, 0, n, n]):
        out = run_world(3, _split, n, bounds)
        expected = torch.zeros(n)
        for r in range(3):
            idx = _picks(n, bounds, r)
            expected[idx] += (torch.arange(n, dtype=torch.float32) + 100.0 * (r + 1))[idx]
        got = torch.zeros(n)
        for r, (gidx, vals) in enumerate(out):
            assert bool(((gidx >= bounds[r]) & (gidx < bounds[r + 1])).all()), (bounds, r, gidx)
            got[gidx] += vals
        assert torch.equal(got, expected), bounds


# ------------------------------------------------------------------ empty and one-element shards
def _odd_module() -> nn.Module:
    """Parameters of 1, 3, 5 and 7 elements: shards of one element, uneven and empty ones."""
    module = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 3), nn.Tanh(), nn.Linear(3, 1))
    return filled(module, 3, scale=0.5, shift=0.3)


def _odd_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(3, 12, 1, generator=g), torch.randn(3, 12, 1, generator=g)


def _wrap(name: str, backend: CommunicationBackend) -> tuple[Any, Any]:
    from dtlab.models import DDPModel, ZeRO1Model, ZeRO2Model, ZeRO3Model

    module = _odd_module()
    if name == "fsdp":
        model: Any = FSDPModel(module, backend, wrap_policy=ModuleClassPolicy((nn.Linear,)))
    elif name == "zero3":
        model = ZeRO3Model(module, backend, persistence_threshold=0)
    else:
        model = {"ddp": DDPModel, "zero1": ZeRO1Model, "zero2": ZeRO2Model}[name](module, backend)
    cls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(name, ZeRO3Optimizer)
    return model, cls(model, torch.optim.SGD, lr=0.2)


def _train_odd(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    x, y = _odd_data()
    p, r = backend.world_size, backend.rank
    lo, hi = 12 * r // p, 12 * (r + 1) // p  # 12 samples: 5 ranks get 2 or 3 each
    out = {}
    for name in STRATEGIES:
        model, opt = _wrap(name, backend)
        # sum over the local samples / the global count: uneven local batches average correctly
        batches = zip(x[:, lo:hi], y[:, lo:hi], strict=True)
        plain_steps(
            model, opt, batches, lambda out, t: nn.functional.mse_loss(out, t, reduction="sum") * (p / 12)
        )
        out[name] = model.full_state_dict()
    return out


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_strategies_on_one_element_empty_and_uneven_shards(world_size: int) -> None:
    x, y = _odd_data()
    ref_module = _odd_module()
    opt = torch.optim.SGD(ref_module.parameters(), lr=0.2)
    for s in range(x.shape[0]):
        nn.functional.mse_loss(ref_module(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().clone() for k, v in ref_module.state_dict().items()}
    assert max_rel_error(_odd_module().state_dict(), ref) > 0.01
    for rank, runs in enumerate(run_world(world_size, _train_odd, timeout=60)):
        for name, state in runs.items():
            err = max_rel_error(state, ref)
            assert err <= 1e-5, f"{name} on {world_size} ranks, rank {rank}: relative error {err:.2e}"


# ------------------------------------------------------------- fewer nonzeros than k, empty ranks
def _sparse_gradients(backend: CommunicationBackend, algo: type, n: int, k: int) -> Any:
    """Rank 0 all zeros, rank 1 fewer nonzeros than k, the others dense."""
    comp = algo(density=k / n) if algo is not OkTopk else OkTopk(density=k / n, warmup_steps=0)
    g = torch.Generator().manual_seed(backend.rank)
    acc = torch.randn(n, generator=g)
    if backend.rank == 0:
        acc.zero_()
    elif backend.rank == 1:
        acc[k // 2 :] = 0.0
    t0 = time.perf_counter()
    ex = comp.all_reduce(comp.new_state("g", n), acc.clone(), backend)
    # the selection time reported in the statistics is a part of the call's own time
    assert 0.0 <= ex.select_seconds <= time.perf_counter() - t0, ex.select_seconds
    if ex.result is not None:
        return acc, ex.result
    assert ex.result_indices is not None and ex.result_values is not None
    out = torch.zeros(n)
    out[ex.result_indices] = ex.result_values
    return acc, out


@pytest.mark.parametrize("algo", [TopkA, TopkDSA, GTopk, GaussianK, OkTopk])
def test_sparse_compressors_with_empty_and_short_selections(algo: type) -> None:
    n, k, p = 200, 20, 4
    results = run_world(p, _sparse_gradients, algo, n, k)
    first = results[0][1]
    for _, result in results:
        assert torch.equal(result, first)  # every rank the same average
    accs = [a for a, _ in results]
    nonzero = torch.stack(accs).ne(0).any(0)
    assert bool((first[~nonzero] == 0).all())  # nothing where every rank's gradient is zero
    if algo in (TopkA, TopkDSA):  # exact: the average of each rank's (nonzero) top-k
        expected = torch.zeros(n)
        for a in accs:
            top = torch.topk(a.abs(), k).indices
            top = top[a[top] != 0]
            expected[top] += a[top]
        torch.testing.assert_close(first, expected / p, rtol=0, atol=1e-7)


def _topkdsa_form(backend: CommunicationBackend, density: float) -> tuple[bool, int]:
    n = 400
    acc = torch.randn(n, generator=torch.Generator().manual_seed(backend.rank))
    ex = TopkDSA(density=density).all_reduce(TopkDSA(density=density).new_state("g", n), acc, backend)
    assert ex.global_selected is not None
    return ex.result is not None, ex.global_selected


def test_topkdsa_gathers_densely_exactly_when_the_union_reaches_half() -> None:
    """Its all-gather phase sends the reduced regions as dense values once the union of the ranks'
    selections covers half the buffer (cheaper than index/value pairs), sparse pairs below."""
    for density in (0.05, 0.15, 0.3):
        for dense, union in run_world(4, _topkdsa_form, density):
            assert dense == (2 * union >= 400), (density, union)
    assert run_world(4, _topkdsa_form, 0.3)[0][0] and not run_world(4, _topkdsa_form, 0.05)[0][0]


def test_gaussiank_adjusts_a_heavy_tailed_selection_into_range() -> None:
    """Laplace-distributed values: the Gaussian-predicted threshold selects about 1.37 k at density
    0.04 (and about 2.6 k at 0.01); the adjustment brings every selection into [3k/4, 5k/4]."""
    n = 20_000
    g = torch.Generator().manual_seed(5)
    u = torch.rand(n, generator=g) - 0.5
    acc = -torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 1)
    for density in (0.04, 0.01, 0.1):
        comp = GaussianK(density=density)
        k = comp.k(n)
        idx, thr = comp.threshold(acc, Magnitudes())
        assert 3 * k // 4 <= idx.numel() <= 5 * k // 4, (density, idx.numel(), k)
        assert torch.equal(idx, select_by_threshold(acc, thr))  # exactly the entries at or above it


def test_feed_counts_epochs_at_their_boundary() -> None:
    """8 samples, global batch 4 over 2 ranks: 2 steps per epoch; the 5th step opens the third epoch
    (index 2), and each epoch visits every sample once, in that epoch's own shuffled order."""
    from dtlab.data import TensorDataset
    from dtlab.trainers.feed import DataFeed

    data = TensorDataset(torch.arange(8.0).view(8, 1), torch.arange(8))
    feeds = [DataFeed(data, 4, 2, r, 1, seed=3, shuffle=True) for r in range(2)]
    seen: list[list[int]] = [[], [], []]
    for step in range(6):
        for feed in feeds:
            ((x, _),) = feed.next_micro_batches()
            seen[step // 2] += x.view(-1).long().tolist()
            assert feed.state_dict()["epoch"] == step // 2, (step, feed.state_dict())
    assert all(sorted(s) == list(range(8)) for s in seen)
    assert len({tuple(s) for s in seen}) > 1  # the order changes with the epoch
