"""Pipeline schedules as data: per-rank action lists, built, checked by a dry run, and timed
(docs/strategies.md, "Schedules").

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` stages per rank (``S = p * v``
stages; stage ``s`` lives on rank ``s % p``, Megatron's virtual-stage layout) is one tuple of
:class:`Action` per rank. Compute actions: ``F`` (forward), ``B`` (full backward), ``I``
(input-gradient only) and ``W`` (weight-gradient only, after its ``I``). Communication actions:
``SEND_F(s, i)`` sends stage ``s``'s output for micro-batch ``i`` to stage ``s + 1``, matched by
``RECV_F(s + 1, i)``; ``SEND_B(s, i)`` sends the gradient of stage ``s``'s input to stage ``s - 1``,
matched by ``RECV_B(s - 1, i)``. A send is placed right after the compute that made it, a receive one
compute ahead of the compute that needs it. Neighbouring stages on one rank (only when ``p = 1``)
hand tensors over locally. :func:`dry_run` executes the lists symbolically (sends never block, a
receive completes once its send is posted); :func:`simulate` does the same with durations.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dtlab.core.plan import check_schedule_args
from dtlab.errors import StrategyError

__all__ = [
    "Action",
    "Kind",
    "PipelineSchedule",
    "Timeline",
    "build_schedule",
    "compute_order",
    "dry_run",
    "simulate",
]


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
        shift = {Kind.SEND_F: 1, Kind.SEND_B: -1}.get(self.kind, 0)
        return ("F" if self.kind in (Kind.SEND_F, Kind.RECV_F) else "B", self.stage + shift, self.micro)


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
        return tuple(range(rank, self.num_stages, self.p))

    def compute(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s compute actions in order (no communication)."""
        return tuple(a for a in self.actions[rank] if a.kind.is_compute)

    def in_flight(self, rank: int) -> int:
        """Most micro-batches whose forward ran on ``rank`` and whose backward (or ``I``) has not, at
        any point of the schedule (GPipe: ``m`` on every rank; 1F1B: ``min(p - rank, m)``)."""
        change = {Kind.F: 1, Kind.B: -1, Kind.I: -1, Kind.W: 0}
        return max(itertools.accumulate((change[a.kind] for a in self.compute(rank)), initial=0))


# ---------------------------------------------------------------------------------------- generators
def _one_f_one_b(m: int, r: int, warm: int, split: bool) -> list[Action]:
    """``warm`` forwards, then one backward and one forward alternately, then the remaining backwards:
    GPipe with ``warm = m``; 1F1B with ``warm = min(p - r, m)`` (DeepSpeed's ``num_pipe_buffers``,
    torch's ``warmup_chunks``). With ``split`` (ZB-H1) each backward is an ``I``; rank ``r`` holds back
    its first ``r`` weight-gradients (each later ``I`` is followed by the oldest pending ``W``) and runs
    the ``r`` it holds at the end, filling the time it would otherwise wait."""
    ops = [Action(Kind.F, r, i) for i in range(warm)]
    for b in range(m):
        ops.append(Action(Kind.I if split else Kind.B, r, b))
        if warm + b < m:
            ops.append(Action(Kind.F, r, warm + b))
        if split and b >= r:
            ops.append(Action(Kind.W, r, b - r))
    return ops + [Action(Kind.W, r, i) for i in range(max(m - r, 0), m) if split]


