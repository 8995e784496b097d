"""Forwards outside the training step, as a torch user writes them: a forward with gradients whose output
is dropped without a backward (an evaluation loop without ``torch.no_grad()``) frees its graph as in one
process under DDP, ZeRO-3 and FSDP (ZeRO-3/FSDP's saved-tensor hooks kept an operation's own saved output,
a cycle through autograd that Python's garbage collector never frees: about 0.9 MB more per call on a
small transformer). In-memory ranks, a tiny model."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from test_strategies_helpers import make_data, make_module, wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.testing import run_world


def _dropped_forwards(backend: CommunicationBackend, name: str) -> int:
    """Three forwards with gradients in eval mode, each output dropped: how many of the activations
    they made are still alive (``nn.Tanh`` saves its own output for backward)."""
    module = make_module()
    model = wrap(name, module, backend)
    alive: list[Any] = []
    for layer in module.modules():
        if isinstance(layer, nn.Tanh):
            layer.register_forward_hook(lambda _m, _a, out: alive.append(weakref.ref(out)))
    x, _ = make_data(1, 4)
    model.eval()
    for _ in range(3):
        out = model(x[0])
        assert out.requires_grad
        del out
    gc.collect()
    model.train()
    assert alive
    return sum(ref() is not None for ref in alive)


@pytest.mark.parametrize("name", ["ddp", "zero3", "fsdp"])
def test_a_forward_with_gradients_and_no_backward_frees_its_graph(name: str) -> None:
    assert run_world(2, _dropped_forwards, name, timeout=60) == [0, 0], name
