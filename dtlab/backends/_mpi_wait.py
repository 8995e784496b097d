"""How an :class:`~dtlab.backends.mpi.MPIBackend` waits: bounded, so that an MPI job never hangs.

MPI has no time-outs: a rank whose peer finished its loop early (uneven inputs), left with
``sys.exit``, or hangs, waits in its collective for ever, and so does the launcher. Two bounds:

* ``timeout=t``: every operation is started non-blocking and polled (:meth:`Waits.wait`); one that has
  not completed after ``t`` seconds raises :class:`CollectiveTimeoutError` in the calling thread.
* the watchdog (``watchdog=s``, the default when no ``timeout`` is given): operations are MPI's
  blocking calls, as fast as raw mpi4py; each marks its communicator's :class:`Watch` while it runs,
  and a daemon thread (:class:`Watchdog`, one per backend tree) that finds one running for more than
  ``s`` seconds prints which operation, and the likely cause and fix, and ends the job with
  ``MPI.COMM_WORLD.Abort`` (NCCL's watchdog ends the process the same way). mpi4py releases the GIL
  in its blocking calls, so the thread runs while the main thread waits. A world backend's watchdog
  also reads which ranks have ended their script (``_mpi_departures.py``) and ends the job within
  seconds when one leaves this rank in a collective it can no longer complete.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any

from dtlab.backends._checked import mismatch_hint
from dtlab.backends._mpi_abort import end_mpi_job
from dtlab.backends._mpi_departures import SYMMETRIC, Departures
from dtlab.errors import CollectiveTimeoutError

__all__ = ["DEFAULT_WATCHDOG_S", "Watch", "Watchdog", "Waits", "ended_text", "stuck_text", "world_ranks"]

#: seconds a blocking MPI operation may take before the watchdog ends the job: NCCL's default timeout
DEFAULT_WATCHDOG_S = 600.0


def stuck_text(rank: int, what: str, seq: int, seconds: float) -> str:
    """Why an MPI operation that did not complete within ``seconds`` never will, and what to change."""
    return (
        f"rank {rank}: MPI {what} (operation #{seq} of this rank on its communicator) did not complete "
        f"within {seconds:g}s: a peer is dead or hung, or never calls it. The most common cause: uneven "
        "inputs, one rank ran fewer steps than the others (its data was shorter) and left, or called "
        "sys.exit() or returned early, while this one waits in its next collective; give every rank the "
        "same number of steps (dtlab.data.DistributedSampler pads every rank's shard to the same "
        "length, drop_last=True drops the tail; or stop all ranks on one all-reduced flag)"
    )


def ended_text(rank: int, what: str, seq: int, ended: list[int]) -> str:
    """Why an MPI collective whose communicator lost members to their script's end never completes."""
    who = f"rank {ended[0]} has" if len(ended) == 1 else f"ranks {ended} have"
    return (
        f"rank {rank}: MPI {what} (operation #{seq} of this rank on its communicator) can never "
        f"complete: {who} ended (the script returned or called sys.exit()) without calling it. Uneven "
        "inputs: a rank ran fewer steps than the others (its data was shorter); give every rank the "
        "same number of steps (dtlab.data.DistributedSampler pads every rank's shard to the same "
        "length, drop_last=True drops the tail; or stop all ranks on one all-reduced flag)"
    )


def world_ranks(mpi: Any, comm: Any) -> frozenset[int] | None:
    """The ``COMM_WORLD`` ranks of ``comm``'s members (None where one is not in ``COMM_WORLD``)."""
    group, world = comm.Get_group(), mpi.COMM_WORLD.Get_group()
    try:
        ranks = mpi.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return None if any(r == mpi.UNDEFINED for r in ranks) else frozenset(int(r) for r in ranks)


