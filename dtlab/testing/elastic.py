"""``run_elastic``: an elastic in-memory world where ranks die and join between steps, on a schedule.

::

    def train(backend, member):                    # one world's worth of work for one member
        trainer = Trainer(config, backend, member=member)   # restores the last commit, if any
        return trainer.fit()                       # reports each step end to member.step_done

    run = run_elastic(train, 4, schedule=[Kill(step=6, rank=1), Join(step=10)])

Each member is a thread with its own :class:`MemoryCommitStore` (its commits and its ring
neighbour's copy) that outlives the worlds it takes part in. ``fn(backend, member, ...)`` runs once
per world the member is in. After step ``s`` (``member.step_done``, called by
:meth:`ElasticOptimizer.end_step`):

- :class:`Kill` ``(s, r)``: the member that is rank ``r`` of the world then raises
  :class:`RankKilledError` and is gone, with its memory; the world is aborted, so the survivors get
  the in-memory world's error naming the dead rank at their next collective.
- :class:`Join` ``(s, n)``: ``n`` new members start; every member commits (a planned change: nothing
  is redone) and leaves the world with :class:`MembershipChangedError`.

The members still alive then rendezvous: a new ``InMemoryWorld`` of their number is made (survivors
keep their order, newcomers come last) and each calls ``fn`` again. Any other exception is a real
failure: it ends the whole run (:class:`RankFailedError`). Each event fires once, in the world where
it is first reached (a step redone after a restore does not fire it again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtlab.backends._run_args import check_world_size
from dtlab.backends.inmemory import InMemoryBackend, InMemoryWorld
from dtlab.backends.threads import RankThread
from dtlab.errors import ArgumentError, DtlabError, RankFailedError, WorldAbortedError
from dtlab.optimizers.elastic import CommitStore, MemoryCommitStore

__all__ = [
    "ElasticRun",
    "InMemoryMember",
    "Join",
    "Kill",
    "MembershipChangedError",
    "RankKilledError",
    "run_elastic",
]


class RankKilledError(DtlabError):
    """Raised in the member the schedule kills (it stops, and its memory is lost)."""


class MembershipChangedError(DtlabError):
    """Raised in every member leaving a world for a planned change (a rank joins)."""


@dataclass(frozen=True)
class Kill:
    """After step ``step``, the member that is rank ``rank`` of the world at that time dies."""

    step: int
    rank: int


@dataclass(frozen=True)
class Join:
    """After step ``step``, ``count`` new members join."""

    step: int
    count: int = 1


Event = Kill | Join


@dataclass
class ElasticRun:
    """What ``run_elastic`` returns: results and a timeline (``time.perf_counter`` seconds)."""

    #: each member's ``fn`` result from the last world, in that world's rank order
    results: list[Any] = field(default_factory=list)
    #: one per world: ``{"generation", "world_size", "members", "formed_at", "first_step",
    #: "first_step_at"}`` (first step completed in that world)
    worlds: list[dict[str, Any]] = field(default_factory=list)
    #: ``{"kind": "kill"|"join", "step", "rank"|"count", "at", "generation"}`` as they fired
    events: list[dict[str, Any]] = field(default_factory=list)
    #: ``{"member", "at", "error"}``: a survivor got the world's error after a kill
    detections: list[dict[str, Any]] = field(default_factory=list)


class InMemoryMember:
    """One member (thread) of :func:`run_elastic`; what ``fn`` receives besides its backend."""

    def __init__(self, member_id: int, engine: _Engine) -> None:
        self.id = member_id
        self._store = MemoryCommitStore()
        self._engine = engine
        self.world: InMemoryWorld | None = None
        self.rank = -1
        self.generation = -1
        self.steps_done: list[int] = []

    @property
    def store(self) -> CommitStore:
        return self._store

    def step_done(self, step: int, commit: Callable[[], None]) -> None:
        self.steps_done.append(step)
        self._engine.step_done(self, step, commit)


class _Stop(Exception):
    """The run is over for this member (a fatal error elsewhere)."""


class _Engine:
    def __init__(self, fn: Callable[..., Any], schedule: Sequence[Event], timeout: float) -> None:
        self.fn, self.timeout = fn, timeout
        self.schedule = list(schedule)
        self.fired: dict[int, int] = {}  # event index -> generation it fired in
        self.cond = threading.Condition()
        self.members: dict[int, InMemoryMember] = {}
        self.alive: set[int] = set()
        self.finished: dict[int, Any] = {}
        self.arrived: set[int] = set()
        self.assigned: dict[int, tuple[InMemoryWorld, int, int]] = {}  # member -> (world, rank, gen)
        self.generation = -1
        self.fatal: tuple[int, BaseException] | None = None
        self.threads: list[threading.Thread] = []
        self.run = ElasticRun()
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    # ------------------------------------------------------------------ members
    def add_member(self) -> None:
        """Holding ``cond``: a new member and its thread."""
        mid = len(self.members)
        member = InMemoryMember(mid, self)
        self.members[mid] = member
        self.alive.add(mid)
        t = RankThread(target=self._member_main, args=(member,), name=f"dtlab-elastic-{mid}", daemon=True)
        self.threads.append(t)
        t.start()

    def _member_main(self, member: InMemoryMember) -> None:
        while True:
            try:
                backend = self._rendezvous(member)
            except _Stop:
                return
            world, rank = member.world, backend.rank
            if world is None:
                raise DtlabError(f"elastic member {rank} joined no world")
            try:
                result = self.fn(backend, member, *self.args, **self.kwargs)
            except RankKilledError as exc:
                with self.cond:
                    self.alive.discard(member.id)
                    self.cond.notify_all()
                world.abort(rank, exc)
                return
            except MembershipChangedError:
                continue
            except WorldAbortedError as exc:
                failure = world.failure
                if failure is not None and isinstance(failure[1], RankKilledError):
                    with self.cond:
                        self.run.detections.append(
                            {"member": member.id, "at": time.perf_counter(), "error": str(exc)}
                        )
                    continue
                return  # another member failed for real: it reports the failure
            except BaseException as exc:
                self._fail(member.id, exc)
                world.abort(rank, exc)
                return
            else:
                with self.cond:
                    self.finished[member.id] = result
                    self.cond.notify_all()
                world.mark_exited(rank)
                return

    def _fail(self, member_id: int, exc: BaseException) -> None:
        with self.cond:
            if self.fatal is None:
                self.fatal = (member_id, exc)
            self.cond.notify_all()

    # ------------------------------------------------------------------ rendezvous
    def _rendezvous(self, member: InMemoryMember) -> InMemoryBackend:
        deadline = time.monotonic() + self.timeout
        with self.cond:
            self.arrived.add(member.id)
            self.assigned.pop(member.id, None)
            while member.id not in self.assigned:
                if self.fatal is not None:
                    raise _Stop
                waiting_for = (self.alive - set(self.finished)) - self.arrived
                if not waiting_for:
                    self._form_world()
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.fatal = (
                        member.id,
                        TimeoutError(
                            f"elastic rendezvous: member {member.id} waited {self.timeout:g}s for "
                            f"member(s) {sorted(waiting_for)} to join the next world"
                        ),
                    )
                    self.cond.notify_all()
                    raise _Stop
                self.cond.wait(min(remaining, 0.5))
            world, rank, gen = self.assigned[member.id]
        member.world, member.rank, member.generation = world, rank, gen
        return world.backend(rank)

    def _form_world(self) -> None:
        """Holding ``cond``: every live member has arrived; make their world."""
        ids = sorted(self.arrived)
        self.generation += 1
        world = InMemoryWorld(len(ids), timeout=self.timeout)
        for rank, mid in enumerate(ids):
            self.assigned[mid] = (world, rank, self.generation)
        self.arrived.clear()
        self.run.worlds.append(
            {
                "generation": self.generation,
                "world_size": len(ids),
                "members": ids,
                "formed_at": time.perf_counter(),
                "first_step": None,
                "first_step_at": None,
            }
        )
        self.cond.notify_all()

    # ------------------------------------------------------------------ the schedule
    def step_done(self, member: InMemoryMember, step: int, commit: Callable[[], None]) -> None:
        killed = joined = False
        with self.cond:
            w = self.run.worlds[member.generation]
            if w["first_step"] is None:
                w["first_step"], w["first_step_at"] = step, time.perf_counter()
            for i, ev in enumerate(self.schedule):
                if ev.step != step or self.fired.get(i, member.generation) != member.generation:
                    continue
                first = i not in self.fired
                self.fired[i] = member.generation
                if isinstance(ev, Kill) and ev.rank == member.rank:
                    killed = True
                    self.run.events.append(
                        {
                            "kind": "kill",
                            "step": step,
                            "rank": ev.rank,
                            "at": time.perf_counter(),
                            "generation": member.generation,
                        }
                    )
                elif isinstance(ev, Join):
                    joined = True
                    if first:
                        self.run.events.append(
                            {
                                "kind": "join",
                                "step": step,
                                "count": ev.count,
                                "at": time.perf_counter(),
                                "generation": member.generation,
                            }
                        )
                        for _ in range(ev.count):
                            self.add_member()
        if killed:
            raise RankKilledError(f"rank {member.rank} was killed by the elastic schedule after step {step}")
        if joined:
            commit()  # every member is here and alive: commit, so nothing is redone
            raise MembershipChangedError(f"a rank joins after step {step}")

    # ------------------------------------------------------------------ driver
    def wait(self) -> None:
        while True:
            with self.cond:
                if self.fatal is not None or not (self.alive - set(self.finished)):
                    break
                self.cond.wait(0.5)
        for t in self.threads:
            t.join(self.timeout)


def _check_schedule(world_size: int, schedule: Sequence[Event]) -> None:
    check_world_size("run_elastic", world_size)
    for ev in schedule:  # before sorting them by step
        values = (
            [ev.step, ev.rank if isinstance(ev, Kill) else ev.count] if isinstance(ev, Kill | Join) else []
        )
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ArgumentError(
                f"run_elastic: schedule entries are Kill(step, rank) or Join(step, count) of ints, got {ev!r}"
            )
    size = world_size
    for ev in sorted(schedule, key=lambda e: (e.step, isinstance(e, Join))):
        if ev.step < 1:
            raise ArgumentError(f"run_elastic: {ev!r}: events happen after a step >= 1")
        if isinstance(ev, Kill):
            if not 0 <= ev.rank < size:
                raise ArgumentError(
                    f"run_elastic: {ev!r}: the world has {size} ranks after step {ev.step}; kill a rank "
                    f"in [0, {size})"
                )
            size -= 1
            if size < 1:
                raise ArgumentError(f"run_elastic: {ev!r} would leave no rank alive")
        else:
            if ev.count < 1:
                raise ArgumentError(f"run_elastic: {ev!r}: count must be >= 1")
            size += ev.count


def run_elastic(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    schedule: Sequence[Event] = (),
    timeout: float = 60.0,
    **kwargs: Any,
) -> ElasticRun:
    """Run ``fn(backend, member, *args, **kwargs)`` on an elastic in-memory world of ``world_size``
    ranks that changes after the steps the ``schedule`` names; returns an :class:`ElasticRun`.

    ``timeout`` bounds every collective and every rendezvous wait. A member failing for any reason
    other than the schedule raises :class:`RankFailedError` (naming the member) from its exception.
    """
    _check_schedule(world_size, schedule)
    engine = _Engine(fn, schedule, timeout)
    engine.args, engine.kwargs = args, kwargs
    with engine.cond:
        for _ in range(world_size):
            engine.add_member()
    engine.wait()
    if engine.fatal is not None:
        mid, exc = engine.fatal
        raise RankFailedError(mid, f"elastic member {mid} failed: {type(exc).__name__}: {exc}") from exc
    last = engine.run.worlds[-1]["members"] if engine.run.worlds else []
    engine.run.results = [engine.finished[m] for m in last if m in engine.finished]
    return engine.run
