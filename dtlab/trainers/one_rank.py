"""``on_a_rank_thread``: run an in-memory world on a :class:`~dtlab.backends.threads.RankThread`, so
that a one-rank world (which ``run_world`` runs on the caller's thread) gets what each rank of a world
of several gets: its training draws (dropout) from a generator of its own
(:class:`~dtlab.trainers.rank_draws.RankDraws`), its samples' draws seeded as in ``DataLoader`` workers
(:class:`~dtlab.trainers.worker_draws.ThreadFetch`), and the process's global generators left alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from dtlab.backends.threads import RankThread, on_rank_thread

__all__ = ["on_a_rank_thread"]

T = TypeVar("T")


def on_a_rank_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a new :class:`RankThread` (on this thread where it is one), waited
    for; what it raises is raised here."""
    if on_rank_thread():
        return fn(*args, **kwargs)
    done: list[T] = []
    failed: list[BaseException] = []

    def body() -> None:
        try:
            done.append(fn(*args, **kwargs))
        except BaseException as exc:  # raised on the caller's thread
            failed.append(exc)

    thread = RankThread(target=body, name="dtlab-rank-0", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)  # short waits: the caller's signal handlers (SIGTERM, SIGINT) run meanwhile
    if failed:
        raise failed[0]
    return done[0]
