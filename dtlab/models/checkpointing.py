"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute
their forward when backward reaches them (``torch.utils.checkpoint``, non-reentrant).

:func:`checkpoint_modules` changes each module's ``forward`` in place, so parameter names, state dicts
and checkpoints stay as they were, and every model strategy wraps the result as usual. Under ZeRO-3
and FSDP the recomputation runs inside the unit's backward, after its parameters were gathered again;
the non-reentrant checkpoint's own saved-tensor hooks take precedence over the strategy's inside a
checkpointed module, so the strategy's hooks only see what is saved outside them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_modules"]


def _checkpointed(inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    return forward


def checkpoint_modules(module: nn.Module, classes: tuple[type[nn.Module], ...] | None = None) -> int:
    """Checkpoint every submodule that is an instance of ``classes`` (``None``: ``module`` itself, one
    region); returns how many. Apply it to the module before wrapping it in a model strategy, on each
    rank (the patched ``forward`` belongs to that module object: a deep copy keeps calling the
    original's)."""
    targets = [module] if classes is None else [m for m in module.modules() if isinstance(m, classes)]
    for m in targets:
        if hasattr(m.forward, "__wrapped__"):
            continue  # already checkpointed
        m.forward = _checkpointed(m.forward)
    return len(targets)
