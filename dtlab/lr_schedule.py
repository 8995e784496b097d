"""Learning-rate schedules: linear warm-up, then cosine decay, step decay or constant; or any
``torch.optim.lr_scheduler`` class by name (``optimizer.schedule=torch``).

The built-in schedules are ``torch.optim.lr_scheduler.LambdaLR`` over the optimizer strategy's local
optimizer, so their state is plain numbers (JSON in checkpoints). A torch scheduler named in the config
is built with ``optimizer.torch_scheduler_args``; ``total_steps``, ``T_max`` and ``total_iters`` default
to ``train.steps``. Any other scheduler object can be passed to the trainer through
``scheduler_factory``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the config section where it is defined (``dtlab.config`` imports this module)
    from dtlab.config_sections.optimizer import OptimizerConfig

__all__ = [
    "LENGTH_ARGS",
    "build_scheduler",
    "check_run_length",
    "check_torch_scheduler",
    "lr_factor",
    "torch_scheduler_names",
]

#: classes that need code or another scheduler (LambdaLR, ...) or a metric (ReduceLROnPlateau)
_NOT_FROM_CONFIG = frozenset(
    {"LRScheduler", "_LRScheduler", "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler",
     "ReduceLROnPlateau"}
)  # fmt: skip
#: arguments that default to the run's length when not given
LENGTH_ARGS = ("total_steps", "T_max", "total_iters")


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


def torch_scheduler_names() -> list[str]:
    """The ``torch.optim.lr_scheduler`` classes ``optimizer.torch_scheduler`` may name."""
    sched = torch.optim.lr_scheduler
    return sorted(
        name
        for name, obj in vars(sched).items()
        if inspect.isclass(obj) and issubclass(obj, sched.LRScheduler) and name not in _NOT_FROM_CONFIG
    )


def _torch_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    name = cfg.torch_scheduler
    allowed = torch_scheduler_names()
    if name not in allowed:
        raise ValueError(
            f"optimizer.torch_scheduler={name!r} is not allowed: use one of {allowed} "
            "(LambdaLR and the like need code: pass scheduler_factory to the Trainer from Python)"
        )
    cls = getattr(torch.optim.lr_scheduler, name)
    params = [p for p in inspect.signature(cls).parameters if p not in ("self", "optimizer")]
    kwargs: dict[str, Any] = {k: total_steps for k in LENGTH_ARGS if k in params}
    kwargs.update(cfg.torch_scheduler_args)
    try:
        scheduler: torch.optim.lr_scheduler.LRScheduler = cls(optimizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"optimizer.torch_scheduler_args={dict(cfg.torch_scheduler_args)!r} do not fit {name} ({exc}); "
            f"its arguments: {', '.join(params)}"
        ) from None
    return scheduler


def check_torch_scheduler(cfg: OptimizerConfig, total_steps: int) -> None:
    """Build the configured torch scheduler on a throw-away optimizer: a ``ValueError`` naming the field."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    check_run_length(_torch_scheduler(opt, cfg, total_steps), total_steps, "optimizer.torch_scheduler_args")


def check_run_length(scheduler: object, steps: int, given: str) -> None:
    """A ``OneCycleLR`` shorter than the run (``total_steps`` below ``train.steps``) would stop it
    mid-way with torch's raw "Tried to step ... times": refused before the run, naming both lengths
    and the fixes (``given``: where the scheduler came from)."""
    total = getattr(scheduler, "total_steps", None)
    if (
        isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
        and isinstance(total, int)
        and total < steps
    ):
        raise ValueError(
            f"the LR scheduler (OneCycleLR from {given}) runs {total} steps (total_steps={total}) but "
            f"train.steps={steps}: torch would stop the run at step {total + 1}. Give it total_steps="
            f"{steps} (dtlab passes train.steps where torch_scheduler_args leaves it out), or set "
            f"train.steps={total}"
        )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.schedule == "torch":
        return _torch_scheduler(optimizer, cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))