def _interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron's interleaved 1F1B: forward k runs chunk ``(k // p) % v`` on micro-batch
    ``(k // (p v)) p + k % p``; backwards go through the chunks in reverse; warm-up
    ``min(2 (p - r - 1) + (v - 1) p, m v)`` forwards, then one forward and one backward alternately."""
    total = m * v

    def act(kind: Kind, k: int) -> Action:
        chunk = (k // p) % v if kind is Kind.F else v - 1 - (k // p) % v
        return Action(kind, chunk * p + r, (k // (p * v)) * p + k % p)

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    ops = [act(Kind.F, k) for k in range(warm)]
    for j in range(total - warm):
        ops += [act(Kind.F, warm + j), act(Kind.B, j)]
    ops += [act(Kind.B, j) for j in range(total - warm, total)]
    return ops


def _with_communication(compute: list[Action], p: int, num_stages: int, r: int) -> tuple[Action, ...]:
    """Sends right after the compute that made them; each receive posted before the compute ahead of
    the compute that needs it (so the message can arrive while that compute runs), in the order the
    computes consume them."""

    def remote(stage: int) -> bool:
        return 0 <= stage < num_stages and stage % p != r

    recvs: list[list[Action]] = []
    sends: list[list[Action]] = []
    for a in compute:
        s, i, ahead = a.stage, a.micro, 1 if a.kind is Kind.F else -1  # F: from s - 1 to s + 1; B, I: back
        links = a.kind is not Kind.W
        recv, send = (Kind.RECV_F, Kind.SEND_F) if a.kind is Kind.F else (Kind.RECV_B, Kind.SEND_B)
        recvs.append([Action(recv, s, i)] if links and remote(s - ahead) else [])
        sends.append([Action(send, s, i)] if links and remote(s + ahead) else [])
    recvs.append([])  # none after the last compute
    out = list(recvs[0])
    for k, a in enumerate(compute):
        out += [*recvs[k + 1], a, *sends[k]]
    return tuple(out)


def compute_order(name: str, p: int, m: int, v: int, r: int) -> list[Action]:
    """Rank ``r``'s computations (no sends or receives) in schedule ``name``, unchecked: what
    ``build_schedule(name, p, m, v).compute(r)`` holds once ``(p, m, v)`` passed its checks."""
    if name == "interleaved_1f1b":
        return _interleaved(p, m, v, r)
    return _one_f_one_b(m, r, m if name == "gpipe" else min(p - r, m), name == "zero_bubble")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    """The schedule ``name`` for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank, dry-run
    (``(p, m, v)`` checked first by :func:`~dtlab.core.plan.check_schedule_args`)."""
    check_schedule_args(name, p, m, v)
    per_rank = [_with_communication(compute_order(name, p, m, v, r), p, p * v, r) for r in range(p)]
    schedule = PipelineSchedule(name, p, m, v, tuple(per_rank))
    dry_run(schedule)
    return schedule


# ---------------------------------------------------------------------------------------- dry run
@dataclass
class Timeline:
    """Planned (or measured) compute intervals per rank: ``(action, start, end)`` in seconds."""

    intervals: list[list[tuple[Action, float, float]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        ends = [iv[-1][2] for iv in self.intervals if iv]
        starts = [iv[0][1] for iv in self.intervals if iv]
        return (max(ends) - min(starts)) if ends else 0.0

    def bubble(self) -> float:
        """Idle fraction: ``1 - busy time / (ranks * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        busy = sum(e - s for iv in self.intervals for _, s, e in iv)
        return 1.0 - busy / (len(self.intervals) * span)


def _static_checks(s: PipelineSchedule) -> None:
    sends: dict[tuple[str, int, int], int] = {}
    recvs: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(s.actions):
        done: set[tuple[Kind, int, int]] = set()
        for a in acts:
            if a.kind.is_compute:
                if s.rank_of(a.stage) != r:
                    raise StrategyError(
                        f"schedule {s.name}: rank {r} runs {a}, a stage of rank {s.rank_of(a.stage)} (stage "
                        f"s runs on rank s % p, p={s.p}); move it to rank {s.rank_of(a.stage)}'s list"
                    )
                key = (a.kind, a.stage, a.micro)
                if key in done:
                    raise StrategyError(
                        f"schedule {s.name}: rank {r} runs {a} twice; each computation of a stage and "
                        "micro-batch runs once: remove the second"
                    )
                need = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}.get(a.kind)
                if need is not None and (need, a.stage, a.micro) not in done:
                    what = "forward" if need is Kind.F else f"input-gradient {a.stage}I{a.micro}"
                    raise StrategyError(f"schedule {s.name}: rank {r} runs {a} before its {what}")
                src = _source(s, a)
                if src is not None and s.rank_of(src) == r:
                    kinds = (Kind.F,) if a.kind is Kind.F else (Kind.B, Kind.I)
                    if not any((k, src, a.micro) in done for k in kinds):
                        before = (
                            f"{src}F{a.micro}"
                            if a.kind is Kind.F
                            else f"{src}B{a.micro} (or {src}I{a.micro})"
                        )
                        raise StrategyError(
                            f"schedule {s.name}: rank {r} runs {a} before stage {src} handed it over; run "
                            f"{before} before it"
                        )
                done.add(key)
            else:
                table = sends if a.kind in (Kind.SEND_F, Kind.SEND_B) else recvs
                msg = a.message()
                if msg in table:
                    raise StrategyError(f"schedule {s.name}: message {msg} is posted twice ({a} on rank {r})")
                table[msg] = r
        for stage, i in itertools.product(s.stages_of(r), range(s.m)):
            full = (Kind.B, stage, i) in done
            split = (Kind.I, stage, i) in done and (Kind.W, stage, i) in done
            if (Kind.F, stage, i) not in done or full == split:
                raise StrategyError(
                    f"schedule {s.name}: rank {r} does not run forward and exactly one backward "
                    f"(B, or I then W) of stage {stage}, micro-batch {i}"
                )
    if sends.keys() != recvs.keys():
        lonely = sorted(set(sends) ^ set(recvs))
        raise StrategyError(f"schedule {s.name}: messages without a matching send or receive: {lonely[:6]}")


def _source(s: PipelineSchedule, a: Action) -> int | None:
    """The stage handing compute ``a`` its input (``F``: the one before, ``B``/``I``: the one after);
    None for a ``W``, a first forward or a last backward."""
    src = a.stage - 1 if a.kind is Kind.F else a.stage + 1
    return src if a.kind is not Kind.W and 0 <= src < s.num_stages else None


def simulate(
    s: PipelineSchedule,
    costs: Mapping[Kind, float] | None = None,
    duration: Callable[[int, Action], float] | None = None,
) -> Timeline:
    """Execute the lists symbolically with ``costs`` seconds per compute kind (default F = 1, B = 2,
    I = W = 1) or ``duration(rank, action)`` seconds per action (e.g. measured ones, to replay a run);
    messages take no time. Raise :class:`StrategyError` on a deadlock or a broken order."""
    _static_checks(s)
    cost = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0, **(costs or {})}
    p = s.p
    pos = [0] * p
    clock = [0.0] * p
    sent: dict[tuple[str, int, int], float] = {}  # message -> time its send was posted
    posted: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]
    order_sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    order_recv: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    timeline = Timeline([[] for _ in range(p)])
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = s.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if not a.kind.is_compute:
                    msg = a.message()
                    if a.kind in (Kind.SEND_F, Kind.SEND_B):
                        sent[msg] = clock[r]
                        order_sent.setdefault((r, s.rank_of(msg[1])), []).append(msg)
                    else:
                        posted[r].add(msg)
                        sender = s.rank_of(msg[1] - 1 if msg[0] == "F" else msg[1] + 1)
                        order_recv.setdefault((sender, r), []).append(msg)
                    pos[r] += 1
                    continue
                src = _source(s, a)
                ready = clock[r]  # a hand-over on this rank was computed before
                if src is not None and s.rank_of(src) != r:  # a message, named as Action.message names it
                    need = ("F" if a.kind is Kind.F else "B", a.stage, a.micro)
                    if need not in posted[r]:
                        raise StrategyError(
                            f"schedule {s.name}: rank {r} runs {a} without posting the receive of its input; "
                            f"post RECV_{need[0]}({a.stage}, {a.micro}) before it"
                        )
                    if need not in sent:
                        break  # blocked on the peer
                    ready = max(ready, sent[need])
                end = ready + (cost[a.kind] if duration is None else duration(r, a))
                timeline.intervals[r].append((a, ready, end))
                clock[r] = end
                pos[r] += 1
                progress = True
    blocked = [(r, s.actions[r][pos[r]]) for r in range(p) if pos[r] < len(s.actions[r])]
    if blocked:
        listing = "; ".join(f"rank {r} waits at {a}" for r, a in blocked)
        raise StrategyError(f"schedule {s.name} (p={s.p}, m={s.m}, v={s.v}) deadlocks: {listing}")
    for pair, msgs in order_sent.items():
        if order_recv.get(pair) != msgs:
            raise StrategyError(
                f"schedule {s.name}: rank {pair[1]} receives the messages of rank {pair[0]} in another "
                f"order than they are sent ({order_recv.get(pair)} vs {msgs}); engines that match by "
                "order (NCCL) would mix them up"
            )
    return timeline


def dry_run(s: PipelineSchedule) -> None:
    """Check ``s`` before any compute (see the module docstring); raise :class:`StrategyError`."""
    simulate(s)
