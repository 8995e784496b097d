"""The vocabulary of pipeline schedules: the schedule names, an :class:`Action` (``kind`` on a stage for
a micro-batch) and a whole :class:`PipelineSchedule` (every rank's ordered actions); built and checked in
:mod:`dtlab.models.pipeline._schedules`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dtlab.core.pairs import SCHEDULES

__all__ = ["SCHEDULES", "Action", "Kind", "PipelineSchedule"]


class Kind(enum.Enum):
    """What an action does."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the schedule vocabulary (input-gradient)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE


_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})


@dataclass(frozen=True)
class Action:
    """``kind`` on ``stage`` for micro-batch ``micro``; printed as torch's ``"1F3"`` (stage 1, F, mb 3)."""

    kind: Kind
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro}"

    def message(self) -> tuple[str, int, int]:
        """The message a communication action sends or receives: ``(direction, receiving stage,
        micro-batch)``, the same on both sides."""
        if self.kind is Kind.SEND_F:
            return ("F", self.stage + 1, self.micro)
        if self.kind is Kind.RECV_F:
            return ("F", self.stage, self.micro)
        if self.kind is Kind.SEND_B:
            return ("B", self.stage - 1, self.micro)
        return ("B", self.stage, self.micro)


@dataclass(frozen=True)
class PipelineSchedule:
    """A whole schedule: ``actions[r]`` is rank ``r``'s ordered action list (compute and p2p)."""

    name: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(c * self.p + rank for c in range(self.v))

    def compute(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s compute actions in order (no communication)."""
        return tuple(a for a in self.actions[rank] if a.kind.is_compute)

    def in_flight(self, rank: int) -> int:
        """Most micro-batches whose forward ran on ``rank`` and whose backward (or ``I``) has not, at
        any point of the schedule (GPipe: ``m`` on every rank; 1F1B: ``min(p - rank, m)``)."""
        live = peak = 0
        for a in self.compute(rank):
            if a.kind is Kind.F:
                live += 1
                peak = max(peak, live)
            elif a.kind in (Kind.B, Kind.I):
                live -= 1
        return peak
