"""Whether a backward pass over a module's parameters raised partway (an optimizer strategy that holds
a whole replica and installs no hooks of its own: ``AsyncSGDOptimizer``).

A backward that raises after some parameters got their gradient leaves the gradients partial: pushed
or stepped, or accumulated into by the next backward, they would carry part of the skipped batch.
Autograd runs a callback queued during a backward only when the whole pass succeeds, so a backward
whose callback never ran, found outside any backward, raised. Then the next forward with gradients
and the step are refused, naming the fix (``opt.zero_grad()``), as the data-parallel model strategies
do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dtlab.errors import StrategyError

__all__ = ["BackwardWatch"]


class BackwardWatch:
    """Watches the backward passes reaching ``params`` of ``module``; ``who`` names the owner in errors."""

    def __init__(self, module: nn.Module, params: Iterable[nn.Parameter], who: str) -> None:
        self.who = who
        self._open = False  # a backward produced a gradient and has not finished
        self._raised = False  # a backward raised partway: the gradients are partial until forget()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        module.register_forward_pre_hook(self._before_forward)

    def _on_grad(self, _: torch.Tensor) -> None:
        if self._open:
            return
        self._open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finished)  # noqa: SLF001 - torch's way to run after the whole backward (as torch DDP does)

    def _finished(self) -> None:
        self._open = False

    def _before_forward(self, *_: Any) -> None:
        self.check("the forward" if torch.is_grad_enabled() else None)

    def check(self, refused: str | None) -> None:
        """Refuse ``refused`` (None: only take note) while the gradients are partial."""
        if self._open and torch._C._current_graph_task_id() == -1:  # noqa: SLF001 - torch's query (torch.utils.checkpoint uses it): -1 outside any backward pass
            self._open, self._raised = False, True
        if self._raised and refused is not None:
            raise StrategyError(
                f"{self.who}: a backward pass raised partway (an exception from an autograd Function, a "
                "tensor hook or an out-of-memory error in backward) after some gradients were produced, so "
                f"the gradients are partial and {refused} is refused. Call opt.zero_grad() to skip that "
                "batch, as plain training would, then go on with the next one"
            )

    def forget(self) -> None:
        """``zero_grad()``: the partial gradients are dropped."""
        self.check(None)
        self._raised = False
