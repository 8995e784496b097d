"""Collective rounds of one Ok-Topk call, counted exactly from the backend's per-kind call counters.

The non-finite check's counts travel with the split-and-reduce's region sizes, so a compressed
Ok-Topk call has no all-reduce of its own for them. The folded path gives bit-identical results and
exactly the bytes of the separate check (one int64 more per rank in the count all-gather, against an
all-reduce of ``P`` int32), and a non-finite gradient on one rank is decided on every rank before any
entry moves: raised everywhere, or skipped with the residual and the compressor's state untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.compression import CompressedReducer, NonFiniteGradientError, OkTopk
from dtlab.compression.finite import FiniteCheck
from dtlab.testing import run_world

P, N, TAU, TAU_PRIME = 4, 40000, 4, 8


def _grad(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 + rank)
    return torch.randn(n, generator=g) * torch.linspace(0.1, 2.0, n)


def _no_nonfinite(per_rank: list[int]) -> None:
    raise AssertionError(f"unexpected non-finite values {per_rank}")


def _calls(backend: CommunicationBackend) -> dict[str, int]:
    return {k: v["calls"] for k, v in backend.stats.snapshot().items()}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _rounds_world(backend: CommunicationBackend, steps: int) -> list[dict[str, Any]]:
    """Per step: collective calls and bytes of a reducer call, and of the separate check followed by
    the compressor's own call on the same input (the path before the counts were folded)."""
    # no error feedback: the same input every step, so no guard fires and the counts are exact
    comp = OkTopk(density=0.05, tau=TAU, tau_prime=TAU_PRIME, warmup_steps=1, error_feedback=False)
    red = CompressedReducer(backend, comp, dense_below=0)
    state = comp.new_state("g", N)
    out = []
    for step in range(steps):
        grad = _grad(backend.rank, N)
        c0, b0 = _calls(backend), backend.stats.bytes_sent
        red.start_step()
        red.all_reduce("g", grad).wait()
        c1, b1 = _calls(backend), backend.stats.bytes_sent
        row: dict[str, Any] = {"calls": _delta(c1, c0), "bytes": b1 - b0, "result": grad}
        if step >= 1:  # compressed: the same call with the check's own all-reduce first
            acc = _grad(backend.rank, N)
            FiniteCheck(0, _no_nonfinite).exchange(backend)
            ex = comp.all_reduce(state, acc, backend)
            ref = torch.zeros(N)
            ex.write(ref)
            row.update(
                ref=ref, ref_calls=_delta(_calls(backend), c1), ref_bytes=backend.stats.bytes_sent - b1
            )
        shard = torch.empty(N // backend.world_size)
        c2 = _calls(backend)
        red.reduce_scatter("s", _grad(backend.rank, N), shard).wait()
        row["rs_calls"] = _delta(_calls(backend), c2)
        out.append(row)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_oktopk_call_rounds_are_counted_exactly(world_size: int) -> None:
    steps = 1 + 2 * TAU_PRIME + 1
    for rank in run_world(world_size, _rounds_world, steps):
        warm = rank[0]["calls"]  # dense warm-up: the check's all-reduce, then the dense one
        assert warm == {"all_reduce": 2}, warm
        for t, row in enumerate(rank[1:]):  # t: the compressor's own iteration count
            calls = row["calls"]
            p2p = {k: calls.pop(k) for k in ("send", "recv") if k in calls}
            assert 0 < p2p.get("send", 0) <= 2 * (world_size - 1) and 0 < p2p.get("recv", 0) <= 2 * (
                world_size - 1
            )
            recompute, repartition = t % TAU == 0, t % TAU_PRIME == 0
            # all-gathers: region sizes with the check's count, keep counts (or the radix select's
            # count and the balancing counts), the balanced blocks; all-reduces: boundary proposals,
            # four radix-select histograms; nothing else
            # (two ranks: one point-to-point exchange instead of balancing and the block all-gather)
            gathers = (4 if recompute else 3) - (world_size == 2)
            reduces = 4 * recompute + repartition
            assert calls == ({"all_gather": gathers} | ({"all_reduce": reduces} if reduces else {})), (
                t,
                calls,
            )
            ref = dict(row["ref_calls"])
            ref["all_reduce"] = ref.get("all_reduce", 0) - 1  # the separate check
            assert {k: v for k, v in ref.items() if v} == {k: v for k, v in row["calls"].items() if v} | p2p
            assert row["bytes"] == row["ref_bytes"], (t, row["bytes"], row["ref_bytes"])
            assert torch.equal(row["result"], row["ref"]), t
            # reduce-scatter semantics: only the split-and-reduce (its count all-gather carries the check)
            rs = {k: v for k, v in row["rs_calls"].items() if k not in ("send", "recv")}
            assert rs == {"all_gather": 1}, (t, row["rs_calls"])


def _nonfinite_world(
    backend: CommunicationBackend, policy: str, bad_step: int, clean: bool
) -> dict[str, Any]:
    """Steps 0..5 of Ok-Topk (tau=2, tau_prime=2: reused and recomputed thresholds, new regions);
    at ``bad_step`` rank 2's gradient holds a NaN and an Inf (``clean``: that step is left out).
    A bad step sends nothing and changes no state, so what comes after is the same either way."""
    comp = OkTopk(density=0.05, tau=2, tau_prime=2, warmup_steps=1)
    red = CompressedReducer(backend, comp, dense_below=0, nonfinite=policy)  # type: ignore[arg-type]
    out: dict[str, Any] = {"results": [], "error": None}
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + backend.rank)
        grad = torch.randn(N, generator=g)
        if step == bad_step:
            if clean:
                continue
            if backend.rank == 2:
                grad[5], grad[N - 7] = float("nan"), float("inf")
            red.start_step()
            try:
                red.all_reduce("g", grad).wait()
            except NonFiniteGradientError as exc:
                out["error"] = exc
            out["bad_out"], out["stats"] = grad, red.step_statistics()
            continue
        red.all_reduce("g", grad).wait()
        out["results"].append(grad)
    out["residual"] = red.error_feedback.residual("g")
    return out


