"""``dtlab.core.torch_private``, the one place torch's private attributes are read: a module's
non-persistent buffers, as the pipeline's two readers use them (a split at module names accepts such a
buffer on its glue and refuses a persistent one; a rank's stage tree keeps each buffer's persistence).
No ranks, no communication."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtlab.core.torch_private import MODULE_HOOKS, TENSOR_HOOKS, non_persistent_buffers
from dtlab.errors import StrategyError
from dtlab.models.compose._build import StageRoot
from dtlab.models.pipeline._trace import traced_structure


class _Net(nn.Module):
    """Two layers under a root holding a buffer its forward reads (``persistent`` as given)."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.layers[0].register_buffer("inner", torch.zeros(4), persistent=False)
        self.register_buffer("shift", torch.ones(4), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x + self.shift


def test_non_persistent_buffers_are_the_modules_own() -> None:
    assert non_persistent_buffers(_Net(persistent=False)) == {"shift"}
    assert non_persistent_buffers(_Net(persistent=True)) == frozenset()
    assert non_persistent_buffers(_Net(persistent=True).layers[0]) == {"inner"}
    net = nn.Linear(2, 2)
    handle = net.register_forward_hook(lambda *_: None)
    assert list(MODULE_HOOKS["register_forward_hook"](net)) == [handle.id]
    assert TENSOR_HOOKS["register_hook"](net.weight) is None  # none before a tensor's first hook


def test_a_split_at_module_names_takes_a_non_persistent_buffer_on_its_glue() -> None:
    traced_structure(_Net(persistent=False), ["layers.1"], 2)  # made by the module on every rank
    with pytest.raises(StrategyError, match=r"buffers \['shift'\] belong to _Net's glue"):
        traced_structure(_Net(persistent=True), ["layers.1"], 2)  # saved by no stage: refused


def test_a_ranks_stage_tree_keeps_each_buffers_persistence() -> None:
    net = _Net(persistent=False)
    net.register_buffer("count", torch.zeros(()))  # and a persistent one
    stage = nn.Module()  # a stage holding the first layer and the root's buffers
    stage.add_module("first", net.layers[0])
    for name, b in net.named_buffers(recurse=False):
        stage.register_buffer(name, b)
    root = StageRoot(net, {0: stage})
    assert set(root.state_dict()) == {"count", "layers.0.weight", "layers.0.bias"}
    assert {n for n, _ in root.named_buffers()} == {"shift", "count", "layers.0.inner"}
    assert set(root.state_dict()) <= set(net.state_dict())
