"""ZeRO-3/FSDP ``state_dict()`` never hands out empty tensors, and ``torch.compile``d modules train under
DDP, ZeRO-3 and FSDP (compiled before or after wrapping) to the same parameters as without compiling
(DDP with BatchNorm buffers, broadcast before each forward, too), and so does a compiled
``TensorParallelModel`` (it stopped with dynamo's raw error tracing into the backend's collective),
its tp batch check on (one graph break, not traced: no more graphs than without the check)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from filled import filled
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.errors import CheckpointError, StrategyError
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy, TensorParallelModel, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, default_optimizer_strategy
from dtlab.testing import run_world


def _net(norm: bool = False) -> nn.Module:
    """``norm``: a BatchNorm with running statistics, buffers DDP broadcasts before each forward."""
    mid = nn.BatchNorm1d(16) if norm else nn.Identity()
    return filled(nn.Sequential(nn.Linear(8, 16), mid, nn.ReLU(), nn.Linear(16, 4)), 0, scale=0.3)


def _state_dict_checks(backend: CommunicationBackend) -> None:
    plain = _net()
    other = {k: v + 1 for k, v in plain.state_dict().items()}
    for model in (
        ZeRO3Model(_net(), backend, persistence_threshold=0),
        FSDPModel(_net(), backend, wrap_policy=ModuleClassPolicy((nn.Linear,))),
    ):
        with pytest.raises(StrategyError, match=r"full_state_dict\(\) on every rank"):
            model.module.state_dict()  # the wrapped module's own: this rank holds shards only
        got = model.state_dict()  # the wrapper's: whole tensors keyed like the plain module's
        assert sorted(got) == sorted(plain.state_dict())
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())
        model.load_state_dict(other)  # into the already-wrapped model
        assert all(torch.equal(model.full_state_dict()[k], v) for k, v in other.items())
        model.load_state_dict({"module." + k: v for k, v in plain.state_dict().items()})  # torch DDP's keys
        full = model.full_state_dict()  # and nothing was left gathered
        assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
        assert model.memory_report()["parameters"] < sum(t.nbytes for t in full.values())
        assert model.sharded_state_dict()  # the checkpoint path is untouched
        with pytest.raises(CheckpointError, match="missing keys"):
            model.load_state_dict({k: v for k, v in plain.state_dict().items() if k != "0.bias"})
    # nothing sharded at rest (every parameter under the persistence threshold) or DDP: whole tensors
    for model in (ZeRO3Model(_net(), backend, persistence_threshold=10**6), DDPModel(_net(), backend)):
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())


# one model keeps every parameter whole on purpose (persistence threshold above all), which ZeRO-3 warns about
@pytest.mark.filterwarnings("ignore:ZeRO3Model. persistence_threshold=.*keeps every:UserWarning")
def test_state_dict_is_whole_and_loads_into_a_wrapped_model() -> None:
    run_world(2, _state_dict_checks, timeout=60)


def _train(
    backend: CommunicationBackend, strategy: str, compiled: str, norm: bool
) -> dict[str, torch.Tensor]:
    net = _net(norm)
    if compiled == "module":
        net = torch.compile(net, backend="aot_eager")  # type: ignore[assignment]
    if strategy == "ddp":
        model: Any = DDPModel(net, backend)
    elif strategy == "zero3":
        model = ZeRO3Model(net, backend, persistence_threshold=0)
    else:
        model = FSDPModel(net, backend, wrap_policy=ModuleClassPolicy((nn.Linear,)))
    opt = default_optimizer_strategy(strategy)(model, torch.optim.SGD, lr=0.1)
    run = torch.compile(model, backend="aot_eager") if compiled == "strategy" else model
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + backend.rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        nn.functional.mse_loss(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k.removeprefix("_orig_mod."): v for k, v in model.full_state_dict().items()}


def _compile_checks(backend: CommunicationBackend) -> list[str]:
    done = []
    # ddp/strategy/norm: the buffer broadcast before each forward runs eagerly (it was traced and failed)
    # zero3/strategy then fsdp/strategy: a second compiled sharded model in one process (its write check
    # once cached a torch.compiler.disable wrapper on itself, which the second one read as None)
    cases = (
        ("ddp", "module", False),
        ("zero3", "module", False),
        ("zero3", "strategy", False),
        ("fsdp", "strategy", False),
    )
    for strategy, compiled, norm in (*cases, ("ddp", "strategy", True)):
        ref, got = _train(backend, strategy, "no", norm), _train(backend, strategy, compiled, norm)
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=f"{strategy} {k}")
        done.append(f"{strategy}/{compiled}" + ("/norm" if norm else ""))
    return done


def test_compiled_module_trains_like_eager_under_ddp_zero3_and_fsdp() -> None:
    pytest.importorskip("torch._dynamo")
    done = run_world(2, _compile_checks, timeout=240)
    assert done[0] == ["ddp/module", "zero3/module", "zero3/strategy", "fsdp/strategy", "ddp/strategy/norm"]


STEPS = 1


def _tensor_parallel(
    backend: CommunicationBackend, compiled: bool, when: str = "always"
) -> tuple[dict[str, torch.Tensor], int]:
    """tp=2 over a column/row-parallel block and a column-parallel head gathering its output (each
    tensor-parallel collective and the tp batch check run eagerly: a graph break at each); the
    parameters after the steps and how many graphs were compiled."""
    from test_tensor_habits import LR, PLAN, build, data

    torch.set_num_threads(1)
    graphs: list[object] = []

    def counted(gm: torch.fx.GraphModule, _: object) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    model = TensorParallelModel(build(), Mesh(backend, {"tp": 2}), plan=PLAN, tp_batch_check=when)
    opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
    run = torch.compile(model, backend=counted) if compiled else model
    for step in range(STEPS):
        x, y = data(step)
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    compiled_graphs = len(graphs)
    if compiled and when == "always":  # checked eagerly inside the compiled forward: a differing batch
        x, _ = data(backend.rank + 1)
        with pytest.raises(StrategyError, match="different inputs"):
            run(x)
    return model.full_state_dict(), compiled_graphs


def _tp_checks(backend: CommunicationBackend) -> None:
    (ref, _), (got, checked) = _tensor_parallel(backend, False), _tensor_parallel(backend, True)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=f"tp {k}")
    _, unchecked = _tensor_parallel(backend, True, "never")
    # the batch check is one graph break, not traced (traced, it made 13-18 graphs against 9). The
    # in-memory ranks are threads sharing dynamo's cache, so one rank may compile a graph more or less
    # than alone (10 against 9 seen once): two graphs of slack
    assert checked <= unchecked + 2, (checked, unchecked)


def test_compiled_tensor_parallel_model_trains_like_eager() -> None:
    pytest.importorskip("torch._dynamo")
    run_world(2, _tp_checks, timeout=240)


def _compiled_refusals(backend: CommunicationBackend) -> list[str]:
    from test_tensor_habits import PLAN, build

    from dtlab.models import PipelineParallelModel

    errors = []
    for wrap in (
        lambda: TensorParallelModel(torch.compile(build(), backend="eager"), backend, plan=PLAN),
        lambda: PipelineParallelModel(
            torch.compile(_net(), backend="eager"), backend, micro_batches=2, split_points=["2"]
        ),
    ):
        with pytest.raises(StrategyError) as info:
            wrap()
        errors.append(str(info.value))
    return errors


def test_a_compiled_module_is_refused_where_the_layers_are_found_by_name() -> None:
    """torch.compile(model)'s wrapper names its modules '_orig_mod.<name>': a tensor plan or split
    points by the model's names would find none (refused naming the fix, not 'matches no module')."""
    pytest.importorskip("torch._dynamo")
    for error in run_world(2, _compiled_refusals, timeout=60)[0]:
        assert "the module is torch.compile(model)'s wrapper (OptimizedModule)" in error, error
        assert "hf_model.compile()" in error and "torch.compile(model), without a pipeline" in error, error


