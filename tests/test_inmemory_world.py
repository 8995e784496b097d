"""The in-memory world as a test instrument: failures, timeouts and mismatches become errors, fast."""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

import pytest
import torch

from dtlab.backends import InMemoryWorld, ReduceOp
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import (
    ArgumentError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DtlabError,
    RankFailedError,
    WorldAbortedError,
)
from dtlab.testing import run_world


class Boom(RuntimeError):
    pass


def test_a_failing_rank_aborts_the_world_and_releases_every_other_rank_within_a_second() -> None:
    released: dict[int, float] = {}
    failed_at: list[float] = []

    def fn(b: CommunicationBackend, where: str) -> None:
        if b.rank == 2:
            time.sleep(0.2)  # let the others block first
            failed_at.append(time.monotonic())
            raise Boom("rank two broke")
        try:
            if where == "collective":
                b.all_reduce(torch.ones(8))
            elif where == "recv":
                b.recv(torch.zeros(2), src=None)
            else:  # a sub-group collective that rank 2 belongs to
                g = b.new_group([0, 1, 3]) if b.rank != 2 else None
                assert g is not None
                g.barrier()
                b.all_gather_object(b.rank)
        except WorldAbortedError:
            released[b.rank] = time.monotonic()
            raise

    for where in ("collective", "recv", "group"):
        released.clear()
        failed_at.clear()
        start = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            run_world(4, fn, where, timeout=30)
        assert info.value.rank == 2
        assert "rank 2" in str(info.value) and "rank two broke" in str(info.value)
        assert isinstance(info.value.__cause__, Boom)
        assert isinstance(info.value, DtlabError)
        assert sorted(released) == [0, 1, 3], (where, released)
        assert max(released.values()) - failed_at[0] < 1.0, (where, released, failed_at)
        assert time.monotonic() - start < 5.0


def test_a_collective_not_every_rank_reaches_times_out_naming_the_missing_ranks_and_operation() -> None:
    def skip_rank_2(b: CommunicationBackend) -> None:
        if b.rank == 2:
            time.sleep(0.6)  # alive but never calls the collective
            return
        b.all_reduce(torch.ones(3), ReduceOp.MAX)

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        run_world(3, skip_rank_2, timeout=0.3)
    elapsed = time.monotonic() - start
    assert info.value.missing_ranks == (2,)
    assert "all_reduce" in info.value.operation and "op=MAX" in info.value.operation
    assert "rank(s) [2]" in str(info.value) and "0.3s" in str(info.value)
    assert elapsed >= 0.3

    def rank_1_returns(b: CommunicationBackend) -> None:
        if b.rank != 1:
            b.broadcast(torch.ones(2), src=0)

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"already returned") as info:
        run_world(3, rank_1_returns, timeout=30)
    assert info.value.missing_ranks == (1,)
    assert "broadcast" in info.value.operation
    assert time.monotonic() - start < 5.0, "a rank that returned must not cost the whole timeout"

    def never_sent(b: CommunicationBackend) -> None:
        if b.rank == 0:
            b.recv(torch.zeros(1), src=1, tag=4)
        else:
            time.sleep(0.4)

    with pytest.raises(CollectiveTimeoutError, match=r"recv\(src=1, tag=4\) timed out"):
        run_world(2, never_sent, timeout=0.2)


