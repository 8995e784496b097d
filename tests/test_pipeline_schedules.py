"""Pipeline schedules as data: dry runs over a grid of (p, m, v), every refused case, deadlock and
ordering detection, in-flight micro-batches and the planned bubble against the formulas."""

from __future__ import annotations

import dataclasses

import pytest

from dtlab.errors import ArgumentError, StrategyError
from dtlab.models.pipeline import (
    SCHEDULES,
    Action,
    Kind,
    PipelineSchedule,
    Timeline,
    build_schedule,
    check_schedule_args,
    dry_run,
    plot_schedule,
    simulate,
)

GRID = [
    (name, p, m, v)
    for name in SCHEDULES
    for p in (1, 2, 3, 4, 5)
    for m in range(1, 11)
    for v in ((1,) if name != "interleaved_1f1b" else (2, 3, 4))
    if name != "interleaved_1f1b" or m % p == 0
]


@pytest.mark.parametrize("name", SCHEDULES)
def test_grid_dry_runs(name: str) -> None:
    for n, p, m, v in GRID:
        if n != name:
            continue
        s = build_schedule(n, p, m, v)  # dry-run inside: raises on any broken property
        assert len(s.actions) == p
        for r in range(p):
            kinds = [a.kind for a in s.compute(r)]
            per = 2 if name != "zero_bubble" else 3
            assert len(kinds) == per * m * v
        # every send has its receive
        sends = sum(1 for acts in s.actions for a in acts if a.kind in (Kind.SEND_F, Kind.SEND_B))
        recvs = sum(1 for acts in s.actions for a in acts if a.kind in (Kind.RECV_F, Kind.RECV_B))
        boundaries = (p * v - 1) if p > 1 else 0
        assert sends == recvs == 2 * m * boundaries


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("pipedream", 2, 4, 1), "unknown pipeline schedule 'pipedream'"),
        (("gpipe", 0, 4, 1), "the pipeline size p must be an integer >= 1, got 0"),
        (("1f1b", 2, 0, 1), "micro_batches must be an integer >= 1, got 0"),
        (("1f1b", 2, 4, 0), "stages_per_rank must be an integer >= 1, got 0"),
        (("1f1b", 2, True, 1), "micro_batches must be an integer >= 1, got True"),
        (("gpipe", 2, 4, 2), "schedule 'gpipe' runs one stage per rank, so stages_per_rank must be 1, got 2"),
        (("1f1b", 2, 4, 3), "schedule '1f1b' runs one stage per rank"),
        (("zero_bubble", 4, 8, 2), "schedule 'zero_bubble' runs one stage per rank"),
        (("interleaved_1f1b", 2, 4, 1), "needs stages_per_rank >= 2 (with 1 it is '1f1b'), got 1"),
        (("interleaved_1f1b", 4, 6, 2), "micro_batches to be a multiple of the pipeline size"),
        (("interleaved_1f1b", 4, 2, 2), "got micro_batches=2 with p=4; use micro_batches=4 or 4"),
    ],
)
def test_invalid_combinations_refused_with_rule(args: tuple, words: str) -> None:
    with pytest.raises(ArgumentError) as info:
        check_schedule_args(*args)
    assert words in str(info.value)
    with pytest.raises(ArgumentError):
        build_schedule(*args)


def test_interleaved_suggests_neighbouring_multiples() -> None:
    with pytest.raises(ArgumentError, match="got micro_batches=6 with p=4; use micro_batches=4 or 8"):
        check_schedule_args("interleaved_1f1b", 4, 6, 2)


def _swap(s: PipelineSchedule, rank: int, i: int, j: int) -> PipelineSchedule:
    acts = list(s.actions[rank])
    acts[i], acts[j] = acts[j], acts[i]
    rows = list(s.actions)
    rows[rank] = tuple(acts)
    return dataclasses.replace(s, actions=tuple(rows))


