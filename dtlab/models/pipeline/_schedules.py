"""Pipeline schedules as data: per-rank action lists, built, checked by a dry run, and timed.

A schedule for ``p`` pipeline ranks, ``m`` micro-batches and ``v`` stages per rank (``S = p * v``
stages; stage ``s`` lives on rank ``s % p``, so rank ``r`` holds stages ``r, r + p, ...``, Megatron's
virtual-stage layout) is one tuple of :class:`Action` per rank. Compute actions: ``F`` (forward),
``B`` (full backward), ``I`` (input-gradient only) and ``W`` (weight-gradient only, after its ``I``).
Communication actions (added after the compute order is made): ``SEND_F(s, i)`` sends stage ``s``'s
output for micro-batch ``i`` to stage ``s + 1``, matched by ``RECV_F(s + 1, i)``; ``SEND_B(s, i)``
sends the gradient of stage ``s``'s input to stage ``s - 1``, matched by ``RECV_B(s - 1, i)``. A send
is placed right after the compute that made it; a receive one compute ahead of the compute that needs
it (so its message can arrive while the rank computes), so the communication between two computes of
a rank is posted as one batch: the sends of the last compute and the receive of the one after the
next. Neighbouring stages on the same rank (only when ``p = 1``) hand tensors over locally.

:func:`dry_run` executes the lists symbolically before any compute: sends never block, a receive
completes once its matching send is posted. It checks that every send has exactly one receive, that
each backward follows its forward and each ``W`` its ``I``, that every rank runs every micro-batch of
its stages exactly once, that no rank waits forever (a deadlock is reported with every rank's blocked
action) and that messages between two ranks are received in the order they are sent (NCCL matches
point-to-point messages by order). :func:`simulate` does the same with durations and returns the
planned timeline and its idle (bubble) fraction.

The rules a schedule's ``(p, m, v)`` must satisfy are checked by :func:`check_schedule_args`:
``p, m, v >= 1``; ``gpipe``, ``1f1b`` and ``zero_bubble`` run one stage per rank (``v = 1``);
``interleaved_1f1b`` needs ``v >= 2`` and ``m`` a multiple of ``p`` (Megatron's rule: micro-batches go
through the chunks in groups of ``p``). Fewer micro-batches than ranks is allowed everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dtlab.core.plan import check_schedule_args
from dtlab.errors import StrategyError
from dtlab.models.pipeline._actions import SCHEDULES, Action, Kind, PipelineSchedule

__all__ = [
    "SCHEDULES",
    "Action",
    "Kind",
    "PipelineSchedule",
    "Timeline",
    "build_schedule",
    "check_schedule_args",
    "dry_run",
    "simulate",
]


# ---------------------------------------------------------------------------------------- generators
def _gpipe(p: int, m: int, r: int) -> list[Action]:  # noqa: ARG001 - every builder takes (p, m, r)
    return [Action(Kind.F, r, i) for i in range(m)] + [Action(Kind.B, r, i) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int) -> list[Action]:
    """Warm-up of ``min(p - r, m)`` forwards (DeepSpeed's ``num_pipe_buffers``, torch's
    ``warmup_chunks``), then one backward and one forward alternately, then the remaining backwards."""
    warm = min(p - r, m)
    ops = [Action(Kind.F, r, i) for i in range(warm)]
    for b in range(m):
        ops.append(Action(Kind.B, r, b))
        if warm + b < m:
            ops.append(Action(Kind.F, r, warm + b))
    return ops


def _zero_bubble_h1(p: int, m: int, r: int) -> list[Action]:
    """ZB-H1: 1F1B's order with each backward split into ``I`` and ``W``; rank ``r`` holds back its
    first ``r`` weight-gradients (each later ``I`` is followed by the oldest pending ``W``) and runs
    the ``r`` it holds at the end, filling the time it would otherwise wait. Peak in-flight
    micro-batches stay 1F1B's ``min(p - r, m)``."""
    warm = min(p - r, m)
    ops = [Action(Kind.F, r, i) for i in range(warm)]
    next_w = 0
    for b in range(m):
        ops.append(Action(Kind.I, r, b))
        if warm + b < m:
            ops.append(Action(Kind.F, r, warm + b))
        if b >= r:
            ops.append(Action(Kind.W, r, next_w))
            next_w += 1
    ops.extend(Action(Kind.W, r, i) for i in range(next_w, m))
    return ops


