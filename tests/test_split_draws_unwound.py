"""A split region (``models/tensor/_split_draws.py``: dropout between a column-parallel layer and its
row-parallel partner draws this tp rank's own masks) is closed when the forward raises inside it, also
where a parent calls the two layers itself rather than through the module holding both: its dispatch
mode stayed on the thread's stack, so every later op of the thread, a replicated dropout's too, ran
under it. And a first training pass that raised inside a region decides nothing: only a whole pass
that drew nothing stops the region from opening (it made the region's dropout draw the replicated
masks for good)."""

from __future__ import annotations

import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.core.torch_private import top_dispatch_mode
from dtlab.models import TensorParallelModel
from dtlab.testing import run_world


class _Raises(nn.Module):
    """Raises while ``fire``; records the innermost dispatch mode of each pass that does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fire = True
        self.modes: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fire:
            raise ValueError("raised inside the split region")
        self.modes.append(type(top_dispatch_mode()).__name__)
        return torch.nn.functional.dropout(torch.relu(x), 0.5, self.training)


class _Net(nn.Module):
    """``inner`` holds both layers, but the forward calls them one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), _Raises(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner[2](self.inner[1](self.inner[0](x)))


def _after_a_raise(backend: CommunicationBackend) -> tuple[str, str, list[str]]:
    with seeded_init(0):
        net = _Net()
    model = TensorParallelModel(net, backend, {"inner.0": "colwise", "inner.2": "rowwise"})
    try:
        model(torch.ones(2, 4))
    except ValueError:
        pass
    left = type(top_dispatch_mode()).__name__
    net.inner[1].fire = False
    model(torch.ones(2, 4))  # the first whole pass: the region is open where the dropout draws
    return left, type(top_dispatch_mode()).__name__, net.inner[1].modes


def test_a_region_the_forward_raised_in_is_closed_and_decides_nothing() -> None:
    assert run_world(2, _after_a_raise) == [("NoneType", "NoneType", ["_SplitMode"])] * 2
