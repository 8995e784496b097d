"""``train_step(batch, loss_fn)``'s arguments checked before any forward, with or without a pipeline: a
``loss_fn`` that is not a function and a batch that is not the pair ``(inputs, targets)`` are one error
naming them (not Python's after the forward, nor, under a pipeline, a later stage's while the others
wait)."""

from __future__ import annotations

from typing import Any

import torch

from dtlab.errors import StrategyError
from dtlab.untrusted import summary

__all__ = ["batch_pair", "described"]


def described(value: Any) -> str:
    """What a refusal names a value by: a tensor's dtype and shape, else a bounded summary."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return summary(value)


def batch_pair(who: str, batch: Any, loss_fn: object, hint: str = "") -> tuple[Any, Any]:
    """``who.train_step``'s ``batch`` as ``(inputs, targets)``, or refused naming what it got (a dict, or
    a tuple of three: an attention mask besides the inputs; ``hint``: what a pipeline needs); a
    ``loss_fn`` that is not a function too."""
    if not callable(loss_fn):
        raise StrategyError(
            f"{who}.train_step(batch, loss_fn): loss_fn must be a function of (output, targets), e.g. "
            f"torch.nn.functional.cross_entropy, got {loss_fn!r}"
        )
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    raise StrategyError(
        f"{who}.train_step(batch, loss_fn): batch must be the pair (inputs, targets), got "
        f"{described(batch)}{hint}"
    )
