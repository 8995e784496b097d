"""Argument checks shared by ``run_world`` and ``spawn_world``: one clear error before anything starts
(a float or string world size used to be a raw ``TypeError``, a NaN timeout was taken)."""

from __future__ import annotations

import math

from dtlab.errors import ArgumentError, ArgumentTypeError

__all__ = ["check_timeout", "check_world_size"]


def check_world_size(caller: str, world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ArgumentTypeError(
            f"{caller}: world_size must be an int, got {world_size!r} ({type(world_size).__name__}); "
            f"e.g. {caller}(2, fn)"
        )
    if world_size < 1:
        raise ArgumentError(f"{caller}: world_size must be >= 1, got {world_size}")


def check_timeout(caller: str, name: str, timeout: object) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ArgumentTypeError(
            f"{caller}: {name} must be a number of seconds, got {timeout!r} ({type(timeout).__name__})"
        )
    if not (math.isfinite(timeout) and timeout > 0):
        raise ArgumentError(
            f"{caller}: {name} must be a finite number of seconds > 0, got {timeout!r} "
            "(every wait is bounded), e.g. 60"
        )
