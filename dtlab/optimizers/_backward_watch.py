"""Whether a backward pass over a module's parameters raised partway, for an optimizer strategy that holds
a whole replica and installs no hooks of its own (``AsyncSGDOptimizer``): the hooks of a
:class:`~dtlab.core.backward.BackwardPass`; after such a pass the next forward with gradients and the
step are refused, naming the fix (``opt.zero_grad()``), as the data-parallel model strategies do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dtlab.core.backward import BackwardPass

__all__ = ["BackwardWatch"]


class BackwardWatch:
    """Watches the backward passes reaching ``params`` of ``module``; ``who`` names the owner in errors."""

    def __init__(self, module: nn.Module, params: Iterable[nn.Parameter], who: str) -> None:
        self.who = who
        self._pass = BackwardPass()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        module.register_forward_pre_hook(self._before_forward)

    def _on_grad(self, _: torch.Tensor) -> None:
        self._pass.begin(self._pass.end)

    def _before_forward(self, *_: Any) -> None:
        self.check("the forward" if torch.is_grad_enabled() else None)

    def check(self, refused: str | None) -> None:
        """Refuse ``refused`` (None: only take note) while the gradients are partial."""
        self._pass.found_raised()
        self._pass.refuse(self.who, refused)

    def forget(self) -> None:
        """``zero_grad()``: the partial gradients are dropped."""
        self._pass.found_raised()
        self._pass.forget()
