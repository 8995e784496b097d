"""Running an in-memory world off the caller's thread, and stopping it on Ctrl-C.

``on_a_rank_thread``: run an in-memory world on a :class:`~dtlab.backends.threads.RankThread`, so
that a one-rank world (which ``run_world`` runs on the caller's thread) gets what each rank of a world
of several gets: its training draws (dropout) from a generator of its own
(:class:`~dtlab.trainers.rank_draws.RankDraws`), its samples' draws seeded as in ``DataLoader`` workers
(:class:`~dtlab.trainers.worker_draws.ThreadFetch`), and the process's global generators left alone.

``in_background``: the caller waits for a thread running the world; a ``KeyboardInterrupt`` there
(Ctrl-C in a notebook or script) sets the run's :class:`~dtlab.trainers.preemption.StopRequest`, as
``dtlab train``'s SIGINT handler does: the ranks stop after their next step (with a final checkpoint
when ``checkpoint.dir`` is set), then ``KeyboardInterrupt`` is raised here saying where the run
stopped. A second ``KeyboardInterrupt``, or ``grace`` seconds without the ranks stopping, leaves them
behind as daemon threads (the stop still set) and raises at once."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from dtlab.backends.threads import RankThread, on_rank_thread
from dtlab.trainers.preemption import StopRequest

__all__ = ["in_background", "on_a_rank_thread"]

T = TypeVar("T")


def on_a_rank_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new :class:`RankThread` (on this thread where it is one), waited
    for; what it raises is raised here."""
    if on_rank_thread():
        return fn(*args, **kwargs)
    return in_background(lambda: fn(*args, **kwargs), rank_thread=True)


def in_background(
    fn: Callable[[], T],
    *,
    rank_thread: bool,
    stop: StopRequest | None = None,
    grace: float = 60.0,
    stopped: Callable[[T], str] = lambda _: "",
) -> T:
    """``fn()`` on a new daemon thread (a :class:`RankThread` if ``rank_thread``), waited for; what it
    raises is raised here. With ``stop``: a ``KeyboardInterrupt`` while waiting stops the run as the
    module says; ``stopped(result)`` describes where it stopped, for the ``KeyboardInterrupt``."""
    done: list[T] = []
    failed: list[BaseException] = []
    ended = threading.Event()  # waited on, not the thread: an interrupted Thread.join (Python < 3.13)
    # can mark a running thread as ended

    def body() -> None:
        try:
            done.append(fn())
        except BaseException as exc:  # raised on the caller's thread
            failed.append(exc)
        finally:
            ended.set()

    thread = (RankThread if rank_thread else threading.Thread)(
        target=body, name="dtlab-rank-0" if rank_thread else "dtlab-world", daemon=True
    )
    thread.start()
    try:
        while not ended.wait(0.1):  # short waits: the caller's signal handlers (SIGTERM, SIGINT) run
            pass
    except KeyboardInterrupt:
        if stop is None:
            raise
        _stop(ended, stop, grace)
        thread.join()  # it has ended its work: gone at once
        if failed:
            raise KeyboardInterrupt(
                f"dtlab: the in-memory run failed while stopping: {type(failed[0]).__name__}: {failed[0]}"
            ) from failed[0]
        raise KeyboardInterrupt(f"dtlab: {stopped(done[0])}") from None
    thread.join()
    if failed:
        raise failed[0]
    return done[0]


def _stop(ended: threading.Event, stop: StopRequest, grace: float) -> None:
    """Ask the ranks to stop and wait for them up to ``grace`` s; else raise, leaving them behind."""
    why = "a second KeyboardInterrupt"
    if not stop.is_set():  # else this is the second interrupt (the first set the stop): leave at once
        deadline = time.monotonic() + grace
        try:  # from the request on: an interrupt at any point is the second one
            stop.request("KeyboardInterrupt")
            print(
                "dtlab: KeyboardInterrupt: the in-memory ranks stop after their current step (waiting up "
                f"to {grace:g} s; interrupt again to leave them running)",
                file=sys.stderr,
                flush=True,
            )
            while not ended.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
            why = f"{grace:g} s after the stop request (backend.timeout)"
        except KeyboardInterrupt:
            pass
    if not ended.is_set():
        raise KeyboardInterrupt(
            f"dtlab: in-memory ranks left running after {why}: they are daemon threads of this process "
            f"and stop at their next step boundary (stop request: {stop.reason}); every committed "
            "checkpoint is intact, a save in progress may leave a .tmp-* directory"
        ) from None
