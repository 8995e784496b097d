"""Learning-rate schedules: linear warm-up, then cosine decay, step decay or constant.

All are ``torch.optim.lr_scheduler.LambdaLR`` over the optimizer strategy's local optimizer, so their
state is plain numbers (JSON in checkpoints). Any other ``torch.optim.lr_scheduler`` can be passed to
the trainer through ``scheduler_factory``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dtlab.config import OptimizerConfig

__all__ = ["build_scheduler", "lr_factor"]


def lr_factor(cfg: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate at step ``s`` (0-based)."""
    warm = cfg.warmup_steps

    def factor(s: int) -> float:
        if warm and s < warm:
            return (s + 1) / warm
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "step":
            return float(cfg.gamma ** ((s - warm) // cfg.step_size))
        span = max(1, total_steps - warm)
        progress = min(1.0, (s - warm) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))