class Watch:
    """One communicator's slot: the operation this rank waits in (what, number, start) or None, and
    the world ranks of the communicator (None: unknown)."""

    __slots__ = ("current", "members", "seq")

    def __init__(self, members: frozenset[int] | None = None) -> None:
        self.current: tuple[str, int, float] | None = None
        self.seq = 0
        self.members = members

    def begin(self, what: str) -> None:
        self.seq += 1
        self.current = (what, self.seq, time.monotonic())

    def call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``, a blocking MPI call, marked as ``what`` while it runs (about 70 ns more
        than the call alone)."""
        self.begin(what)
        try:
            return fn(*args, **kw)
        finally:
            self.current = None


class Watchdog:
    """A daemon thread that ends the MPI job when an operation of one of its :class:`Watch` slots
    has run ``seconds``: prints which one (:func:`stuck_text`), then ``MPI.COMM_WORLD.Abort(1)``.
    With ``world`` (a world backend's communicator, at MPI_THREAD_MULTIPLE) it also reads which ranks
    ended (:class:`Departures`) and ends the job ``grace`` seconds (``min(10, seconds / 2)``) after a
    symmetric collective lost a member so (:func:`ended_text`)."""

    def __init__(self, mpi: Any, seconds: float, rank: int, world: Any = None) -> None:
        self._mpi, self.seconds, self._rank = mpi, seconds, rank
        # MPI_Abort from this thread while the main one is in MPI needs MPI_THREAD_MULTIPLE (mpi4py's
        # default); below it the process ends itself, which the launcher takes as a failed rank too
        self._multiple = mpi.Query_thread() >= mpi.THREAD_MULTIPLE
        self._departures = Departures(mpi, world) if world is not None and self._multiple else None
        self._grace = min(10.0, seconds / 2)
        self._slots: list[Watch] = []
        self._stop = threading.Event()
        self._interval = min(1.0, seconds / 10)
        self._thread = threading.Thread(target=self._run, name="dtlab-mpi-watchdog", daemon=True)
        self._thread.start()
        # before mpi4py's MPI_Finalize (a C exit hook, after every atexit function): no MPI call of
        # this thread may run into it
        atexit.register(self._halt)

    def slot(self, members: frozenset[int] | None = None) -> Watch:
        watch = Watch(members)
        self._slots.append(watch)
        return watch

    def drop(self, watch: Watch) -> None:
        if watch in self._slots:
            self._slots.remove(watch)

    def stop(self) -> None:
        """Stop the thread (the backend closed); the ended-rank notice is still sent at exit."""
        self._stop.set()
        atexit.unregister(self._halt)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)  # it wakes at once: no MPI call of it outlives the backend

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if self._departures is not None:
                self._departures.read()
            now = time.monotonic()
            for watch in list(self._slots):
                current = watch.current
                if current is None:
                    continue
                what, seq, since = current
                gone = self.ended_among(watch, what, since, now)
                if gone:  # the precise cause first
                    self._fire(ended_text(self._rank, what, seq, gone))
                    return
                if now - since > self.seconds:
                    self._fire(stuck_text(self._rank, what, seq, self.seconds) + mismatch_hint(False))
                    return

    def ended_among(self, watch: Watch, what: str, since: float, now: float) -> list[int]:
        """The members of ``watch``'s communicator whose script ended, if ``what`` (started at
        ``since``) is a symmetric collective still running ``grace`` seconds after that and the notice."""
        if self._departures is None or not what.startswith(SYMMETRIC):
            return []
        members, grace = watch.members, self._grace
        ended = list(self._departures.ended.items())  # a copy: the thread adds to it
        return sorted(
            r for r, at in ended if (members is None or r in members) and now - max(at, since) > grace
        )

    def _fire(self, text: str) -> None:
        print(
            f"{text}. The MPI watchdog ends the job now (MPI_Abort); where a peer legitimately takes "
            "longer (a long preprocessing or save on one rank while the others wait), set its time with "
            "MPIBackend(watchdog=seconds) or init_backend(watchdog=seconds), None turns it off (dtlab "
            "train: backend.timeout)",
            file=sys.stderr,
            flush=True,
        )
        if self._multiple:
            end_mpi_job(self._mpi, 1)
        else:
            sys.stdout.flush()
            os._exit(1)


class Waits:
    """The waits of one backend: ``timeout`` (polled, raising) or blocking under ``watch``."""

    def __init__(
        self, rank: int, timeout: float | None, watch: Watch, checked: Any, dog: Watchdog | None = None
    ) -> None:
        self._rank, self.timeout, self.watch, self._checked, self._dog = rank, timeout, watch, checked, dog

    def run(self, blocking: Any, nonblocking: Any, args: tuple[Any, ...], what: str, **kw: Any) -> None:
        if self.timeout is not None:
            self.wait(nonblocking(*args, **kw), what)
            return
        self.watch.call(what, blocking, *args, **kw)

    def blocking(self, fn: Any, args: tuple[Any, ...], what: str) -> Any:
        """``fn(*args)``, an MPI call with no non-blocking form (``Comm.Split``), under the watch."""
        return self.watch.call(what, fn, *args)

    def wait(self, request: Any, what: str, status: Any = None) -> None:
        watch = self.watch
        if self.timeout is None:
            watch.call(what, request.Wait, status)
            return
        watch.seq += 1
        start = time.monotonic()
        deadline, spin, pause = start + self.timeout, start + 2e-3, 1e-5
        while not request.Test(status):  # polled for 2 ms as MPI's blocking calls are, then paused
            if (now := time.monotonic()) > deadline:
                raise CollectiveTimeoutError(
                    f"{stuck_text(self._rank, what, watch.seq, self.timeout)}"
                    f"{mismatch_hint(self._checked())}; the communicator is unusable now: end the job "
                    "with MPI.COMM_WORLD.Abort(1)",
                    operation=what,
                )
            if now >= spin:
                if self._dog is not None and (gone := self._dog.ended_among(watch, what, start, now)):
                    raise CollectiveTimeoutError(
                        f"{ended_text(self._rank, what, watch.seq, gone)}; the communicator is unusable "
                        "now: end the job with MPI.COMM_WORLD.Abort(1)",
                        operation=what,
                    )
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
