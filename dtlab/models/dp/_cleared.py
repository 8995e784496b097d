"""Gradients cleared the torch way while a strategy keeps them sharded.

After a synchronized backward under ZeRO-1 (reduce-scatter), ZeRO-2, ZeRO-3 and FSDP the averaged
gradient lives in the strategy's shards and ``param.grad`` is a stand-in
(:class:`~dtlab.models.dp._grad_guard.ShardedGradient`). torch's ways of clearing gradients touch only
``param.grad``: ``model.zero_grad()``, ``model.module.zero_grad()``, ``p.grad = None`` for every
parameter, or zeroing them (``set_to_none=False``). Left there, the shards would keep the last step's
gradient and the next backward would add into it. :func:`adopt_cleared` finds such a clearing before
the next forward or step and clears the shards too (what ``opt.zero_grad()`` does); clearing only some
parameters' gradients is refused, naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from dtlab.errors import StrategyError
from dtlab.models.dp._grad_guard import ShardedGradient

__all__ = ["adopt_cleared"]


def adopt_cleared(
    guarded: bool, who: str, trainable: Sequence[tuple[str, nn.Parameter]], zero_all: Callable[[bool], None]
) -> None:
    """While ``guarded`` (the stand-ins are in place): ``zero_all(set_to_none)`` when every stand-in of
    ``trainable`` was set to None or zeroed since the synchronized backward (``set_to_none``: some were
    set to None); refuse (``who``: the strategy) when only some were."""
    if not guarded:
        return
    cleared = [
        n for n, p in trainable if p.grad is None or (isinstance(p.grad, ShardedGradient) and p.grad.zeroed)
    ]
    if not cleared:
        return
    if len(cleared) == len(trainable):
        zero_all(any(p.grad is None for _, p in trainable))
        return
    kept = len(trainable) - len(cleared)
    raise StrategyError(
        f"{who}: the gradients of {cleared[:5]}{' ...' if len(cleared) > 5 else ''} ({len(cleared)} "
        f"parameters) were cleared (param.grad set to None or zeroed) after the synchronized backward, "
        f"those of the other {kept} were not. Each rank holds its shard of every averaged gradient in "
        "flat buffers shared by many parameters, so one parameter's gradient cannot be dropped alone. "
        "Clear them all with opt.zero_grad() or model.zero_grad(); to keep a parameter from training, "
        "freeze it (requires_grad=False) before wrapping"
    )
