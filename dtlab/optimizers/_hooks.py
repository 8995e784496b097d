"""torch's optimizer hooks on an optimizer strategy: the step, state-dict and load hooks a user
registered on the torch optimizer instance handed to the strategy are carried over to the strategy
(it rebuilds a local optimizer over this rank's pieces, which would drop them: an EMA updated from a
step post-hook silently never updated), and the state-dict hooks run around the strategy's own
``state_dict()`` / ``load_state_dict()`` as torch runs them. The local optimizer steps without torch's
global step hooks (``register_optimizer_step_*_hook``), which see the strategy's step once, as one
process sees its optimizer's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtlab.core.torch_private import OPTIMIZER_HOOKS, unhooked_step

__all__ = ["carried_hooks", "carry_hooks", "load_with_hooks", "local_step", "state_dict_with_hooks"]


def carried_hooks(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """``(registering method, hook)`` of every hook registered on ``optimizer``, in order."""
    return [(call, hook) for call, read in OPTIMIZER_HOOKS.items() for hook in list(read(optimizer).values())]


def carry_hooks(hooks: list[tuple[str, Any]], to: torch.optim.Optimizer) -> None:
    for call, hook in hooks:
        getattr(to, call)(hook)


def state_dict_with_hooks(opt: torch.optim.Optimizer, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``make()`` between ``opt``'s state-dict pre-hooks (``hook(opt)``) and post-hooks
    (``hook(opt, sd)``, which may return a new state dict), as torch's ``state_dict()``."""
    for hook in list(OPTIMIZER_HOOKS["register_state_dict_pre_hook"](opt).values()):
        hook(opt)
    sd = make()
    for hook in list(OPTIMIZER_HOOKS["register_state_dict_post_hook"](opt).values()):
        out = hook(opt, sd)
        sd = sd if out is None else out
    return sd


def load_with_hooks(
    opt: torch.optim.Optimizer, sd: dict[str, Any], load: Callable[[dict[str, Any]], None]
) -> None:
    """``load(sd)`` after ``opt``'s load pre-hooks (``hook(opt, sd)``, which may return a new state dict)
    and before its post-hooks (``hook(opt)``), as torch's ``load_state_dict()``."""
    for hook in list(OPTIMIZER_HOOKS["register_load_state_dict_pre_hook"](opt).values()):
        out = hook(opt, sd)
        sd = sd if out is None else out
    load(sd)
    for hook in list(OPTIMIZER_HOOKS["register_load_state_dict_post_hook"](opt).values()):
        hook(opt)


def local_step(local: torch.optim.Optimizer) -> None:
    """Step the local optimizer; without torch's global hooks unless it has hooks of its own or a step
    of its own (registered on ``opt.optimizer``, or a scheduler built on it wrapping its step), which
    then run as torch runs them, global ones included."""
    own = any(read(local) for call, read in OPTIMIZER_HOOKS.items() if call.startswith("register_step"))
    if own or "step" in vars(local):
        local.step()
    else:
        unhooked_step(local)()
