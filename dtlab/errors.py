"""Every error dtlab raises on purpose derives from :class:`DtlabError`; the argument checks every
layer shares (a switch that must be a bool, a path) are here, beside the errors they raise."""

from __future__ import annotations

import math
import numbers
import os


class DtlabError(Exception):
    """Base class of all dtlab errors."""


class RankFailedError(DtlabError):
    """A rank of a world raised; ``rank`` names it and ``__cause__`` holds the original exception."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class ArgumentError(DtlabError, ValueError):
    """A bad argument value (sizes that do not fit, a root or rank out of range, a world size < 1, a
    timeout <= 0): raised before any communication, the message names the values and what fits."""


class ArgumentTypeError(DtlabError, TypeError):
    """An argument of the wrong type or dtype (not a tensor, an unsupported dtype, AVG on integers)."""


class WorldAbortedError(DtlabError):
    """Raised on the ranks that were waiting when another rank failed and aborted the world."""


class CollectiveTimeoutError(DtlabError, TimeoutError):
    """A collective or point-to-point wait was not completed within the timeout."""

    def __init__(self, message: str, missing_ranks: tuple[int, ...] = (), operation: str = "") -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.operation = operation


class CollectiveMismatchError(DtlabError):
    """Ranks called different collectives (kind, shape, dtype, reduce op or root) at the same point."""


class BackendInitError(DtlabError):
    """A backend could not be started (missing launcher variables, engine not installed, no GPU)."""


class CheckpointError(DtlabError):
    """A checkpoint is missing, truncated, corrupted or does not fit the model it is loaded into."""


class UnsafePathError(DtlabError):
    """A file dtlab was to write is in the way in a way it will not write through (a directory, a
    parent that is a file, a file planted while it was being created): nothing was written there."""


class ConfigError(DtlabError, ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


class DataError(DtlabError, ValueError):
    """The training data does not fit the model: a target outside the model's output range (the message
    names the sample, the value and the range, and the rank when found during a step)."""


class StrategyError(DtlabError, ValueError):
    """A model or optimizer strategy was used in a way it does not support."""


def every_rank_saves(call: str, part: str) -> str:
    """The fix for a collective ``call`` (``model.state_dict()``, ``opt.state_dict()``) made on one rank
    only, torch DDP's habit ``if rank == 0: torch.save(model.state_dict(), path)``: each rank holds
    only ``part``."""
    return (
        f"each holds only {part}, so every rank must call it. Call sd = {call} on every rank, then save "
        "on one (if rank == 0: torch.save(sd, path)), or save each rank's part with dtlab.checkpoint"
    )


def check_switches(who: str = "", /, **switches: object) -> None:
    """Refuses ``switches`` that are not bools (``strict='no'`` would be taken as true, ``None`` as
    false); ``who``, the call named first."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            where = f"{who}: " if who else ""
            raise ArgumentTypeError(f"{where}{name} must be True or False, got {value!r}")


def check_path(who: str, name: str, value: object, what: str = "a path") -> None:
    """Refuses a ``value`` that is not a path (``str`` or ``os.PathLike``) where ``who`` takes one as
    ``name`` (``what``: the path it names), before os's ``expected str, bytes or os.PathLike object``."""
    if not isinstance(value, str | os.PathLike):
        raise ArgumentTypeError(
            f"{who}: {name} must be {what} (str or pathlib.Path), got {value!r} ({type(value).__name__})"
        )


def integer(value: object) -> int | None:
    """``value`` as a Python ``int`` where it is an integer as torch takes one (Python's, NumPy's:
    ``numbers.Integral``), else ``None`` (a bool too: ``True`` is no count)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def real(value: object) -> int | float | None:
    """``value`` as a finite Python ``int`` or ``float`` where it is a real number as torch takes one
    (NumPy's too), else ``None`` (a bool, ``nan``, ``inf``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return integer(value) if isinstance(value, numbers.Integral) else float(value)
    return None
