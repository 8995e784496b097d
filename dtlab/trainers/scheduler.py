"""The LR scheduler a Trainer steps: what the Trainer calls on one (:class:`LRSchedulerLike`), the
check that a ``scheduler_factory`` returned one, and its state in checkpoints and elastic commits.

Every ``torch.optim.lr_scheduler`` class is a :class:`LRSchedulerLike` except ``ReduceLROnPlateau``
(a ``torch.optim.lr_scheduler.LRScheduler`` subclass since torch 2.2, but its ``step`` needs a metric,
and the Trainer steps the scheduler with none); so is an object of your own with these four methods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from dtlab.errors import ArgumentTypeError
from dtlab.lr_schedule import LENGTH_ARGS
from dtlab.untrusted import summary

__all__ = [
    "length_changes",
    "LRSchedulerLike",
    "SchedulerFactory",
    "check_scheduler",
    "check_scheduler_factory",
    "load_scheduler_state",
    "scheduler_base_rates",
    "scheduler_state",
    "set_scheduler_rates",
]


@runtime_checkable
class LRSchedulerLike(Protocol):
    """What the Trainer calls on its LR scheduler: ``step()`` once per applied optimizer step,
    ``get_last_lr()`` for the ``lr`` of the metrics and after a restore, ``state_dict()`` and
    ``load_state_dict()`` for checkpoints and elastic commits (with checkpoints on, the state must
    survive JSON unchanged)."""

    def step(self) -> object: ...
    def get_last_lr(self) -> Sequence[float | torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


#: builds the run's scheduler on the optimizer the Trainer built (this rank's local optimizer)
SchedulerFactory = Callable[[torch.optim.Optimizer], LRSchedulerLike]

_METHODS = ("step", "get_last_lr", "state_dict", "load_state_dict")
_FIX = (
    "return a torch.optim.lr_scheduler scheduler built on the optimizer the factory is given (e.g. "
    "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100)), or an object with step(), "
    "get_last_lr(), state_dict() and load_state_dict()"
)


def check_scheduler_factory(factory: object) -> None:
    """A ``scheduler_factory`` that is not callable (a scheduler built beforehand, say): an
    :class:`~dtlab.errors.ArgumentTypeError` naming it and the fix."""
    if not callable(factory):
        raise ArgumentTypeError(
            f"scheduler_factory={summary(factory)} is not callable: pass a function of the optimizer "
            "that builds the scheduler (e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, "
            "step_size=100)); the Trainer builds the optimizer, so a scheduler built beforehand would "
            "drive another one"
        )


def check_scheduler(value: object) -> LRSchedulerLike:
    """``value`` (what a ``scheduler_factory`` returned) as the scheduler the Trainer steps; anything
    else (``None``, an optimizer, a ``ReduceLROnPlateau``) is an
    :class:`~dtlab.errors.ArgumentTypeError` naming it and the fix, when the Trainer is built."""
    missing = [m for m in _METHODS if not callable(getattr(value, m, None))]
    if missing or not isinstance(value, LRSchedulerLike):
        hint = " (a factory without a return?)" if value is None else ""
        raise ArgumentTypeError(
            f"scheduler_factory returned {summary(value)}{hint}, not an LR scheduler: it has no "
            f"{', '.join(f'{m}()' for m in missing)}; {_FIX}"
        )
    try:
        params = inspect.signature(value.step).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): step() is tried at the first step
        return value
    needed = [
        p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if needed:
        raise ArgumentTypeError(
            f"scheduler_factory returned a {type(value).__name__}, whose step() needs {', '.join(needed)}: "
            "the Trainer calls step() with no argument, once per applied optimizer step "
            "(ReduceLROnPlateau needs a metric and is not supported); use a scheduler whose step() takes "
            "no argument"
        )
    return value


def scheduler_state(scheduler: LRSchedulerLike) -> dict[str, Any]:
    """What a checkpoint keeps of ``scheduler``: its ``state_dict()`` without LambdaLR's (and
    MultiplicativeLR's) ``lr_lambdas``, which are code (rebuilt by the config or the factory)."""
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def load_scheduler_state(scheduler: LRSchedulerLike, saved: Mapping[str, Any]) -> dict[str, Any]:
    """Load ``saved`` (what :func:`scheduler_state` kept) into ``scheduler``; returns what was loaded.
    A scheduler whose state holds ``lr_lambdas`` gets one ``None`` per function (its
    ``load_state_dict`` needs the entry, and ``None`` keeps the function the factory built)."""
    state = dict(saved)
    live = scheduler.state_dict()
    if "lr_lambdas" in live:
        state["lr_lambdas"] = [None] * len(live["lr_lambdas"])
    scheduler.load_state_dict(state)
    return state


def scheduler_base_rates(state: Mapping[str, Any]) -> list[float]:
    """The base learning rates in a torch scheduler's state (``base_lrs``: the optimizer's ``lr``, or
    ``max_lr / div_factor`` for OneCycleLR); empty for a scheduler without them."""
    return [float(x) for x in state.get("base_lrs", [])]


def set_scheduler_rates(scheduler: LRSchedulerLike, base: list[float], last: list[Any]) -> None:
    """After a resume rescaled the optimizer's learning rates: ``scheduler`` reports ``last`` from
    ``get_last_lr()`` and, when ``base`` is given, schedules from the base rates ``base``.

    torch has no public setter for either: ``get_last_lr()`` returns the private ``_last_lr``, which
    only ``step()`` and ``load_state_dict()`` write, and the base rates are ``base_lrs``. So this goes
    through ``load_state_dict``, the public way in: torch documents a scheduler's ``state_dict()`` as
    its attributes (every entry of ``__dict__`` but the optimizer) and ``load_state_dict`` as putting
    them back, so the live state is loaded with those two entries replaced. A scheduler whose state
    has neither entry (one of your own) is left as it is."""
    state = scheduler.state_dict()
    replaced = {}
    if base and "base_lrs" in state:
        replaced["base_lrs"] = list(base)
    if "_last_lr" in state:
        replaced["_last_lr"] = list(last)
    if replaced:
        scheduler.load_state_dict({**state, **replaced})


def length_changes(
    live: Mapping[str, Any], saved: Mapping[str, Any], where: str = ""
) -> list[tuple[str, Any, Any]]:
    """``(argument, saved value, live value)`` for each run length of a torch scheduler (``total_steps``,
    ``T_max``, ``total_iters``; a ``SequentialLR``'s or ``ChainedScheduler``'s parts too) that differs
    between ``saved`` and the ``live`` state built now: loading the saved state would silently keep the
    saved length."""
    out = [
        (where + k, saved[k], live[k])
        for k in LENGTH_ARGS
        if k in live and k in saved and live[k] != saved[k]
    ]
    parts, saved_parts = live.get("_schedulers"), saved.get("_schedulers")
    if isinstance(parts, list) and isinstance(saved_parts, list):
        for i, (a, b) in enumerate(zip(parts, saved_parts, strict=False)):
            if isinstance(a, Mapping) and isinstance(b, Mapping):
                out += length_changes(a, b, f"{where}_schedulers[{i}].")
    return out
