"""Sharding units of ZeRO-3/FSDP: wrap policies, reshard_after_forward, keep_gathered, the size
policy over module lists and a parameter read outside the module that owns it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_strategies_helpers import (
    Block,
    make_module,
    wrap,
)
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import (
    FSDPModel,
    ModuleClassPolicy,
    SizePolicy,
    ZeRO3Model,
)
from dtlab.testing import run_world


# ---------------------------------------------------------------------------- wrapping
def _policies(backend: CommunicationBackend) -> list[list[str]]:
    size = FSDPModel(make_module(), backend, wrap_policy=SizePolicy(100))
    cls = FSDPModel(make_module(), backend, wrap_policy=ModuleClassPolicy((Block,)))
    whole = FSDPModel(make_module(), backend)
    keep = FSDPModel(
        make_module(), backend, wrap_policy=ModuleClassPolicy((Block,)), reshard_after_forward=False
    )
    x = torch.randn(4, 6)
    backend.stats.reset()
    keep(x).sum().backward()
    gathers = backend.stats["all_gather"].calls
    return [[u.key for u in m.shard_units()] for m in (size, cls, whole)] + [[str(gathers)]]


def test_wrap_policies_and_reshard_after_forward() -> None:
    size, cls, whole, gathers = run_world(2, _policies)[0]
    assert size == ["<root>", "1.fc"]  # Block.fc (110 params) reaches 100; the rest stays in the root unit
    assert cls == ["<root>", "1"]
    assert whole == ["<root>"]
    assert gathers == ["2"]  # reshard_after_forward=False: one gather per unit per step


def _held(model: Any) -> int:
    return int(model.memory_report()["parameters"])


def _keep_gathered(backend: CommunicationBackend) -> list[int]:
    seen = []
    for name in ("zero3", "fsdp"):
        model = wrap(name, make_module(), backend)
        with model.keep_gathered():
            seen.append(_held(model) - _held(wrap(name, make_module(), backend)))
        seen.append(_held(model) - _held(wrap(name, make_module(), backend)))  # what it gathered, it frees
    model = wrap("fsdp", make_module(), backend, reshard_after_forward=False)
    at_rest = _held(model)
    loss = model(torch.randn(4, 6)).sum()  # gathered until its backward
    gathered = _held(model)
    with model.keep_gathered():  # a pipeline step; a checkpoint save inside a forward
        model.full_state_dict()
    seen.append(_held(model) - gathered)  # gathered before the block: kept for the backward
    loss.backward()
    return [*seen, _held(model) - at_rest, int(gathered > at_rest)]


def test_keep_gathered_frees_afterwards_only_what_it_gathered() -> None:
    seen = run_world(2, _keep_gathered)[0]
    zero3_in, zero3_after, fsdp_in, fsdp_after, kept, after_backward, gathered = seen
    assert zero3_in > 0 and fsdp_in > 0 and gathered
    assert [zero3_after, fsdp_after, kept, after_backward] == [0, 0, 0, 0]


class Stacked(nn.Module):
    """Layers in an nn.ModuleList: each below the size threshold, the list above it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # 72 parameters each
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.head(x)
        return out


def _size_over_module_list(backend: CommunicationBackend) -> list[str]:
    model = FSDPModel(Stacked(), backend, wrap_policy=SizePolicy(100))
    model(torch.randn(4, 8)).sum().backward()  # a forward and backward through the units
    return [u.key for u in model.shard_units()]


def test_size_policy_never_wraps_a_module_list() -> None:
    # torch's size policy excludes ModuleList/ModuleDict: the list (144 >= 100) runs no forward
    assert run_world(2, _size_over_module_list)[0] == ["<root>"]
    assert not SizePolicy(1).should_wrap(nn.ModuleDict({"a": nn.Linear(8, 8)}), 72)
    assert SizePolicy(1).should_wrap(nn.Linear(8, 8), 72)


class ReadsChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(8, 4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.pos.weight[: x.shape[0]])  # pos's forward never runs


def _external(backend: CommunicationBackend) -> None:
    model = ZeRO3Model(ReadsChildWeight(), backend, persistence_threshold=0)
    with pytest.raises(StrategyError, match="outside the forward of the module that owns it"):
        model(torch.ones(3, 4))
    ok = ZeRO3Model(ReadsChildWeight(), backend, persistence_threshold=0, leaf_modules=(ReadsChildWeight,))
    ok(torch.ones(3, 4)).sum().backward()
    fsdp = FSDPModel(ReadsChildWeight(), backend)
    fsdp(torch.ones(3, 4)).sum().backward()


def test_parameter_read_outside_its_module_is_explained() -> None:
    run_world(2, _external)
