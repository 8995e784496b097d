"""The torch optimizer instance a user hands to an optimizer strategy
(``opt = ZeRO1Optimizer(model, optimizer)``): its param groups are the strategy's own (the same dicts),
so a scheduler built on it before handing it over (``get_linear_schedule_with_warmup(optimizer, ...)``)
and ``optimizer.param_groups[i]["lr"] = x`` act on the strategy, as on one process (a copy of the
groups ignored them: 0.11 relative error after 3 steps). The strategy steps a local optimizer of the
same class over this rank's pieces, so the instance holds no state from then on: stepping it, saving or
loading its state dict, or adding a group to it would be a silent no-op (a checkpoint without the
optimizer state) or a raw error, and is refused naming the strategy's call."""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from dtlab.core.torch_private import OPTIMIZER_HOOKS, quiet_scheduler_checks
from dtlab.errors import StrategyError

__all__ = ["hand_over", "refuse_handed_again"]

_REFUSED = ("step", "state_dict", "load_state_dict", "add_param_group")
#: the attribute of a handed torch optimizer naming the strategy it was handed to
_HANDED = "_dtlab_handed_to"


def refuse_handed_again(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Refuse ``optimizer`` given to ``who`` (an optimizer strategy) when it was handed to one already."""
    first = getattr(optimizer, _HANDED, None)
    if first is None:
        return
    name = type(optimizer).__name__
    own = getattr(torch.optim, name, None) is type(optimizer)  # else a user's class, named as it is
    cls = f"torch.optim.{name}" if own else name
    raise StrategyError(
        f"{who}: this {name} was handed to {first} already (opt = {first}(model, optimizer)), which holds "
        "its optimizer state and the hooks registered on it since; this instance holds none of them, so "
        f"a second strategy built on it would start from empty (or stale) state. Build a new {name} for "
        f"the new wrapper and continue from the first strategy's state: opt = {who}(model, "
        f"{cls}(model.parameters(), ...)); opt.load_state_dict(first_opt.state_dict()) "
        "(every rank calls both)"
    )


def hand_over(optimizer: torch.optim.Optimizer, who: str, to: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s own ``step``, ``state_dict``, ``load_state_dict`` and ``add_param_group``
    refuse, naming ``who``'s (the strategy's) instead; ``zero_grad`` and its param groups keep working,
    and a hook registered on it from now on (``register_step_post_hook``: an EMA) is registered on ``to``,
    the strategy, as those registered before were carried over (else it would never run)."""
    name = type(optimizer).__name__
    setattr(optimizer, _HANDED, who)
    for register in OPTIMIZER_HOOKS:
        setattr(optimizer, register, getattr(to, register))
    for call in _REFUSED:

        def refused(*_args: Any, call: str = call, **_kwargs: Any) -> NoReturn:
            raise StrategyError(
                f"{name}.{call}() on the torch optimizer handed to {who}: the strategy steps a {name} of "
                "its own over this rank's pieces, so this instance holds no optimizer state. Call "
                f"{call}() on the strategy: opt = {who}(model, optimizer); opt.{call}(...) (schedulers and "
                "param_groups edits on this instance still act: its param groups are the strategy's)"
            )

        setattr(optimizer, call, refused)
        if call == "step":  # a scheduler built on it steps with the strategy, without torch's warnings
            quiet_scheduler_checks(optimizer, refused)
