"""Zero-bubble's backward split: input-gradients now (``I``), weight-gradients later (``W``), the split
of the Zero Bubble paper (Qi et al., 2023; docs/strategies.md, "Schedules").

During a zero-bubble stage's forward, every ``F.linear`` whose weight is a trainable leaf runs as
:class:`_SplitLinear` (a thread-local ``TorchFunctionMode``, so other in-memory ranks are untouched):
its backward returns the input-gradient and keeps ``(input, output-gradient)`` in the micro-batch's
:class:`WeightGradients` for ``W``. Other layers (norms, embeddings) get their gradients during ``I``.
A custom autograd function takes part through :func:`weight_gradient_queue` and
:func:`defer_weight_gradient`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from dtlab.core.torch_private import in_checkpoint_forward


def weight_gradient_queue(anchor: torch.Tensor) -> WeightGradients | None:
    """Call in a forward (``anchor``: its input): the queue of the micro-batch's zero-bubble ``W`` when
    a zero-bubble stage is running this forward, else None. Pass it to :func:`defer_weight_gradient`
    from the matching ``backward`` (autograd runs backward without the forward's context)."""
    if has_torch_function((anchor,)):
        return handle_torch_function(weight_gradient_queue, (anchor,), anchor)
    return None


def defer_weight_gradient(work: Callable[[], None], queue: WeightGradients | None) -> None:
    """In a custom autograd function's ``backward``: run ``work`` (its weight-gradient accumulation)
    at the micro-batch's ``W`` when ``queue`` (from :func:`weight_gradient_queue`) is one, else now."""
    if queue is None:
        work()
    else:
        queue.deferred.append(work)


class WeightGradients:
    """The deferred weight-gradient work of one micro-batch on one stage."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.deferred: list[Callable[[], None]] = []

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors this work keeps until it runs: the inputs and output-gradients of its layers."""
        return [t for x, g, _, _ in self.pending for t in (x, g)]

    def run(self) -> None:
        """Accumulate every kept weight-gradient into its parameter's ``.grad`` (in place)."""
        with torch.no_grad():
            for x, g, weight, bias in self.pending:
                g2 = g.reshape(-1, g.shape[-1])
                _accumulate(weight, g2.t().mm(x.reshape(-1, x.shape[-1]).to(g2.dtype)))
                if bias is not None:
                    _accumulate(bias, g2.sum(0))
            for work in self.deferred:
                work()
        self.pending.clear()
        self.deferred.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype).reshape(param.shape).clone()
    else:
        param.grad.add_(grad.reshape(param.shape).to(param.grad.dtype))


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradients
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store  # the parameters themselves, for W
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        bias = ctx.bias if ctx.bias is not None and ctx.bias.requires_grad else None
        ctx.store.pending.append((x.detach(), grad_out.detach(), ctx.weight, bias))
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class SplitLinearMode(TorchFunctionMode):
    """Inside it (a micro-batch's forward), ``F.linear`` with a trainable weight (and a parameter or no
    bias) defers its weight-gradient to ``store``, and :func:`weight_gradient_queue` returns ``store``."""

    def __init__(self, store: WeightGradients) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # inside a non-reentrant checkpoint nothing is split: its recomputation in backward, which
        # autograd runs outside this mode, must save the same tensors as the forward did (asked only
        # here: this mode sees every torch call of the forward)
        if func is weight_gradient_queue:
            return None if in_checkpoint_forward() else self.store
        if func is F.linear and torch.is_grad_enabled() and not in_checkpoint_forward():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            leaf_bias = bias is None or isinstance(bias, torch.nn.Parameter)
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad and leaf_bias:
                return _SplitLinear.apply(x, weight, bias, self.store)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)
