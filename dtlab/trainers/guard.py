"""Step guards: skip steps with non-finite loss or gradients, and early stopping. Both decide on
values every rank agrees on, so every rank takes the same branch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtlab.errors import ArgumentError, DtlabError, integer, real

__all__ = ["EarlyStopping", "NonFiniteError", "NonFiniteGuard"]


class NonFiniteError(DtlabError):
    """Too many consecutive steps had a non-finite loss or gradient on some rank."""


@dataclass
class NonFiniteGuard:
    max_in_row: int
    skipped: int = 0
    in_row: int = 0
    skipped_steps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:  # as train.max_nonfinite_steps (ge=1): -1 would stop at the first
        self.max_in_row = _count("NonFiniteGuard.max_in_row", self.max_in_row, 1)

    def update(self, finite: bool, step: int) -> None:
        """Record the agreed verdict of ``step``; raises after ``max_in_row`` skipped steps in a row."""
        if finite:
            self.in_row = 0
            return
        self.skipped += 1
        self.in_row += 1
        self.skipped_steps.append(step)
        if self.in_row >= self.max_in_row:
            raise NonFiniteError(
                f"{self.in_row} consecutive steps (up to step {step}) had a non-finite loss or gradient on "
                f"some rank (train.max_nonfinite_steps={self.max_in_row}); lower optimizer.lr, enable "
                "optimizer.clip_grad_norm, or check the data"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "in_row": self.in_row, "skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped, self.in_row = int(state["skipped"]), int(state["in_row"])
        self.skipped_steps = [int(s) for s in state["skipped_steps"]]


@dataclass
class EarlyStopping:
    """Stop when the eval loss has not improved by ``min_delta`` for ``patience`` evaluations."""

    patience: int
    min_delta: float = 0.0
    best: float | None = None
    bad_evals: int = 0

    def __post_init__(self) -> None:  # as train.early_stopping_patience (ge=0: 0 is off)
        self.patience = _count("EarlyStopping.patience", self.patience, 0)
        delta = real(self.min_delta)
        if delta is None or delta < 0:
            raise ArgumentError(f"EarlyStopping.min_delta must be a number >= 0, got {self.min_delta!r}")
        self.min_delta = delta

    def update(self, eval_loss: float) -> bool:
        """Local verdict (the trainer turns it into a consensus with ``agree``)."""
        if self.patience <= 0:
            return False
        if self.best is None or eval_loss < self.best - self.min_delta:
            self.best, self.bad_evals = eval_loss, 0
        else:
            self.bad_evals += 1
        return self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.bad_evals = int(state["bad_evals"])


def _count(name: str, value: object, low: int) -> int:
    n = integer(value)
    if n is None or n < low:
        raise ArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return n
