"""How ZeRO-3 and FSDP cut a model into units: SizePolicy counts only the parameters not already in
an inner unit (exactly at the threshold), ZeRO-3 names each unit after its parameter, and bad
``leaf_modules`` / policy classes are refused with the offending values named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.models import FSDPModel, ModuleClassPolicy, SizePolicy, ZeRO3Model
from dtlab.testing import run_world


class _Holder(nn.Module):
    """Two parameters of its own around an inner Linear(4, 4) of 20."""

    def __init__(self) -> None:
        super().__init__()
        self.own = nn.Parameter(torch.ones(2))
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.own.sum()


def _units(backend: CommunicationBackend) -> dict[str, list[str]]:
    out = {}
    for min_params in (2, 3, 20, 21, 22):
        model = FSDPModel(
            nn.Sequential(_Holder(), nn.Linear(4, 1)), backend, wrap_policy=SizePolicy(min_params)
        )
        out[f"fsdp/{min_params}"] = sorted(u.key for u in model.shard_units())
    zero3 = ZeRO3Model(
        nn.Sequential(nn.Linear(3, 2), nn.Sequential(nn.Linear(2, 1))), backend, persistence_threshold=0
    )
    out["zero3"] = [u.key for u in zero3.shard_units()]
    return out


def test_size_policy_counts_only_parameters_outside_inner_units() -> None:
    units = run_world(2, _units)[0]
    # the inner Linear (20) is its own unit from 20 up; its parent then holds 2 parameters of its own
    assert units["fsdp/2"] == ["0", "0.inner", "1"]
    # 2 own < 3: the holder is not a unit (its parameter goes to the root); Linear(4, 1) has 5
    assert units["fsdp/3"] == ["0.inner", "1", "<root>"]
    assert units["fsdp/20"] == ["0.inner", "<root>"]  # the holder's 2 and Linear(4, 1)'s 5 < 20
    assert units["fsdp/21"] == ["0", "<root>"]  # 22 under the holder, none wrapped below it
    assert units["fsdp/22"] == ["0", "<root>"]
    assert units["zero3"] == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]


def test_bad_leaf_modules_and_policy_classes_are_named() -> None:
    def zero3(backend: CommunicationBackend, leaf: tuple) -> None:
        ZeRO3Model(nn.Linear(2, 2), backend, leaf_modules=leaf)

    for bad in ((int,), (nn.Linear(2, 2),), ("Linear",)):
        with pytest.raises(Exception, match=r"leaf_modules must be nn\.Module subclasses") as info:
            run_world(1, zero3, bad)
        assert isinstance(info.value.__cause__, TypeError), bad
        with pytest.raises(TypeError, match=r"must be nn\.Module subclasses"):
            ModuleClassPolicy(bad)  # type: ignore[arg-type]
    run_world(1, zero3, (nn.Linear,))


def _mid_backward(backend: CommunicationBackend) -> tuple[int, int, int]:
    from dtlab.models import ZeRO2Model

    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model = ZeRO2Model(net, backend, bucket_cap_mb=0.0002)  # ~200-byte buckets: several in flight
    seen: list[int] = []
    first = net[0].weight  # its gradient comes last: every other bucket is launched by then
    first.register_hook(lambda _g: seen.append(model.memory_report()["gradients"]))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(backend.rank))
    model(x).square().mean().backward()
    full = sum(4 * q.numel() for q in net.parameters())
    return seen[0], model.memory_report()["gradients"], full


def test_zero2_counts_its_transient_gradient_buffers_mid_backward() -> None:
    """During backward ZeRO-2 holds a launched bucket's full buffer until its reduce-scatter completes,
    which the next bucket's launch waits for: mid-backward at most two buckets' buffers are alive (it
    held every launched one until the end of backward: 744 bytes here, the whole gradient but the first
    layer's weight); after it only the shards (about 1/P of the gradient) remain."""
    for mid, after, full in run_world(2, _mid_backward):
        assert after < full  # the shards only
        assert after < mid <= after + 2 * 4 * 8 * 8, (mid, after)  # two buckets, the largest 8 x 8 floats
        assert mid < after + full - 4 * 8 * 6, (mid, after, full)  # not every bucket in flight


def _storage_after_step(backend: CommunicationBackend, name: str) -> tuple[int, int]:
    from dtlab.optimizers import ZeRO3Optimizer

    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    full = sum(4 * q.numel() for q in net.parameters())
    if name == "zero3":
        model: ZeRO3Model | FSDPModel = ZeRO3Model(net, backend, persistence_threshold=0)
    else:
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((nn.Linear,)))
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()

    def held_beyond_markers() -> int:
        """What the parameters' storages hold beyond the one element each parked parameter stands on
        (its logical shape kept between uses, see docs/strategies.md; one marker per unit)."""
        storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q in net.parameters()}
        return sum(storages.values()) - sum(q.element_size() for q in net.parameters())

    held = held_beyond_markers()
    state = model.full_state_dict()  # gathers every unit, then frees them again
    assert sum(t.numel() for t in state.values()) * 4 == full
    held += held_beyond_markers()
    assert [tuple(q.shape) for q in net.parameters()] == [(8, 6), (8,), (3, 8), (3,)]
    return held, full


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_gathered_parameters_really_release_their_memory(name: str) -> None:
    """After a step and after full_state_dict() the module's parameters hold no storage of their own
    (beyond the one element they are parked on, at their logical shape): the full flat buffers
    gathered for a unit are really freed, not only uncounted."""
    for held, full in run_world(2, _storage_after_step, name):
        assert held == 0 < full


def _step_twice(backend: CommunicationBackend) -> list[str]:
    from test_strategies_helpers import STRATEGIES, make_data, make_module, optimizer_for, wrap

    from dtlab.errors import StrategyError

    x, y = make_data(1, 4)
    refused = []
    for name in STRATEGIES:
        model = wrap(name, make_module(), backend)
        opt = optimizer_for(name, model, "sgd_plain")
        nn.functional.mse_loss(model(x[0, :2]), y[0, :2]).backward()
        opt.step()
        try:
            opt.step()  # the same gradients a second time
        except StrategyError as exc:
            refused.append(f"{name}: {exc}")
    return refused


def test_a_second_step_on_the_same_gradients_is_refused() -> None:
    for refused in run_world(2, _step_twice):
        assert len(refused) == 5 and all("found no synchronized gradients" in r for r in refused), refused
