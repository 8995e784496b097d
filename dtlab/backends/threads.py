"""``run_world``: run ``fn(backend, ...)`` on every rank of an in-memory world and collect the results;
``RankThread``: the thread of one rank of such a world."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch

from dtlab.backends._run_args import check_fn, check_timeout, check_world_size
from dtlab.backends.inmemory import InMemoryBackend, InMemoryWorld
from dtlab.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankFailedError,
    WorldAbortedError,
)

T = TypeVar("T")

__all__ = ["RankThread", "on_rank_thread", "run_world"]


class RankThread(threading.Thread):
    """The thread of one rank of an in-memory world (``run_world`` runs a one-rank world on the caller's
    thread): it shares torch's global RNG with the process's other ranks, so what must draw the same
    numbers twice (an activation checkpoint's recomputation) draws from a generator of its own there
    (:class:`dtlab.core.replayed_draws.ReplayedDraws`)."""


def on_rank_thread() -> bool:
    """Whether this thread is a :class:`RankThread` (cheap: one ``isinstance``)."""
    return isinstance(threading.current_thread(), RankThread)


def run_world(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 60.0,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(backend, *args, **kwargs)`` on ``world_size`` in-memory ranks (one thread each).

    Returns the results in rank order. ``world_size`` is an int >= 1; ``timeout`` (finite seconds > 0)
    bounds every collective and point-to-point wait. A rank that raises aborts the world (the others
    are released at once) and this raises :class:`RankFailedError` naming the rank, with the
    original exception as ``__cause__``. A timeout or a mismatch of collectives is raised as such
    (:class:`CollectiveTimeoutError`, :class:`CollectiveMismatchError`). After a failure, ranks busy
    outside any collective (which an abort cannot interrupt) get ``timeout`` more seconds to finish;
    then this raises anyway and leaves their (daemon) threads behind.
    """
    check_world_size("run_world", world_size)
    check_fn("run_world", fn)
    check_timeout("run_world", "timeout", timeout)
    world = InMemoryWorld(world_size, timeout=timeout, device=device)
    results: list[Any] = [None] * world_size

    def body(rank: int, backend: InMemoryBackend) -> None:
        try:
            results[rank] = fn(backend, *args, **kwargs)
        except WorldAbortedError:
            pass  # released because another rank failed first; that rank is reported
        except BaseException as exc:  # every failure must abort the world
            world.abort(rank, exc)
        else:
            world.mark_exited(rank)

    if world_size == 1:
        body(0, world.backend(0))
    else:
        threads = [
            RankThread(target=body, args=(r, world.backend(r)), name=f"dtlab-rank-{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
        left_behind = _join(threads, world)
    if world.failure is not None:
        rank, exc = world.failure
        if isinstance(exc, CollectiveTimeoutError | CollectiveMismatchError):
            raise exc
        note = (
            f" (rank(s) {left_behind} were still running outside any collective {world.timeout:g}s "
            "later and were left behind)"
            if world_size > 1 and left_behind
            else ""
        )
        raise RankFailedError(
            rank, f"rank {rank} failed: {type(exc).__name__}: {exc}{note}{_half_imported(exc)}"
        ) from exc
    return results


def _half_imported(exc: BaseException) -> str:
    """A hint where a rank saw a module another rank was still importing (the name it missed is there
    now): ranks are threads of one process, and a lazily importing package (transformers 5) is not safe
    to import from two of them at once."""
    if isinstance(exc, AttributeError):  # a lazy module's own __getattr__ may set neither obj nor name
        said = re.fullmatch(r"module '?([\w.]+)'? has no attribute '?(\w+)'?", str(exc))
        module, name = (sys.modules.get(said[1]), said[2]) if said else (exc.obj, exc.name)
        missed = isinstance(module, ModuleType) and name is not None and hasattr(module, name)
    else:
        missed = isinstance(exc, ImportError) and "partially initialized module" in str(exc)
    if not missed:
        return ""
    return (
        ". The name is there now: in-memory ranks are threads of one process, and a module first imported "
        "inside the rank function by several ranks at once can be seen half-imported (transformers' lazy "
        "import is not thread-safe); import it, and the names you use from it, at the top of the script"
    )


def _join(threads: Sequence[threading.Thread], world: InMemoryWorld) -> list[int]:
    """Wait for every rank; once the world has failed, give the ranks still busy outside collectives
    (which an abort cannot interrupt) ``world.timeout`` seconds, then return their ranks."""
    deadline: float | None = None
    for t in threads:
        while t.is_alive():
            t.join(0.05 if deadline is None else max(0.0, deadline - time.monotonic()))
            if world.failure is not None and deadline is None:
                deadline = time.monotonic() + world.timeout
            if deadline is not None and time.monotonic() >= deadline:
                return [r for r, th in enumerate(threads) if th.is_alive()]
    return []
