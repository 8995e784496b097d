"""Plain training steps, the loop most tests run on a model (wrapped or one process's) and its optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtlab.errors import StrategyError


def plain_steps(
    model: Any,
    opt: Any,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> list[float]:
    """Per batch ``(x, y)``: ``loss_fn(model(x), y)``, backward, ``opt.step()``, ``opt.zero_grad()``;
    the losses."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def outcome(call: Callable[..., object], *args: Any) -> str:
    """``"ran"`` when ``call(*args)`` returns, else the text of the StrategyError it raised."""
    try:
        call(*args)
    except StrategyError as exc:
        return str(exc)
    return "ran"
