"""The Trainer's saved state (a checkpoint's ``meta.json`` or an elastic commit) checked like a config
before anything is restored from it.

Each part is compared with the state this Trainer would save now: the LR scheduler's, the non-finite
guard's, early stopping's, the loss scaler's and the data position: a saved part may hold only keys the
live one has, each of the same kind (a number where a number is, a list of the same length, a string
where a string is), so a crafted value can neither replace an attribute (a scheduler's ``optimizer``
set to ``1``) nor reach a constructor as the wrong type. The step must be an integer and the step the
checkpoint is named by. Every problem is one :class:`~dtlab.errors.CheckpointError` naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from dtlab.checkpoint.validate import MAX_STEP, is_int
from dtlab.errors import CheckpointError
from dtlab.optimizers.grad_scaler import DynamicLossScaler
from dtlab.trainers.feed import DataFeed
from dtlab.trainers.guard import EarlyStopping, NonFiniteGuard
from dtlab.trainers.scheduler import LRSchedulerLike
from dtlab.untrusted import summary

__all__ = ["Resumable", "check_saved_state"]


class Resumable(Protocol):
    """The trainer-level state a checkpoint or an elastic commit keeps (a Trainer is one): the parts
    are loaded in place; a restore sets ``step`` and ``start_step``."""

    step: int
    start_step: int

    @property
    def scheduler(self) -> LRSchedulerLike: ...
    @property
    def feed(self) -> DataFeed: ...
    @property
    def guard(self) -> NonFiniteGuard: ...
    @property
    def early(self) -> EarlyStopping: ...
    @property
    def scaler(self) -> DynamicLossScaler | None: ...


_MAX_ITEMS = 1_000_000
_INT = 2**63


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < _INT


def _like(saved: Any, ref: Any, path: str) -> str | None:
    """Why ``saved`` is not of the same kind as ``ref`` (the live state); ``None`` when it is."""
    if ref is None:
        ok = saved is None or isinstance(saved, bool) or _number(saved)
        return None if ok else f"{path}={summary(saved)}, expected a number or null"
    if isinstance(ref, bool):
        return None if isinstance(saved, bool) else f"{path}={summary(saved)}, expected true or false"
    if isinstance(ref, int | float):  # an int the live state holds may be saved as a float (and back)
        return None if _number(saved) else f"{path}={summary(saved)}, expected a finite number"
    if isinstance(ref, str):
        return None if isinstance(saved, str) else f"{path}={summary(saved)}, expected a string"
    if isinstance(ref, list | tuple):
        if not isinstance(saved, list) or len(saved) > _MAX_ITEMS or (ref and len(saved) != len(ref)):
            want = f"a list of {len(ref)}" if ref else "a list"
            return f"{path}={summary(saved)}, expected {want}"
        for i, item in enumerate(saved):
            problem = _like(item, ref[i] if ref else None, f"{path}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(ref, dict):
        if not isinstance(saved, dict):
            return f"{path}={summary(saved)}, expected an object"
        for k, v in saved.items():
            if k not in ref:
                keys = ", ".join(map(str, ref))
                return f"{path} holds {summary(k)}, a key the live state does not have (keys: {keys})"
            problem = _like(v, ref[k], f"{path}.{k}")
            if problem is not None:
                return problem
        return None
    return None  # a live value of another kind (a tensor in a scheduler's state): not saved as JSON


def _known(saved: Any, scheduler: LRSchedulerLike) -> Any:
    """The saved scheduler state without keys another torch version keeps and this one does not
    (harmless: restored as unused attributes); a key naming an attribute of the live scheduler that is
    not state (``optimizer``) stays, and is refused."""
    if not isinstance(saved, dict):
        return saved
    live = scheduler.state_dict()
    return {k: v for k, v in saved.items() if k in live or hasattr(scheduler, str(k))}


def check_saved_state(live: Resumable, state: Any, step: int, where: str) -> None:
    """``state`` (a ``meta.json`` or an elastic commit's state, saved at ``step``) against what
    ``live`` would save now; a :class:`CheckpointError` naming ``where`` and the field."""
    if not isinstance(state, dict) or not isinstance(state.get("trainer"), dict):
        raise CheckpointError(
            f"{where} holds no trainer state (written by save_checkpoint outside the Trainer?); the "
            "Trainer resumes only checkpoints it wrote"
        )
    t = state["trainer"]
    problem = None
    if not is_int(t.get("step"), 0, MAX_STEP):
        problem = f"trainer.step={summary(t.get('step'))}, expected an integer from 0 to {MAX_STEP}"
    elif t["step"] != step:
        problem = f"trainer.step={t['step']}, but the checkpoint is of step {step}"
    parts: list[tuple[str, Any, Any]] = [
        ("trainer.scheduler", _known(t.get("scheduler"), live.scheduler), live.scheduler.state_dict()),
        ("trainer.guard", t.get("guard"), live.guard.state_dict()),
        ("trainer.early_stopping", t.get("early_stopping"), live.early.state_dict()),
        ("data_position", state.get("data_position"), live.feed.state_dict()),
    ]
    if live.scaler is not None and t.get("loss_scaler") is not None:
        parts.append(("trainer.loss_scaler", t["loss_scaler"], live.scaler.state_dict()))
    for name, saved, ref in parts:
        if problem is None:
            problem = _like(saved, ref, name) if saved is not None else f"{name} is missing"
    if problem is not None:
        raise CheckpointError(f"{where} is corrupted: {problem}; resume from another step directory")
