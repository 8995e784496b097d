"""Weight decay under momentum correction: its own velocity, as torch's momentum SGD and DGC have it.

With ``momentum_correction=m`` the compressed reducer keeps the gradient's velocity and the inner
``torch.optim.SGD(momentum=0, weight_decay=wd)`` adds ``wd * w`` to the synchronized update, outside
any velocity. torch's ``SGD(momentum=m, weight_decay=wd)`` puts ``wd * w`` into its momentum buffer,
and so does Deep Gradient Compression's reference optimizer (a momentum buffer of ``wd * w`` per
parameter, added to the synchronized update). :func:`decay_with_momentum` gives the local optimizer
that buffer: before each step it keeps ``b = m * b + wd * w`` (the state's ``momentum_buffer``, so it
is saved, loaded and resharded with the rest of the optimizer state) and after the step subtracts
``lr * m * b_previous``: the update is then ``lr * (synchronized + m * b_previous + wd * w)``, which at
density 1.0 is torch's momentum SGD on the global batch. Parameters without a gradient are skipped,
as torch skips them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from dtlab.core.torch_private import quiet_scheduler_checks, unhooked_step

__all__ = ["decay_with_momentum"]

_BUFFER = "momentum_buffer"


def _before(optimizer: torch.optim.Optimizer, m: float) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
    """Advance every decayed parameter's buffer; return ``(param, m * previous buffer, lr)``."""
    owed = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            wd = group.get("weight_decay", 0)
            if not wd:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                buf = state.get(_BUFFER)
                if buf is None:
                    state[_BUFFER] = torch.mul(p.detach(), wd)
                    continue
                owed.append((p, buf.mul(m), group["lr"]))
                buf.mul_(m).add_(p.detach(), alpha=wd)
    return owed


def decay_with_momentum(optimizer: torch.optim.Optimizer, momentum: float) -> Callable[[], None]:
    """Give ``optimizer`` (an SGD with ``momentum=0``) a weight-decay velocity of factor ``momentum``
    in groups with ``weight_decay``; returns the call that takes it away again."""
    previous = vars(optimizer).get("step")  # an instance step already there (a scheduler's), else the class's
    run: Callable[..., Any] = previous if previous is not None else unhooked_step(optimizer)

    def step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owed = _before(self, momentum)
        run()
        with torch.no_grad():
            for p, extra, lr in owed:
                p.sub_(extra.mul_(lr))
        return loss

    if getattr(previous, "_wrapped_by_lr_sched", False):  # a scheduler on it already: no false warning
        quiet_scheduler_checks(optimizer, step)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def remove() -> None:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous  # type: ignore[method-assign]

    return remove
