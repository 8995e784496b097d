"""Whether the backward now running fills ``.grad``: ``torch.autograd.grad(...)`` does not.

A gradient penalty takes ``torch.autograd.grad(loss, params, create_graph=True)`` first, then calls
``backward()`` on a loss built from those gradients. The first pass fills no ``.grad`` (torch's engine
hands the gradients back instead), so a data-parallel strategy has nothing to reduce in it; the
second pass is the one that accumulates, and the one to synchronize.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["autograd_grad_message", "fills_grads", "grads_filled"]


def grads_filled(params: Iterable[torch.Tensor]) -> bool | None:
    """Called inside a backward: whether it accumulates into the ``.grad`` of the first parameter for
    which the answer is not False. True in a backward that accumulates; None inside
    ``torch.autograd.grad`` asked for that parameter (torch's engine refuses the question for a leaf it
    hands a gradient back for); False for none: an input gradient (``torch.autograd.grad(loss, x)``, an
    adversarial step: nothing to reduce), or the outer pass of a model whose parameters are all in
    reentrant checkpoints (their nested backwards fill them). One answer settles it: no ``.grad`` is
    accumulated inside ``torch.autograd.grad``, so both cannot occur in one pass."""
    will_run = torch._C._will_engine_execute_node  # noqa: SLF001 - torch's engine query (as its FSDP uses)
    for p in params:
        if p.requires_grad:  # one frozen after wrapping is refused elsewhere, naming requires_grad
            try:
                if will_run(get_gradient_edge(p).node):
                    return True
            except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
                return None
    return False


def fills_grads(params: Iterable[torch.Tensor]) -> bool:
    """Called inside a backward: whether it accumulates into the ``.grad`` of any of ``params``
    (``False`` inside ``torch.autograd.grad``)."""
    return grads_filled(params) is True


def autograd_grad_message(model: str, rank: int) -> str:
    """The refusal of ``torch.autograd.grad`` through a strategy that gathers its parameters per use."""
    return (
        f"{model} on rank {rank}: torch.autograd.grad() asked for gradients of the model's parameters (a "
        "gradient penalty?). It fills no .grad, and this strategy's parameters are gathered for one "
        "backward and freed, so a second backward through create_graph=True gradients cannot reach them. "
        "Use DDPModel, ZeRO1Model or ZeRO2Model for gradient penalties (they skip the autograd.grad pass "
        "and synchronize the backward() after it), or compute the gradient with loss.backward()"
    )
