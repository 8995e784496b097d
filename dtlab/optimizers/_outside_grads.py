"""Gradients of trainable parameters in none of the optimizer's param groups.

torch's ``optimizer.zero_grad()`` clears the gradients of the optimizer's own parameters only: those of
a trainable parameter outside its groups keep adding up, for a second optimizer stepped after it
(``opt.step(); opt.zero_grad(); other.step()``) or for ``opt.add_param_group`` later, which steps them
with every gradient since. A model strategy clears all its gradient buffers at once; where the
gradients are whole (DDP, ZeRO-1 with ``gradient_sync="all_reduce"``) the ones outside the groups are
kept across the clear, as torch keeps them. Where each rank holds only its shard of flat buffers shared
with the optimizer's parameters (ZeRO-1/2/3, FSDP) they cannot be kept apart and are dropped: adding
such a parameter to the optimizer afterwards is refused, naming it and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from dtlab.errors import StrategyError
from dtlab.models.base import OptimizerTarget
from dtlab.models.dp._grad_guard import GradientStandIn

__all__ = ["OutsideGrads"]


class OutsideGrads:
    """What ``opt.zero_grad()`` does with the gradients outside the optimizer's groups."""

    def __init__(self) -> None:
        #: ``id(param) -> name`` of the parameters outside the groups whose gradients a clear dropped
        self.dropped: dict[int, str] = {}

    def zero_grad(self, model: OptimizerTarget, groups: list[dict[str, Any]], set_to_none: bool) -> None:
        """``model.zero_grad_buffers(set_to_none)``, keeping the whole gradients of the trainable
        parameters in none of ``groups`` (recording those it cannot keep)."""
        grouped = {id(p) for g in groups for p in g["params"]}
        kept: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for name, p in model.trainable_parameters():
            grad = p.grad
            if id(p) in grouped or grad is None:
                continue
            if isinstance(grad, GradientStandIn):  # this rank's shard only: dropped with the others
                self.dropped[id(p)] = name
            else:
                kept.append((p, grad.detach().clone()))
        model.zero_grad_buffers(set_to_none)
        for p, grad in kept:  # the next backward adds into it, as torch's
            p.grad = grad

    def check_added(self, who: str, params: list[torch.Tensor]) -> None:
        """Refuse ``add_param_group`` of parameters whose gradients a clear dropped."""
        names = [self.dropped[id(p)] for p in params if id(p) in self.dropped]
        if names:
            raise StrategyError(
                f"{who}.add_param_group(): parameters {names[:5]}{' ...' if len(names) > 5 else ''} were "
                "trainable outside this optimizer's param groups while it stepped. torch's zero_grad() "
                "clears only its groups' gradients, so torch would step these with every gradient they "
                "got since; here each rank holds only its shard of flat gradient buffers shared with the "
                "optimizer's parameters, and opt.zero_grad() cleared theirs too. Give the optimizer every "
                "trainable parameter from the start (a group of their own, with lr=0 until you set "
                "opt.param_groups[i]['lr']), or add the group before the first backward, or use "
                "DDPModel with DDPOptimizer, where these gradients are kept as in torch"
            )
