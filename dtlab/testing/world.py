"""``run_world``: run ``fn(backend, ...)`` on every rank of an in-memory world and collect the results."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from dtlab.backends.inmemory import InMemoryBackend, InMemoryWorld
from dtlab.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    RankFailedError,
    WorldAbortedError,
)

T = TypeVar("T")

__all__ = ["run_world"]


def run_world(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    timeout: float = 60.0,
    device: str | torch.device = "cpu",
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(backend, *args, **kwargs)`` on ``world_size`` in-memory ranks (one thread each).

    Returns the results in rank order. ``timeout`` (seconds) bounds every collective and
    point-to-point wait. A rank that raises aborts the world (the others are released at once) and
    this raises :class:`RankFailedError` naming the rank, with the original exception as
    ``__cause__``. A timeout or a mismatch of collectives is raised as such
    (:class:`CollectiveTimeoutError`, :class:`CollectiveMismatchError`).
    """
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
            threading.Thread(target=body, args=(r, world.backend(r)), name=f"dtlab-rank-{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if world.failure is not None:
        rank, exc = world.failure
        if isinstance(exc, CollectiveTimeoutError | CollectiveMismatchError):
            raise exc
        raise RankFailedError(rank, f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results