def test_dry_run_finds_a_deadlock_and_names_the_blocked_ranks() -> None:
    s = build_schedule("1f1b", 2, 2)
    # rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 0's activation
    acts = list(s.actions[0])
    acts.remove(Action(Kind.SEND_F, 0, 0))
    acts.insert(acts.index(Action(Kind.B, 0, 0)) + 1, Action(Kind.SEND_F, 0, 0))
    bad = dataclasses.replace(s, actions=(tuple(acts), s.actions[1]))
    with pytest.raises(StrategyError, match=r"deadlocks: rank 0 waits at 0B0; rank 1 waits at 1F0"):
        dry_run(bad)


def test_dry_run_finds_backward_before_forward_and_w_before_i() -> None:
    s = build_schedule("gpipe", 1, 2)  # F0 F1 B0 B1
    with pytest.raises(StrategyError, match="runs 0B0 before its forward"):
        dry_run(_swap(s, 0, 0, 2))
    z = build_schedule("zero_bubble", 1, 1)  # F0 I0 W0
    with pytest.raises(StrategyError, match="runs 0W0 before its input-gradient 0I0"):
        dry_run(_swap(z, 0, 1, 2))


def test_dry_run_finds_missing_and_duplicate_messages() -> None:
    s = build_schedule("gpipe", 2, 1)
    rows = list(s.actions)
    rows[1] = tuple(a for a in rows[1] if a.kind is not Kind.RECV_F)
    with pytest.raises(StrategyError, match=r"without a matching send or receive: \[\('F', 1, 0\)\]"):
        dry_run(dataclasses.replace(s, actions=tuple(rows)))
    rows = list(s.actions)
    rows[0] = rows[0] + (Action(Kind.SEND_F, 0, 0),)
    with pytest.raises(StrategyError, match="posted twice"):
        dry_run(dataclasses.replace(s, actions=tuple(rows)))


def test_dry_run_finds_a_missing_micro_batch_and_out_of_order_messages() -> None:
    s = build_schedule("gpipe", 1, 2)
    with pytest.raises(StrategyError, match="micro-batch 1"):
        dry_run(dataclasses.replace(s, actions=(s.actions[0][:-1],)))
    g = build_schedule("gpipe", 2, 2)
    # rank 1 posts both receives up front, micro-batch 1's first: fine for tags, not for NCCL's order
    rest = [a for a in g.actions[1] if a.kind is not Kind.RECV_F]
    acts = (Action(Kind.RECV_F, 1, 1), Action(Kind.RECV_F, 1, 0), *rest)
    with pytest.raises(StrategyError, match="receives the messages of rank 0 in another order"):
        dry_run(dataclasses.replace(g, actions=(g.actions[0], acts)))


def test_in_flight_micro_batches() -> None:
    for p, m in [(2, 4), (4, 4), (4, 8), (4, 2), (3, 7)]:
        one = build_schedule("1f1b", p, m)
        assert [one.in_flight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]
        assert [build_schedule("gpipe", p, m).in_flight(r) for r in range(p)] == [m] * p
        zb = build_schedule("zero_bubble", p, m)
        assert [zb.in_flight(r) for r in range(p)] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 12), (4, 2)])
def test_planned_bubble_matches_the_formulas(p: int, m: int) -> None:
    unit = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
    for name in ("gpipe", "1f1b"):
        assert simulate(build_schedule(name, p, m), unit).bubble() == pytest.approx((p - 1) / (m + p - 1))
    # ZB-H1 with F = I = W and m >= p: a third of 1F1B's idle time, (p - 1) / (3 m + p - 1) of the step
    zb = simulate(build_schedule("zero_bubble", p, m), unit).bubble()
    if m >= p:
        assert zb == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zb < (p - 1) / (m + p - 1)
    if m % p == 0:
        for v in (2, 3):
            per_chunk = {k: c / v for k, c in unit.items()}
            got = simulate(build_schedule("interleaved_1f1b", p, m, v), per_chunk).bubble()
            assert got == pytest.approx((p - 1) / (v * m + p - 1))