MISMATCHES: dict[str, tuple[Any, Any]] = {
    "kind": (lambda b: b.all_reduce(torch.ones(4)), lambda b: b.broadcast(torch.ones(4), 0)),
    "shape": (lambda b: b.all_reduce(torch.ones(4)), lambda b: b.all_reduce(torch.ones(2, 2))),
    "dtype": (
        lambda b: b.all_reduce(torch.ones(4)),
        lambda b: b.all_reduce(torch.ones(4, dtype=torch.float64)),
    ),
    "op": (lambda b: b.all_reduce(torch.ones(4)), lambda b: b.all_reduce(torch.ones(4), ReduceOp.MIN)),
    "root": (lambda b: b.broadcast(torch.ones(4), 0), lambda b: b.broadcast(torch.ones(4), 1)),
    "reduce root": (lambda b: b.reduce(torch.ones(4), 0), lambda b: b.reduce(torch.ones(4), 2)),
    "scatter size": (
        lambda b: b.reduce_scatter(torch.zeros(2), torch.ones(6)),
        lambda b: b.reduce_scatter(torch.zeros(3), torch.ones(9)),
    ),
}
EXPECTED_TEXT = {
    "kind": ("all_reduce(shape=(4,)", "broadcast(shape=(4,)"),
    "shape": ("shape=(4,)", "shape=(2, 2)"),
    "dtype": ("dtype=torch.float32", "dtype=torch.float64"),
    "op": ("op=SUM", "op=MIN"),
    "root": ("src=0", "src=1"),
    "reduce root": ("dst=0", "dst=2"),
    "scatter size": ("output_numel=2", "output_numel=3"),
}


def test_mismatched_collectives_raise_on_every_rank_naming_each_ranks_call() -> None:
    def fn(b: CommunicationBackend) -> list[str]:
        messages = []
        for name in MISMATCHES:
            call = MISMATCHES[name][1] if b.rank == 1 else MISMATCHES[name][0]
            try:
                call(b)
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
            else:
                messages.append(f"{name}: no error on rank {b.rank}")
        b.barrier()  # the world is still usable after mismatches
        return messages

    per_rank = run_world(3, fn, timeout=10)
    for i, name in enumerate(MISMATCHES):
        first, second = EXPECTED_TEXT[name]
        for rank, messages in enumerate(per_rank):
            text = messages[i]
            assert "rank 0: " in text and "rank 1: " in text and "rank 2: " in text, (name, rank, text)
            assert first in text.split("rank 1: ")[0] and second in text.split("rank 1: ")[1], (name, text)
    with pytest.raises(CollectiveMismatchError, match="rank 1: all_reduce"):
        run_world(2, lambda b: b.all_reduce(torch.ones(3 + b.rank)), timeout=5)


def test_all_to_all_with_sizes_that_do_not_pair_up_is_a_mismatch_on_every_rank() -> None:
    def fn(b: CommunicationBackend) -> str:
        outs = [torch.zeros(2), torch.zeros(2)]
        ins = [torch.ones(2), torch.ones(2 + b.rank)]
        try:
            b.all_to_all(outs, ins)
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    texts = run_world(2, fn, timeout=5)
    assert all("rank 1 sends 3 elements to rank 1" in t for t in texts), texts