def _frames_compiled(backend: CommunicationBackend, strategy: str, compiled: str) -> list[int]:
    """Dynamo's count of frames it compiled (process-wide) after each of 5 steps, the strategy compiled
    or the module compiled before wrapping."""
    from torch._dynamo.utils import counters

    with seeded_init(0):
        net = nn.Sequential(_net(), nn.ReLU(), nn.Linear(4, 4))  # units of three shapes
    if compiled == "module":
        net = torch.compile(net, backend="eager")  # type: ignore[assignment]
    policy = ModuleClassPolicy((nn.Linear,))
    model = (
        ZeRO3Model(net, backend, persistence_threshold=0)
        if strategy == "zero3"
        else FSDPModel(net, backend, wrap_policy=policy)
    )
    opt = default_optimizer_strategy(strategy)(model, torch.optim.SGD, lr=0.1)
    run = torch.compile(model, backend="eager") if compiled == "strategy" else model
    frames = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        nn.functional.mse_loss(run(torch.randn(6, 8, generator=g)), torch.randn(6, 4, generator=g)).backward()
        opt.step()
        opt.zero_grad()
        frames.append(counters["frames"]["total"])
    return frames


@pytest.mark.parametrize("compiled", ["strategy", "module"])
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_a_compiled_sharded_model_compiles_nothing_after_its_first_step(strategy: str, compiled: str) -> None:
    """The strategy's bookkeeping around the module's forward and its saved-tensor hooks run eagerly:
    traced, they compiled a graph per unit shape and a frame per saved tensor, at every step until
    dynamo's recompile limit (8 more frames over steps 2-5 for ZeRO-3 here, with a warning). A module
    compiled before wrapping compiled the saved-tensor hook from its eager parts the same way."""
    dynamo = pytest.importorskip("torch._dynamo")
    # the count is process-wide: code compiled by earlier tests in this process (dtlab's hooks with
    # other models or callers) can add one recompile at step 2; counted from a fresh cache
    dynamo.reset()
    frames = run_world(1, _frames_compiled, strategy, compiled, timeout=120)[0]
    assert frames[1:] == [frames[0]] * 4, frames


def _reads_outside(backend: CommunicationBackend) -> str:
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.a(x), self.b.weight)  # b's weight outside b's forward

    with seeded_init(0):
        net = Reader()
    model = ZeRO3Model(net, backend, persistence_threshold=0)
    with pytest.raises(StrategyError) as info:
        model(torch.ones(2, 4))
    return str(info.value)


def test_a_forward_reading_a_parameter_outside_its_module_is_named() -> None:
    for error in run_world(2, _reads_outside, timeout=60):
        assert "ZeRO3Model: the wrapped module's forward failed" in error, error
        assert "list the owner's parent class in leaf_modules or raise persistence_threshold" in error, error
