"""A plain torch optimizer stepped over a ZeRO-3/FSDP model's sharded parameters, refused before it writes.

Between uses such a parameter is parked (:meth:`FlatUnit.park`: a stand-in of its shape over one
element, every stride 0) and its gradient a :class:`~dtlab.models.dp._grad_guard.ShardedGradient`,
which refuses a plain optimizer naming the optimizer strategy. AdamW's decoupled weight decay
(``param.mul_(1 - lr * wd)``) writes into the parameter before it reads the gradient: torch then stops
with its overlap ``RuntimeError`` ("Please clone() the tensor"), whose advice does not apply. torch's
global step pre-hook, registered when the process builds its first ZeRO-3/FSDP model (a process that
builds none pays nothing at its steps), refuses any torch optimizer that is not an optimizer strategy
and holds such a stand-in, before its step, naming the fix. A step that would write into it fails
anyway; the check reads each parameter's strides (no memory, no sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtlab.core.torch_private import global_optimizer_step_pre_hooks
from dtlab.errors import StrategyError

__all__ = ["refuse_plain_step", "watch_plain_steps"]


def watch_plain_steps() -> None:
    """Register :func:`refuse_plain_step` as torch's global step pre-hook, once per process (a second
    registration, two rank threads racing here, only runs the check twice)."""
    if refuse_plain_step not in global_optimizer_step_pre_hooks():
        register_optimizer_step_pre_hook(refuse_plain_step)


def refuse_plain_step(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Raise if ``opt``, a plain torch optimizer, holds a parked ZeRO-3/FSDP parameter."""
    if hasattr(opt, "strategy_name") and hasattr(opt, "state_bytes"):  # an optimizer strategy
        return
    name = type(opt).__name__
    cls = f"torch.optim.{name}" if getattr(torch.optim, name, None) is type(opt) else name  # or the user's
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if p.numel() > 1 and not any(p.stride()):
                raise StrategyError(
                    f"{name}.step(): parameter {i} of param group {g} (shape {tuple(p.shape)}) "
                    "is sharded (ZeRO3Model, FSDPModel, or a mesh's zero3/fsdp): each rank holds only a "
                    "shard of it and of its gradient, inside the strategy, so a plain torch optimizer would "
                    "step a stand-in, not the parameter. Step with the optimizer strategy: "
                    f"opt = ZeRO3Optimizer(model, {cls}(model.parameters(), ...)) (it takes your torch "
                    "optimizer and its param groups), and clip with opt.clip_grad_norm_(max_norm)"
                )
