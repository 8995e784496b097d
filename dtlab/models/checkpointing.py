"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute
their forward there (``torch.utils.checkpoint``, non-reentrant).

Only each module's ``forward`` changes, so parameter names and checkpoints stay as they were. Under
ZeRO-3/FSDP the recomputation runs inside the unit's backward, after its parameters were gathered
again; inside a checkpointed module the checkpoint's saved-tensor hooks take precedence over the
strategy's. The recomputation leaves every buffer the forward updated (BatchNorm's running statistics,
a counter, an exponential moving average) as it found them: the forward updated them for that batch
already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlab.core.torch_private import tensor_version

__all__ = ["checkpoint_modules", "checkpointed", "keep_running_statistics"]


def keep_running_statistics(module: nn.Module) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant) for a region running ``module``:
    around the forward, which of ``module``'s buffers it updates (in place, as BatchNorm's mean,
    variance and count, or by assigning a new tensor); around its recomputation in backward, those
    left as it found them, where the recomputation would update them a second time for the same
    batch."""
    updated: list[tuple[nn.Module, str]] = []
    return _updates_seen(module, updated), _statistics_kept(updated)


@contextlib.contextmanager
def _updates_seen(module: nn.Module, updated: list[tuple[nn.Module, str]]) -> Iterator[None]:
    held = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    before = [(m, name, b, tensor_version(b)) for m, name, b in held]
    try:
        yield
    finally:
        for m, name, b, version in before:
            # BatchNorm's kernel updates its running statistics without counting a version
            tracking = m.training and getattr(m, "track_running_stats", False)
            if tracking or getattr(m, name) is not b or tensor_version(b) != version:
                updated.append((m, name))


@contextlib.contextmanager
def _statistics_kept(updated: list[tuple[nn.Module, str]]) -> Iterator[None]:
    saved = [(m, name, b) for m, name in updated if isinstance(b := getattr(m, name), torch.Tensor)]
    values = [b.clone() for _, _, b in saved]
    try:
        yield
    finally:
        with torch.no_grad():
            for (m, name, buffer), value in zip(saved, values, strict=True):
                if getattr(m, name) is not buffer:  # assigned anew by the recomputation
                    setattr(m, name, buffer)
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
