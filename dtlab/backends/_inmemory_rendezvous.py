"""How in-memory ranks meet: a collective's slot, and the one bounded wait every blocking call uses.

Every rank deposits its call and its tensors (by reference, no copy) in a slot of the world; the last
rank to arrive (the *leader*) checks that all calls match, runs the operation once for everyone, then
wakes the others. Waiting ranks block on a lock of their own that only their slot's leader (or an
abort, or a peer's return) releases, so a collective wakes exactly the threads it concerns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from dtlab.backends._inmemory_ops import describe_call, leader_mode
from dtlab.errors import CollectiveMismatchError, CollectiveTimeoutError, WorldAbortedError

__all__ = ["Lock", "Rendezvous", "Slot", "World"]

Lock = Any  # threading.Lock instances (the type is private in typeshed)
_POLL_S = 0.5  # longest sleep between re-checks of abort / exited peers (they also wake waiters)


class Slot:
    """One collective call of one group: what every rank called and deposited."""

    __slots__ = ("arrived", "calls", "complete", "error", "leader_failed", "payloads", "result", "waiters")

    def __init__(self, size: int) -> None:
        self.calls: list[tuple[Any, ...] | None] = [None] * size
        self.payloads: list[Any] = [None] * size
        self.arrived = 0
        self.complete = False
        self.error: str | None = None
        self.leader_failed = False
        self.result: Any = None
        self.waiters: list[Lock] = []


class World(Protocol):
    """The shared state ranks meet in (an :class:`~dtlab.backends.inmemory.InMemoryWorld` is one):
    ``slots``, ``waiting``, ``failure`` and ``exited`` are read and changed holding ``mutex``, and
    ``wake`` releases a slot's waiters."""

    @property
    def timeout(self) -> float: ...
    @property
    def mutex(self) -> Lock: ...
    @property
    def slots(self) -> dict[tuple[Any, ...], Slot]: ...
    @property
    def waiting(self) -> set[Lock]: ...
    @property
    def failure(self) -> tuple[int, BaseException] | None: ...
    @property
    def exited(self) -> set[int]: ...
    def wake(self, waiters: list[Lock]) -> None: ...


