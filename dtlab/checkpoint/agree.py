"""Agreement on failure where ranks read input from elsewhere (a checkpoint, ``latest``, an elastic
commit): each rank tells whether its read failed, so every rank raises the same named error at once
instead of some waiting in the next collective for a rank that has already given up (on Gloo, until
its timeout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import CheckpointError, DtlabError

__all__ = ["agree", "read_on_src"]

T = TypeVar("T")


def agree(
    backend: CommunicationBackend,
    problem: str | None,
    what: str,
    error: type[DtlabError] = CheckpointError,
) -> None:
    """Collective: ``problem`` is this rank's failure (``None``: it succeeded). When any rank failed,
    every rank raises one ``error`` (a :class:`CheckpointError`) naming the failed ranks and the first
    problem."""
    problems = backend.all_gather_object(problem)
    failed = [r for r, p in enumerate(problems) if p is not None]
    if failed:
        raise error(f"{what} failed on rank{'s' if len(failed) > 1 else ''} {failed}: {problems[failed[0]]}")


def read_on_src(backend: CommunicationBackend, src: int, read: Callable[[], T], what: str) -> T:
    """Collective: rank ``src`` calls ``read()`` and broadcasts its result; a dtlab error or ``OSError``
    it meets is broadcast instead and raised on every rank as a :class:`CheckpointError`."""
    msg: tuple[bool, object] | None = None
    if backend.rank == src:
        try:
            msg = (True, read())
        except (DtlabError, OSError) as exc:
            msg = (False, f"{type(exc).__name__}: {exc}")
    ok, value = backend.broadcast_object(msg, src=src)
    if not ok:
        raise CheckpointError(f"{what} failed on rank {src}: {value}")
    return cast(T, value)
