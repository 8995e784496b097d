"""The user's exception of the raised-step tests and where it is raised (no tests here): a forward hook
on one block that raises in the forward, or makes its backward raise (a custom autograd Function, a
tensor hook on the block's output), or a loss function that raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

STEPS, BAD = 4, 1  # four steps, the second one raises
CASES = ("backward_function", "backward_hook", "forward", "forward_oom", "loss")


class BadBatch(Exception):
    """The user's own exception for a batch to skip."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BadBatch("a NaN check in backward")


@dataclass
class Trap:
    """Where the current step raises (None: nowhere); one per rank, installed on the Block."""

    case: str | None = None

    def after_block(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self.case == "forward":
            raise BadBatch("a NaN check in the forward")
        if self.case == "forward_oom":  # caught as such to retry with a smaller batch: keeps its type
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.case == "backward_function":
            return _RaiseInBackward.apply(out)
        if self.case == "backward_hook":

            def hook(grad: torch.Tensor) -> None:
                raise BadBatch("a NaN check in a tensor hook")

            out.register_hook(hook)
        return None

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, y)
        if self.case == "loss":
            raise BadBatch("a NaN loss")
        return loss
