"""A plain torch optimizer stepped over a ZeRO-3/FSDP model's sharded parameters, refused before it writes.

Between uses such a parameter is parked (:meth:`FlatUnit.park`: a stand-in of its shape over one
element, every stride 0) and its gradient a :class:`~dtlab.models.dp._grad_guard.ShardedGradient`,
which refuses a plain optimizer naming the optimizer strategy. AdamW's decoupled weight decay
(``param.mul_(1 - lr * wd)``) writes into the parameter before it reads the gradient: torch then stops
with its overlap ``RuntimeError`` ("Please clone() the tensor"), whose advice does not apply. torch's
global step pre-hook, registered once when this module is imported, refuses any torch optimizer that
is not an optimizer strategy and holds such a stand-in, before its step, naming the fix. A step that
would write into it fails anyway; the check reads each parameter's strides (no memory, no sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dtlab.errors import StrategyError

__all__ = ["refuse_plain_step"]


def refuse_plain_step(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Raise if ``opt``, a plain torch optimizer, holds a parked ZeRO-3/FSDP parameter."""
    if hasattr(opt, "strategy_name") and hasattr(opt, "state_bytes"):  # an optimizer strategy
        return
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if p.numel() > 1 and not any(p.stride()):
                raise StrategyError(
                    f"{type(opt).__name__}.step(): parameter {i} of param group {g} (shape {tuple(p.shape)}) "
                    "is sharded (ZeRO3Model, FSDPModel, or a mesh's zero3/fsdp): each rank holds only a "
                    "shard of it and of its gradient, inside the strategy, so a plain torch optimizer would "
                    "step a stand-in, not the parameter. Step with the optimizer strategy: "
                    "opt = ZeRO3Optimizer(model, "
                    f"torch.optim.{type(opt).__name__}(model.parameters(), ...)) (it takes your torch "
                    "optimizer and its param groups), and clip with opt.clip_grad_norm_(max_norm)"
                )


register_optimizer_step_pre_hook(refuse_plain_step)
