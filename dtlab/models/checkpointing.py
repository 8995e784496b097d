"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute
their forward there (``torch.utils.checkpoint``, non-reentrant).

Only each module's ``forward`` changes, so parameter names and checkpoints stay as they were. Under
ZeRO-3/FSDP the recomputation runs inside the unit's backward, after its parameters were gathered
again; inside a checkpointed module the checkpoint's saved-tensor hooks take precedence over the
strategy's. The recomputation leaves running statistics (BatchNorm's) as it found them: the forward
updated them for that batch already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_modules", "checkpointed", "keep_running_statistics"]


def keep_running_statistics(module: nn.Module) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant) for a region running ``module``:
    nothing around the forward; around its recomputation in backward, the running statistics of the
    submodules in training mode that track them (BatchNorm's mean, variance and count) left as it found
    them, where the recomputation would update them a second time for the same batch."""
    return contextlib.nullcontext(), _statistics_kept(module)


@contextlib.contextmanager
def _statistics_kept(module: nn.Module) -> Iterator[None]:
    tracking = [m for m in module.modules() if m.training and getattr(m, "track_running_stats", False)]
    saved = [(b, b.clone()) for m in tracking for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def checkpointed(inner: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``inner`` (``module``'s forward, or a pipeline stage running it) keeping only its inputs while
    gradients are recorded, recomputed in backward with ``module``'s running statistics kept."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        kept = partial(keep_running_statistics, module)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=kept, **kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    return forward


def checkpoint_modules(module: nn.Module, classes: tuple[type[nn.Module], ...] | None = None) -> int:
    """Checkpoint every submodule that is an instance of ``classes`` (``None``: ``module`` itself, one
    region); returns how many. Apply it to the module before wrapping it in a model strategy, on each
    rank (the patched ``forward`` belongs to that module object: a deep copy keeps calling the
    original's)."""
    targets = [module] if classes is None else [m for m in module.modules() if isinstance(m, classes)]
    for m in targets:
        if not hasattr(m.forward, "__wrapped__"):  # not checkpointed already
            m.forward = checkpointed(m.forward, m)
    return len(targets)
