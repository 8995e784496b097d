"""``DynamicLossScaler``: fp16 loss scaling agreed by every rank (torch ``GradScaler``'s rule).

The loss is multiplied by ``scale`` before backward. The trainer's finite check of the gradients is a
consensus over every rank and every shard, so an overflow anywhere skips the step on every rank and
every rank halves the same scale; after ``growth_interval`` applied steps in a row the scale doubles.
The gradients are divided by the scale before clipping and the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DynamicLossScaler"]


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    overflows: int = 0

    def update(self, overflow: bool) -> None:
        """After every step's (agreed) finite check."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.overflows = int(state["good_steps"]), int(state["overflows"])