def _interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron's interleaved 1F1B: forward k runs chunk ``(k // p) % v`` on micro-batch
    ``(k // (p v)) p + k % p``; backwards go through the chunks in reverse; warm-up
    ``min(2 (p - r - 1) + (v - 1) p, m v)`` forwards, then one forward and one backward alternately."""
    total = m * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action(Kind.F, ((k // p) % v) * p + r, micro(k))

    def bwd(k: int) -> Action:
        return Action(Kind.B, (v - 1 - (k // p) % v) * p + r, micro(k))

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warm)]
    for j in range(total - warm):
        ops += [fwd(warm + j), bwd(j)]
    ops += [bwd(j) for j in range(total - warm, total)]
    return ops


def _with_communication(compute: list[Action], p: int, num_stages: int, r: int) -> tuple[Action, ...]:
    """Sends right after the compute that made them; each receive one compute ahead of the compute
    that needs it (in the batch posted before the previous compute, so the message can arrive while
    that compute runs), receives in the order the computes consume them."""
    last = num_stages - 1
    recvs: list[list[Action]] = []
    sends: list[list[Action]] = []
    for a in compute:
        s, i = a.stage, a.micro
        rv, sd = [], []
        if a.kind is Kind.F and s > 0 and (s - 1) % p != r:
            rv.append(Action(Kind.RECV_F, s, i))
        if a.kind in (Kind.B, Kind.I) and s < last and (s + 1) % p != r:
            rv.append(Action(Kind.RECV_B, s, i))
        if a.kind is Kind.F and s < last and (s + 1) % p != r:
            sd.append(Action(Kind.SEND_F, s, i))
        if a.kind in (Kind.B, Kind.I) and s > 0 and (s - 1) % p != r:
            sd.append(Action(Kind.SEND_B, s, i))
        recvs.append(rv)
        sends.append(sd)
    out: list[Action] = []
    for k, a in enumerate(compute):
        if k == 0:
            out += recvs[0]
        if k + 1 < len(compute):
            out += recvs[k + 1]  # posted now, waited for at compute k + 1
        out.append(a)
        out += sends[k]
    return tuple(out)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    """The schedule ``name`` for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank, dry-run."""
    check_schedule_args(name, p, m, v)
    per_rank: list[tuple[Action, ...]] = []
    for r in range(p):
        if name == "gpipe":
            compute = _gpipe(p, m, r)
        elif name == "1f1b":
            compute = _one_f_one_b(p, m, r)
        elif name == "zero_bubble":
            compute = _zero_bubble_h1(p, m, r)
        else:
            compute = _interleaved(p, m, v, r)
        per_rank.append(_with_communication(compute, p, p * v, r))
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
                        f"schedule {s.name}: rank {r} runs {a}, a stage of rank {s.rank_of(a.stage)}"
                    )
                key = (a.kind, a.stage, a.micro)
                if key in done:
                    raise StrategyError(f"schedule {s.name}: rank {r} runs {a} twice")
                if a.kind in (Kind.B, Kind.I) and (Kind.F, a.stage, a.micro) not in done:
                    raise StrategyError(f"schedule {s.name}: rank {r} runs {a} before its forward")
                if a.kind is Kind.W and (Kind.I, a.stage, a.micro) not in done:
                    raise StrategyError(
                        f"schedule {s.name}: rank {r} runs {a} before its input-gradient {a.stage}I{a.micro}"
                    )
                done.add(key)
            else:
                table = sends if a.kind in (Kind.SEND_F, Kind.SEND_B) else recvs
                msg = a.message()
                if msg in table:
                    raise StrategyError(f"schedule {s.name}: message {msg} is posted twice ({a} on rank {r})")
                table[msg] = r
        for stage in s.stages_of(r):
            for i in range(s.m):
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


def _needs(s: PipelineSchedule, r: int, a: Action) -> tuple[str, int, int] | None:
    """The message compute ``a`` on rank ``r`` waits for, as ``(direction, stage, micro)``: direction
    ``"F"``/``"B"`` for a message, ``"local-F"``/``"local-B"`` for a hand-over from a stage of the same
    rank (only when ``p = 1``); None when it needs nothing."""
    last = s.num_stages - 1
    if a.kind is Kind.F and a.stage > 0:
        return ("F" if s.rank_of(a.stage - 1) != r else "local-F", a.stage, a.micro)
    if a.kind in (Kind.B, Kind.I) and a.stage < last:
        return ("B" if s.rank_of(a.stage + 1) != r else "local-B", a.stage, a.micro)
    return None


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
    finished: list[dict[tuple[Kind, int, int], float]] = [{} for _ in range(p)]
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
                        src = s.rank_of(msg[1] - 1 if msg[0] == "F" else msg[1] + 1)
                        order_recv.setdefault((src, r), []).append(msg)
                    pos[r] += 1
                    continue
                need = _needs(s, r, a)
                ready = clock[r]
                if need is not None and need[0] in ("F", "B"):
                    if need not in posted[r]:
                        raise StrategyError(
                            f"schedule {s.name}: rank {r} runs {a} without posting the receive of its input"
                        )
                    if need not in sent:
                        break  # blocked on the peer
                    ready = max(ready, sent[need])
                elif need is not None:
                    src = a.stage - 1 if need[0] == "local-F" else a.stage + 1
                    kinds = (Kind.F,) if need[0] == "local-F" else (Kind.B, Kind.I)
                    local = [
                        finished[r][(k, src, a.micro)] for k in kinds if (k, src, a.micro) in finished[r]
                    ]
                    if not local:
                        raise StrategyError(
                            f"schedule {s.name}: rank {r} runs {a} before stage {src} handed it over"
                        )
                    ready = max(ready, local[0])
                end = ready + (cost[a.kind] if duration is None else duration(r, a))
                timeline.intervals[r].append((a, ready, end))
                finished[r][(a.kind, a.stage, a.micro)] = end
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
