"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute
their forward there (``torch.utils.checkpoint``, non-reentrant).

Only each module's ``forward`` changes, so parameter names and checkpoints stay as they were. Under
ZeRO-3/FSDP the recomputation runs inside the unit's backward, after its parameters were gathered
again; inside a checkpointed module the checkpoint's saved-tensor hooks take precedence over the
strategy's. The recomputation starts from the buffers the forward found (BatchNorm's running
statistics, a counter, an exponential moving average: it computes what the forward did) and leaves
them as the forward did: the forward updated them for that batch already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from dtlab.backends.threads import on_rank_thread
from dtlab.core.replayed_draws import ReplayedDraws
from dtlab.core.torch_private import tensor_version
from dtlab.core.traced import eager_when_traced

__all__ = ["ReplayedDraws", "checkpoint_modules", "checkpointed", "keep_running_statistics"]


def keep_running_statistics(module: nn.Module) -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant) for a region running ``module``:
    around the forward, which of ``module``'s buffers it updates (in place, as BatchNorm's mean,
    variance and count, or by assigning a new tensor) and their values before it; around its
    recomputation in backward, those buffers set back to those values (the recomputation computes what
    the forward did: a running normalizer divides by the same scale), then to the forward's own after it
    (not updated a second time for the same batch). Each region's buffers are copied once per forward,
    and the copies of those it updated kept until its recomputation."""
    updated: list[tuple[nn.Module, str, torch.Tensor]] = []
    return _updates_seen(module, updated), _recomputed_as_before(updated)


@contextlib.contextmanager
def _updates_seen(module: nn.Module, updated: list[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    held = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    before = [(m, name, b, tensor_version(b), b.detach().clone()) for m, name, b in held]
    try:
        yield
    finally:
        for m, name, b, version, value in before:
            # BatchNorm's kernel updates its running statistics without counting a version
            tracking = m.training and getattr(m, "track_running_stats", False)
            if tracking or getattr(m, name) is not b or tensor_version(b) != version:
                updated.append((m, name, value))


@contextlib.contextmanager
def _recomputed_as_before(updated: list[tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    now = [
        (m, name, b, value) for m, name, value in updated if isinstance(b := getattr(m, name), torch.Tensor)
    ]
    after = [b.detach().clone() for _, _, b, _ in now]
    with torch.no_grad():
        for m, name, b, value in now:  # the values the forward found
            if b.shape == value.shape and b.dtype == value.dtype:
                b.copy_(value)
            else:
                setattr(m, name, value.clone())
    try:
        yield
    finally:
        with torch.no_grad():
            for (m, name, b, _), value in zip(now, after, strict=True):
                if getattr(m, name) is not b:  # assigned anew by the recomputation
                    setattr(m, name, b)
                b.copy_(value)


def checkpointed(inner: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``inner`` (``module``'s forward, or a pipeline stage running it) keeping only its inputs while
    gradients are recorded, recomputed in backward with ``module``'s running statistics kept and, on an
    in-memory rank, the forward's random numbers drawn again (:class:`ReplayedDraws`)."""
    draws = ReplayedDraws()

    def recorded(*args: Any, **kwargs: Any) -> Any:
        kept = partial(keep_running_statistics, module)
        preserve = True
        if on_rank_thread():  # threads sharing torch's global RNG: the CPU's draws replayed
            kept = partial(_both, kept, draws)
            # torch's own restore of the global RNG would only move the other ranks' numbers; a GPU's
            # generator as torch's checkpoint handles it
            leaves = tree_leaves((args, kwargs))
            preserve = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in leaves)
        return checkpoint(
            inner, *args, use_reentrant=False, context_fn=kept, preserve_rng_state=preserve, **kwargs
        )

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return inner(*args, **kwargs)
        # eager under torch.compile, whose checkpoint takes no context_fn of this kind: one graph break
        return eager_when_traced(recorded)(*args, **kwargs)

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    return forward


def _both(first: Callable[[], tuple[Any, Any]], second: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """Two ``context_fn``s as one: each of their forward contexts, then each of their recomputation's."""
    (forward_a, recompute_a), (forward_b, recompute_b) = first(), second()
    return _nested(forward_a, forward_b), _nested(recompute_a, recompute_b)


@contextlib.contextmanager
def _nested(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


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