def _chain(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


def test_results_are_bitwise_identical_on_every_rank_and_independent_of_thread_timing() -> None:
    p = 5

    def data(rank: int, n: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(rank))

    def fn(b: CommunicationBackend, jitter_seed: int) -> list[torch.Tensor]:
        rng = random.Random(jitter_seed * 100 + b.rank)
        out = []
        for n in (10, 100_003):  # a small and a large tensor
            time.sleep(rng.random() * 0.01)  # a different arrival order every run
            t = data(b.rank, n)
            b.all_reduce(t)
            out.append(t)
            shard = torch.empty(n // p + 1)
            time.sleep(rng.random() * 0.01)
            b.reduce_scatter(shard, torch.cat([data(b.rank, n), torch.zeros(p - n % p)]))
            out.append(shard)
        return out

    runs = [run_world(p, fn, seed, timeout=20) for seed in (1, 2)]
    for rank in range(p):  # the same bits whatever the arrival order
        for got, ref in zip(runs[1][rank], runs[0][rank], strict=True):
            assert torch.equal(got, ref)
    for run in runs:  # all-reduce results identical on every rank; shards together form the sum
        for results in run:
            assert torch.equal(results[0], run[0][0]) and torch.equal(results[2], run[0][2])
        for i in (1, 3):
            assert torch.equal(
                torch.cat([results[i] for results in run])[: 10 if i == 1 else 100_003], run[0][i - 1]
            )
    for i, n in enumerate((10, 100_003)):  # and equal to the rank-order chain (x0 + x1) + x2 ...
        assert torch.equal(runs[0][0][2 * i], _chain([data(r, n) for r in range(p)]))


def test_in_place_and_aliased_buffers_give_correct_results() -> None:
    def fn(b: CommunicationBackend, shared: torch.Tensor) -> dict[str, torch.Tensor]:
        p, me = b.world_size, b.rank
        out: dict[str, torch.Tensor] = {}
        buf = torch.zeros(3 * p)  # in-place all-gather: the input is this rank's chunk of the output
        buf[3 * me : 3 * me + 3] = me + 1
        b.all_gather(buf, buf[3 * me : 3 * me + 3])
        out["all_gather"] = buf
        full = torch.arange(4.0 * p) + me  # in-place reduce-scatter: the output is a chunk of the input
        b.reduce_scatter(full[4 * me : 4 * me + 4], full)
        out["reduce_scatter"] = full[4 * me : 4 * me + 4].clone()
        same = [torch.full((2,), float(10 * me + j)) for j in range(p)]
        b.all_to_all(same, same)  # outputs are the inputs
        out["all_to_all"] = torch.cat(same)
        b.all_reduce(shared)  # every rank passes the very same tensor
        out["shared"] = shared.clone()
        b.barrier()
        return out

    p = 3
    shared = torch.ones(4)
    results = run_world(p, fn, shared, timeout=10)
    for me, res in enumerate(results):
        assert res["all_gather"].tolist() == [float(r + 1) for r in range(p) for _ in range(3)]
        want = sum(torch.arange(4.0 * p) + r for r in range(p))[4 * me : 4 * me + 4]
        assert torch.equal(res["reduce_scatter"], want)
        assert res["all_to_all"].tolist() == [float(10 * i + me) for i in range(p) for _ in range(2)]
    # one tensor all-reduced by 3 ranks at once: the sum of the three (equal) contributions, once
    assert all(r["shared"].tolist() == [3.0] * 4 for r in results)


def test_bad_world_arguments_are_value_errors_and_dtlab_errors() -> None:
    calls: list[tuple[Any, str]] = [
        (lambda: run_world(0, lambda b: None), "world_size must be >= 1, got 0"),
        (lambda: InMemoryWorld(-2), "world_size must be >= 1, got -2"),
        (
            lambda: run_world(2, lambda b: None, timeout=0),
            "timeout must be a finite number of seconds > 0, got 0",
        ),
        (lambda: InMemoryWorld(3).backend(3), r"rank must be in \[0, 3\), got 3"),
    ]
    for call, text in calls:
        with pytest.raises(ArgumentError, match=text) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, DtlabError)
    with pytest.raises(RankFailedError) as failed:  # inside a rank: the same error is the cause
        run_world(2, lambda b: b.reduce_scatter(torch.zeros(2), torch.zeros(5)), timeout=5)
    cause = failed.value.__cause__
    assert isinstance(cause, ArgumentError) and isinstance(cause, ValueError)
    assert "input has 5 elements but needs world_size * output.numel() = 2 * 2 = 4" in str(cause)


def test_run_world_returns_results_in_rank_order_and_passes_arguments() -> None:
    seen_threads: set[str] = set()
    lock = threading.Lock()

    def fn(b: CommunicationBackend, offset: int, *, scale: int) -> int:
        with lock:
            seen_threads.add(threading.current_thread().name)
        return (b.rank + offset) * scale

    assert run_world(4, fn, 1, scale=10) == [10, 20, 30, 40]
    assert len(seen_threads) == 4
    assert run_world(1, fn, 0, scale=3) == [0]


def test_collectives_work_on_parameters_whatever_each_ranks_grad_mode() -> None:
    """Like torch.distributed, collectives update tensors in place without autograd, in whichever
    grad mode the rank that happens to lead is running; inference tensors are accepted too."""

    def fn(b: CommunicationBackend) -> list[float]:
        param = torch.nn.Parameter(torch.full((3,), float(b.rank + 1)))
        if b.rank == 1:
            with torch.no_grad():
                b.all_reduce(param)
                b.broadcast(param, b.world_size - 1)
        else:
            b.all_reduce(param)
            b.broadcast(param, b.world_size - 1)
        if b.rank == 0:
            with torch.inference_mode():
                t = torch.full((2,), 5.0)
                b.all_reduce(t, ReduceOp.MAX)
        else:
            t = torch.full((2,), float(b.rank))
            b.all_reduce(t, ReduceOp.MAX)
        assert param.requires_grad and param.grad_fn is None
        return param.tolist() + t.tolist()

    for world_size in (1, 3):
        results = run_world(world_size, fn, timeout=10)
        total = float(sum(range(1, world_size + 1)))
        assert results == [[total] * 3 + [5.0] * 2] * world_size, results


def test_run_world_does_not_wait_forever_for_a_rank_busy_outside_collectives() -> None:
    def fn(b: CommunicationBackend) -> None:
        if b.rank == 1:
            raise Boom("rank one broke")
        if b.rank == 2:
            time.sleep(5.0)  # user code an abort cannot interrupt
        b.barrier()

    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank\(s\) \[2\] were still running") as info:
        run_world(3, fn, timeout=0.3)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, Boom)
    assert time.monotonic() - start < 4.0