def test_oktopk_nonfinite_is_decided_everywhere_before_anything_moves() -> None:
    for bad_step in (2, 3):  # a reused-threshold step, and one recomputing thresholds and regions
        clean = run_world(P, _nonfinite_world, "skip", bad_step, True)
        skipped = run_world(P, _nonfinite_world, "skip", bad_step, False)
        raised = run_world(P, _nonfinite_world, "raise", bad_step, False)
        for c, s, r in zip(clean, skipped, raised, strict=True):
            assert s["error"] is None and torch.isnan(s["bad_out"]).all()
            assert s["stats"]["nonfinite_values"] == 2 and s["stats"]["nonfinite_keys"] == ["g"]
            # every rank raises the same error (no hang)
            assert isinstance(r["error"], NonFiniteGradientError), r["error"]
            assert "rank 2: 2" in str(r["error"]) and r["error"].counts == [0, 0, 2, 0]
            for run in (s, r):  # nothing sent, residual and compressor state as they were
                assert len(run["results"]) == len(c["results"]) == 5
                assert all(torch.equal(a, b) for a, b in zip(c["results"], run["results"], strict=True))
                assert torch.equal(c["residual"], run["residual"])


def _gather_world(backend: CommunicationBackend, counts: list[int]) -> dict[str, Any]:
    from dtlab.compression.sparse import balanced_all_gather

    me = backend.rank
    idx = torch.arange(counts[me], dtype=torch.int64) * 7 + 1000 * me
    vals = torch.arange(counts[me], dtype=torch.float32) + 0.5 * me
    b0 = backend.stats.bytes_sent
    gidx, gvals = balanced_all_gather(backend, idx, vals, counts)
    return {"idx": gidx, "vals": gvals, "sent": backend.stats.bytes_sent - b0}


def test_balanced_all_gather_concatenates_in_rank_order_within_its_bytes() -> None:
    for counts in ([300, 100], [0, 5], [7, 0], [50, 50], [1, 0, 40, 3], [10, 10, 10, 10]):
        p, total = len(counts), sum(counts)
        block = -(-total // p)
        want_idx = torch.cat(
            [torch.arange(c, dtype=torch.int64) * 7 + 1000 * r for r, c in enumerate(counts)]
        )
        want_vals = torch.cat([torch.arange(c, dtype=torch.float32) + 0.5 * r for r, c in enumerate(counts)])
        for r, got in enumerate(run_world(p, _gather_world, counts)):
            assert torch.equal(got["idx"], want_idx) and torch.equal(got["vals"], want_vals), (counts, r)
            excess = max(0, counts[r] - block)  # balancing, then the block all-gather
            assert got["sent"] <= 8 * (excess + (p - 1) * block), (counts, r, got["sent"])
            if p == 2:  # one exchange of its own entries
                assert got["sent"] == 8 * counts[r], (counts, r, got["sent"])