class Rendezvous:
    """One rank's meeting point with the other ranks of its group in ``world``.

    ``key`` tells the group's slots and mailboxes apart from other groups'; ``ranks`` are the group's
    members as world ranks, in group-rank order; ``rank`` is this rank's index in ``ranks``.
    """

    def __init__(self, world: World, key: tuple[Any, ...], ranks: tuple[int, ...], rank: int) -> None:
        self.world, self.key, self.ranks, self.rank = world, key, ranks, rank

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def wait(
        self,
        waiters: list[Lock],
        ready: Callable[[], bool],
        describe: Callable[[], str],
        missing: Callable[[], list[int]],
        need_all: bool = True,
        since: float | None = None,
    ) -> None:
        """Holding ``world.mutex``, block until ``ready()``; raise on abort, an exited peer, timeout.

        ``missing()`` names the ranks waited for: the timeout applies while it names any; once nobody
        is missing the wait is for a leader already at work, which always finishes (or aborts the
        world). A collective (``need_all``) can never complete once one missing rank has exited; a
        receive from any source only once all of them have.
        """
        w = self.world
        deadline = (time.monotonic() if since is None else since) + w.timeout
        while not ready():
            if w.failure is not None:
                rank, exc = w.failure
                raise WorldAbortedError(
                    f"rank {self.global_rank}: {describe()} aborted because rank {rank} failed: "
                    f"{type(exc).__name__}: {exc}"
                )
            lacking = missing()
            gone = [r for r in lacking if self.ranks[r] in w.exited]
            if gone and (need_all or len(gone) == len(lacking)):
                raise CollectiveTimeoutError(
                    f"rank {self.global_rank}: {describe()} can never complete: rank(s) {gone} of this "
                    f"group already returned without reaching it",
                    tuple(gone),
                    describe(),
                )
            remaining = deadline - time.monotonic()
            if lacking and remaining <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.global_rank}: {describe()} timed out after {w.timeout:g}s waiting for "
                    f"rank(s) {lacking} of this group (world ranks "
                    f"{[self.ranks[r] for r in lacking]}); did every rank call it?",
                    tuple(lacking),
                    describe(),
                )
            lk = threading.Lock()
            lk.acquire()
            waiters.append(lk)
            w.waiting.add(lk)
            w.mutex.release()
            try:
                lk.acquire(True, min(remaining, _POLL_S) if lacking else _POLL_S)
            finally:
                w.mutex.acquire()
                w.waiting.discard(lk)
                if lk in waiters:
                    waiters.remove(lk)

    def meet(
        self,
        seq: int,
        call: tuple[Any, ...],
        payload: Any,
        leader: Callable[[list[Any]], Any] | None = None,
    ) -> Slot:
        """Deposit this rank's ``call`` and ``payload`` for the group's collective number ``seq``; the
        last rank to arrive checks the calls match and runs ``leader(payloads)`` once for everyone.
        Returns the completed slot."""
        p, me, w = len(self.ranks), self.rank, self.world
        if p == 1:  # nothing to wait for or to mismatch with
            solo = Slot(1)
            solo.calls[0], solo.payloads[0] = call, payload
            if leader is not None:
                with leader_mode(solo.payloads):
                    solo.result = leader(solo.payloads)
            return solo
        key = (self.key, seq)
        arrived = time.monotonic()
        with w.mutex:
            slot = w.slots.get(key)
            if slot is None:
                slot = w.slots[key] = Slot(p)
            slot.calls[me] = call
            slot.payloads[me] = payload
            slot.arrived += 1
            lead = slot.arrived == p
            if lead:
                del w.slots[key]
            else:
                lk = threading.Lock()
                lk.acquire()
                slot.waiters.append(lk)
                w.waiting.add(lk)
        if not lead and not (lk.acquire(True, min(_POLL_S, w.timeout)) and slot.complete):
            # not woken by the leader within the poll interval, or woken by an abort / exited peer
            with w.mutex:
                w.waiting.discard(lk)
                if lk in slot.waiters:
                    slot.waiters.remove(lk)
                self.wait(
                    slot.waiters,
                    lambda: slot.complete,
                    lambda: f"{describe_call(call)} (collective #{seq})",
                    lambda: [r for r in range(p) if slot.calls[r] is None],
                    since=arrived,
                )
        if lead:
            self._lead(slot, seq, call, leader)
        if slot.error is not None:
            if slot.leader_failed:
                raise WorldAbortedError(slot.error)  # the leader's own exception names the cause
            raise CollectiveMismatchError(slot.error)
        return slot

    def _lead(
        self, slot: Slot, seq: int, call: tuple[Any, ...], leader: Callable[[list[Any]], Any] | None
    ) -> None:
        """The last rank to arrive: compare the calls, run ``leader`` once, wake the others."""
        failed: BaseException | None = None
        try:
            if any(c != call for c in slot.calls):
                listing = "; ".join(f"rank {r}: {describe_call(c)}" for r, c in enumerate(slot.calls))
                slot.error = (
                    f"ranks called different collectives at collective #{seq} of group "
                    f"{list(self.ranks)}: {listing}"
                )
            elif leader is not None:
                with leader_mode(slot.payloads):  # grad mode is per thread: use the permissive one
                    slot.result = leader(slot.payloads)
        except CollectiveMismatchError as exc:
            slot.error = str(exc)
        except BaseException as exc:  # the others must not wait for a leader that failed
            failed = exc
            slot.error = (
                f"rank {self.global_rank}: {describe_call(call)} aborted because the rank doing it "
                f"(rank {self.rank} of this group) failed: {type(exc).__name__}: {exc}"
            )
        finally:
            slot.leader_failed = failed is not None
            with self.world.mutex:
                slot.complete = True
                self.world.wake(slot.waiters)
        if failed is not None:
            raise failed