def test_one_f_one_b_order() -> None:
    s = build_schedule("1f1b", 4, 6)
    assert [str(a) for a in s.compute(1)] == ("1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5".split())
    # each receive is posted one compute ahead of the compute that needs it
    assert [str(a) for a in s.actions[3][:6]] == ["3RECV_F0", "3F0", "3RECV_F1", "3B0", "3SEND_B0", "3F1"]


def test_plot_schedule_writes_png(tmp_path) -> None:
    out = plot_schedule("interleaved_1f1b", 2, 4, tmp_path / "il.png", stages_per_rank=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    built = build_schedule("zero_bubble", 2, 3)
    measured = simulate(built)
    out2 = plot_schedule(built, 2, 3, tmp_path / "zb.png", measured=measured, title="zb")
    assert out2.stat().st_size > 1000
    with pytest.raises(ArgumentError, match="built for p=2, m=3, not p=2, m=4"):
        plot_schedule(built, 2, 4, tmp_path / "x.png")


@pytest.mark.parametrize("schedule", [None, 3, ("gpipe",)])
def test_plot_schedule_names_a_value_that_is_no_schedule(tmp_path, schedule: object) -> None:
    with pytest.raises(ArgumentError, match=r"unknown pipeline schedule .*choose one of gpipe"):
        plot_schedule(schedule, 2, 4, tmp_path / "x.png")  # type: ignore[arg-type]


def test_dry_run_finds_a_compute_on_the_wrong_rank_twice_or_before_its_hand_over() -> None:
    """A hand-made schedule (``PipelineSchedule`` of ``Action`` lists) checked by ``dry_run``."""
    g = build_schedule("gpipe", 2, 1)
    rows = list(g.actions)
    rows[0] = (*rows[0], Action(Kind.F, 1, 0))  # stage 1 lives on rank 1
    with pytest.raises(
        StrategyError, match=r"rank 0 runs 1F0, a stage of rank 1 \(stage s runs on rank s % p,"
    ):
        dry_run(dataclasses.replace(g, actions=tuple(rows)))
    one = build_schedule("gpipe", 1, 1)  # 0F0 0B0
    twice = (one.actions[0][0], *one.actions[0])
    with pytest.raises(StrategyError, match=r"rank 0 runs 0F0 twice; .* remove the second"):
        dry_run(dataclasses.replace(one, actions=(twice,)))
    il = build_schedule("interleaved_1f1b", 1, 1, 2)  # 0F0 1F0 1B0 0B0: stages 0 and 1 both on rank 0
    assert [str(a) for a in il.actions[0]] == ["0F0", "1F0", "1B0", "0B0"]
    with pytest.raises(StrategyError, match="runs 1F0 before stage 0 handed it over; run 0F0 before it"):
        dry_run(_swap(il, 0, 0, 1))
    with pytest.raises(StrategyError, match=r"runs 0B0 before stage 1 handed it over; run 1B0 \(or 1I0\)"):
        dry_run(_swap(il, 0, 2, 3))


def test_dry_run_finds_a_compute_before_its_receive_is_posted() -> None:
    g = build_schedule("gpipe", 2, 1)  # rank 1: RECV_F(1, 0), 1F0, 1B0, SEND_B(1, 0)
    assert g.actions[1][0] == Action(Kind.RECV_F, 1, 0)
    with pytest.raises(StrategyError, match=r"runs 1F0 without posting the receive .*; post RECV_F\(1, 0\)"):
        dry_run(_swap(g, 1, 0, 1))
    assert simulate(build_schedule("gpipe", 1, 1)).bubble() == 0.0
    assert Timeline().bubble() == 0.0 and Timeline().makespan == 0.0  # nothing planned: no idle time
