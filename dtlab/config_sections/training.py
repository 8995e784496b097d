"""The ``train`` section: the loop itself (steps, seed, precision, evaluation, early stopping)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dtlab.config_sections.base import Section


class TrainingConfig(Section):
    #: optimizer steps to train (a resumed run continues up to this step)
    steps: int = Field(default=300, ge=1)
    #: seed of the model's initialisation, the data order and dropout
    seed: int = 0
    #: compute dtype (``torch.autocast``; fp32 master parameters, outputs as computed); fp16 adds
    #: dynamic loss scaling agreed by every rank (an overflow anywhere skips the step and halves the scale)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: evaluate every N steps (and after the last); 0 disables evaluation
    eval_every: int = Field(default=50, ge=0)
    #: held-out batches per evaluation
    eval_batches: int = Field(default=4, ge=1)
    #: stop when the eval loss has not improved by ``early_stopping_min_delta`` for N evaluations; 0: off
    early_stopping_patience: int = Field(default=0, ge=0)
    #: the least eval-loss improvement that counts for early stopping
    early_stopping_min_delta: float = Field(default=0.0, ge=0)
    #: stop with an error after this many consecutive steps with a non-finite loss or gradient
    max_nonfinite_steps: int = Field(default=5, ge=1)
