"""Argument checks shared by ``run_world`` and ``spawn_world``: one clear error before anything starts
(a float or string world size used to be a raw ``TypeError``, a NaN timeout was taken)."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence

from dtlab.errors import ArgumentError, ArgumentTypeError, integer

__all__ = ["check_fn", "check_may_die", "check_timeout", "check_world_size"]


def check_world_size(caller: str, world_size: object) -> None:
    n = integer(world_size)
    if n is None:
        raise ArgumentTypeError(
            f"{caller}: world_size must be an int, got {world_size!r} ({type(world_size).__name__}); "
            f"e.g. {caller}(2, fn)"
        )
    if n < 1:
        raise ArgumentError(f"{caller}: world_size must be >= 1, got {world_size}")


def check_timeout(caller: str, name: str, timeout: object) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):  # NumPy's too
        raise ArgumentTypeError(
            f"{caller}: {name} must be a number of seconds, got {timeout!r} ({type(timeout).__name__})"
        )
    if not (math.isfinite(timeout) and float(timeout) > 0):
        raise ArgumentError(
            f"{caller}: {name} must be a finite number of seconds > 0, got {timeout!r} "
            "(every wait is bounded), e.g. 60"
        )


def check_fn(caller: str, fn: object) -> None:
    """``fn`` is a function each rank can call (a generator function would run nothing: each rank
    would return a generator object, unstarted)."""
    if not callable(fn):
        raise ArgumentTypeError(
            f"{caller}: fn must be a function of the rank's backend, got {fn!r} ({type(fn).__name__}); "
            f"e.g. {caller}(2, train) with def train(backend): ..."
        )
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise ArgumentTypeError(
            f"{caller}: fn={getattr(fn, '__qualname__', fn)!r} is a generator or async function, so "
            "calling it on a rank would run none of its body; make it a plain function that returns "
            "its result"
        )


def check_may_die(caller: str, may_die: Sequence[int], world_size: int) -> None:
    """Every rank ``may_die`` names is a rank of the world (a rank outside it would excuse no one)."""
    bad = [r for r in may_die if integer(r) is None or not 0 <= r < world_size]
    if bad:
        raise ArgumentError(f"{caller}: may_die={list(may_die)} names {bad}, not ranks of [0, {world_size})")
