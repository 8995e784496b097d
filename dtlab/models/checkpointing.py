"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute
their forward there (``torch.utils.checkpoint``, non-reentrant).

Only each module's ``forward`` changes, so parameter names and checkpoints stay as they were. Under
ZeRO-3/FSDP the recomputation runs inside the unit's backward, after its parameters were gathered
again; inside a checkpointed module the checkpoint's saved-tensor hooks take precedence over the
strategy's.
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