def test_a_leader_that_fails_mid_collective_fails_its_rank_and_releases_the_others() -> None:
    from dtlab.backends import InMemoryBackend

    class FailingLeader(InMemoryBackend):
        def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
            def lead(ts: list[torch.Tensor]) -> None:
                raise Boom(f"could not reduce {len(ts)} tensors")

            self._collective(("all_reduce", tensor.shape, tensor.dtype, op), tensor, lead)

    def fn(b: InMemoryBackend) -> None:
        FailingLeader(b._world, b.rank).all_reduce(torch.ones(2))

    start = time.monotonic()
    with pytest.raises(RankFailedError, match="could not reduce 3 tensors") as info:
        run_world(3, fn, timeout=30)
    assert isinstance(info.value.__cause__, Boom)
    assert time.monotonic() - start < 5.0


def test_empty_tensors_pass_through_every_collective() -> None:
    def fn(b: CommunicationBackend) -> list[int]:
        p = b.world_size
        e = torch.empty(0)
        b.all_reduce(e, ReduceOp.AVG)
        b.reduce(e, 0)
        b.broadcast(e, p - 1)
        b.reduce_scatter(torch.empty(0), torch.empty(0))
        b.all_gather(torch.empty(0), e)
        b.all_to_all([torch.empty(0)] * p, [torch.empty(0)] * p)
        out, counts = b.all_gather_v(e)
        return [out.numel(), *counts, b.stats.bytes_sent - 8 * (p - 1) * (p > 1)]

    assert run_world(3, fn, timeout=10) == [[0, 0, 0, 0, 0]] * 3


def _import_race(backend: CommunicationBackend, name: str) -> None:
    if backend.rank == 1:  # what a rank sees of a module another rank is still importing
        raise AttributeError(f"module 'math' has no attribute '{name}'")


def test_a_name_missed_in_a_module_being_imported_by_another_rank_is_explained() -> None:
    with pytest.raises(RankFailedError, match=r"half-imported .* at the top of the script"):
        run_world(2, _import_race, "pi", timeout=30)  # math.pi is there: the module was half-imported
    with pytest.raises(RankFailedError) as typo:  # a name the module never has: no such hint
        run_world(2, _import_race, "nope", timeout=30)
    assert "half-imported" not in str(typo.value)
    with pytest.raises(RankFailedError) as real:
        run_world(2, lambda b: math.nope if b.rank == 0 else None, timeout=30)  # type: ignore[attr-defined]
    assert "has no attribute 'nope'" in str(real.value) and "half-imported" not in str(real.value)
