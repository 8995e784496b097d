"""The pipeline's p2p links: receives posted ahead of the schedule's placement within the byte budget,
in the schedule's order, and every message arriving intact (in-memory ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtlab.models.pipeline._comm import StageLinks
from dtlab.models.pipeline._schedules import Action, Kind, build_schedule
from dtlab.models.pipeline._split import TensorSpec
from dtlab.testing import run_world

SPEC = TensorSpec((2, 3), torch.float32)  # 24 bytes per message


def _value(kind: Kind, stage: int, micro: int) -> float:
    """What a message carries: the receiving stage and micro-batch, and its direction."""
    return (100 if kind in (Kind.SEND_F, Kind.RECV_F) else 200) + 10 * stage + micro


def _drive(backend: Any, name: str, m: int, v: int, ahead_bytes: int) -> dict[str, Any]:
    """Post and take every message of one step as the runtime does (no compute), recording how many
    receives were posted and how many the schedule had placed by each compute."""
    backend.stats.reset()
    schedule = build_schedule(name, backend.world_size, m, v)
    links = StageLinks(backend, schedule, [SPEC] * (schedule.num_stages - 1), ahead_bytes=ahead_bytes)
    rank, posted, placed, taken, wrong = backend.rank, [], [], [], []
    computes = done = 0
    due = 0
    for a in schedule.actions[rank]:
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            due += 1
        if not a.kind.is_compute:
            continue

        def outgoing(s: Action) -> torch.Tensor:
            receiver = s.stage + 1 if s.kind is Kind.SEND_F else s.stage - 1
            return torch.full(SPEC.shape, _value(s.kind, receiver, s.micro))

        links.post(computes, outgoing)
        posted.append(backend.stats["recv"].calls)
        placed.append(due)
        taken.append(done)
        needs = None
        if a.kind is Kind.F and a.stage > 0 and schedule.rank_of(a.stage - 1) != rank:
            needs = Kind.RECV_F
        if a.kind is Kind.B and a.stage < schedule.num_stages - 1 and schedule.rank_of(a.stage + 1) != rank:
            needs = Kind.RECV_B
        if needs is not None:
            got = links.take(needs, a.stage, a.micro)
            done += 1
            if not bool((got == _value(needs, a.stage, a.micro)).all()):
                wrong.append(str(a))
        computes += 1
    links.post(computes, lambda s: torch.full(SPEC.shape, _value(s.kind, s.stage - 1, s.micro)))
    links.finish()
    backend.barrier()
    return {"posted": posted, "placed": placed, "taken": taken, "wrong": wrong, "total": due}


@pytest.mark.parametrize(("name", "m", "v"), [("1f1b", 4, 1), ("gpipe", 3, 1), ("interleaved_1f1b", 4, 2)])
def test_receives_posted_ahead_within_the_budget(name: str, m: int, v: int) -> None:
    rules = {1 << 20: "all", 0: "placed", 2 * SPEC.nbytes: "two"}

    def every_budget(backend: Any) -> dict[int, dict[str, Any]]:
        return {budget: _drive(backend, name, m, v, budget) for budget in rules}

    for r, by_budget in enumerate(run_world(2, every_budget, timeout=60)):
        for budget, res in by_budget.items():
            rule = rules[budget]
            assert res["wrong"] == [], (name, budget, r)
            posted, placed = res["posted"], res["placed"]
            assert all(p >= q for p, q in zip(posted, placed, strict=True)), (name, budget, r)
            if rule == "all":  # small messages: every receive of the step in the first batch
                assert posted[0] == res["total"], (name, r, posted)
            elif rule == "placed":  # no budget: exactly where the schedule places them
                assert posted == placed, (name, r, posted, placed)
            else:  # two messages' bytes: receives waiting ahead fill two buffers, beyond the placed ones
                want = [min(res["total"], max(q, t + 2)) for q, t in zip(placed, res["taken"], strict=True)]
                assert posted == want, (name, r, posted, want)
