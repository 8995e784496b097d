"""The conformance suite (dtlab.testing.conformance) on the in-memory backend, world sizes 1 to 8,
plus property-based cases drawn by hypothesis and a check that the suite catches broken engines."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtlab.backends import InMemoryBackend, ReduceOp
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import RankFailedError
from dtlab.testing import run_world
from dtlab.testing.conformance import (
    CHECK_NAMES,
    Case,
    ConformanceCases,
    SizesCase,
    check_message_streams,
    default_cases,
    run_cases,
    run_conformance,
)
from dtlab.testing.strategies import collective_cases, sizes_cases

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
FLOATS = DTYPES[:4]


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_check_passes_on_the_inmemory_backend(world_size: int) -> None:
    results = run_world(world_size, run_conformance, timeout=30)
    assert all(r == results[0] for r in results), "every rank must report the same outcome"
    assert set(results[0]) == set(CHECK_NAMES)
    failed = {name: text for name, text in results[0].items() if text is not None}
    assert not failed, failed


def test_default_cases_cover_every_dtype_with_every_applicable_op() -> None:
    cases = default_cases()
    covered = {(c.dtype, c.op) for c in cases.collectives}
    for dtype in DTYPES:
        for op in ReduceOp:
            if op is ReduceOp.AVG and dtype not in FLOATS:
                continue
            assert (dtype, op) in covered, (dtype, op)
    assert all(0 in s.counts for s in cases.sizes), "every sizes case has a rank with no elements"
    assert default_cases(3) == default_cases(3) and default_cases(3) != default_cases(4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(1, 8), cases=st.lists(collective_cases(), min_size=1, max_size=4))
def test_random_collective_cases_match_the_direct_computation(world_size: int, cases: list[Case]) -> None:
    results = run_world(world_size, run_cases, ConformanceCases(tuple(cases), ()), timeout=30)
    assert results == [[]] * world_size, results


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(1, 8), cases=st.lists(sizes_cases(), min_size=1, max_size=3))
def test_random_variable_sizes_match_the_direct_computation(world_size: int, cases: list[SizesCase]) -> None:
    results = run_world(world_size, run_cases, ConformanceCases((), tuple(cases)), timeout=30)
    assert results == [[]] * world_size, results


def test_run_cases_reports_every_failing_case() -> None:
    cases = ConformanceCases(default_cases().collectives[:3], ())
    results = run_world(3, lambda b: run_cases(_OffByOneAllReduce(b._world, b.rank), cases), timeout=10)
    assert results[0] == results[1] == []  # only the last rank's all_reduce (and iall_reduce) is off
    kinds = sorted(t.split(" on rank 2: ")[0] for t in results[2])
    assert kinds == ["all_reduce"] * 3 + ["nonblocking"] * 3, results[2]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(2, 6), seed=st.integers(0, 2**20))
def test_random_message_traffic_arrives_in_order_per_stream(world_size: int, seed: int) -> None:
    assert run_world(world_size, check_message_streams, seed, timeout=30) == [None] * world_size


# ------------------------------------------------------------------ the suite can fail
class _OffByOneAllReduce(InMemoryBackend):
    """all_reduce adds 1 to the result on the last rank only."""

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        super()._all_reduce(tensor, op)
        if self.rank == self.world_size - 1:
            tensor.add_(1)


class _SwappedGather(InMemoryBackend):
    """all_gather returns the ranks' blocks in reverse order."""

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        super()._all_gather(output, input)
        n = input.numel()
        blocks = output.view(-1).split(n)
        output.view(-1).copy_(torch.cat(list(reversed(blocks))))


class _LeakyBarrier(InMemoryBackend):
    """barrier returns at once."""

    def _barrier(self) -> None:
        return None


class _LastInFirstOut(InMemoryBackend):
    """Receives the newest matching message first."""

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> int:
        w = self._world
        box = w.mailboxes.get((self._key, self.rank), [])
        with w.mutex:
            box.reverse()
        try:
            return super()._recv(tensor, src, tag)
        finally:
            with w.mutex:
                box.reverse()


class _SharedGroups(InMemoryBackend):
    """Every group of the same size shares one sequence of slots (no isolation between groups)."""

    def _new_group(self, ranks: list[int]) -> CommunicationBackend | None:
        self._collective(("new_group", tuple(ranks)), None)
        if self.rank not in ranks:
            return None
        return _SharedGroups(
            self._world,
            ranks.index(self.rank),
            group_key=("shared", len(ranks)),
            global_ranks=tuple(self._global[r] for r in ranks),
            parent=self,
        )


def _with(cls: type[InMemoryBackend], names: list[str]) -> Any:
    def fn(b: InMemoryBackend) -> dict[str, str | None]:
        broken = cls(b._world, b.rank)
        cases = ConformanceCases(default_cases().collectives[:6], default_cases().sizes[:1])
        return run_conformance(broken, cases, only=names)

    return fn


@pytest.mark.parametrize(
    ("cls", "check", "expect"),
    [
        (_OffByOneAllReduce, "all_reduce", "all_reduce on rank 3"),
        (_SwappedGather, "all_gather", "all_gather(shape="),
        (_LeakyBarrier, "barrier", "left the barrier"),
        (_LastInFirstOut, "send_recv_order", "recv(src="),
        (_SharedGroups, "groups", "group ["),
        (_LastInFirstOut, "message_streams", "message #"),
    ],
)
def test_the_suite_reports_a_broken_engine(cls: type[InMemoryBackend], check: str, expect: str) -> None:
    results = run_world(4, _with(cls, [check]), timeout=10)
    text = results[0][check]
    assert text is not None and expect in text, text
    assert all(r == results[0] for r in results)


def test_run_conformance_rejects_unknown_check_names() -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(1, lambda b: run_conformance(b, only=["nope"]))
    assert isinstance(info.value.__cause__, ValueError)
    assert "unknown checks ['nope']" in str(info.value.__cause__)
