"""Converting a wrapped model's dtype or device (``model.double()``, ``.half()``, ``.to(...)``, on the
wrapper or on ``model.module``) is refused with one error naming the parameter, both dtypes and the fix,
on 2 in-memory ranks under DDP, ZeRO-1/2/3, FSDP, tensor and pipeline parallelism; conversions that
change nothing train as one process does. (Before: a raw torch error under DDP/ZeRO-1, a wrong result
under ZeRO-2, the conversion silently ignored under ZeRO-3/FSDP.) Converted and back
(``model.module.double().float()``): ZeRO-1/2 refuse the step (the parameters left the buckets their
optimizer steps: 0.29 relative error before), DDP, ZeRO-3 and FSDP train as one process."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, max_rel_error, wrap
from test_tensor_habits import PLAN, build, data
from torch import nn
from torch.nn import functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH, LR = 2, 8, 0.1
CLASSES = {
    "ddp": "DDPModel",
    "zero1": "ZeRO1Model",
    "zero2": "ZeRO2Model",
    "zero3": "ZeRO3Model",
    "fsdp": "FSDPModel",
}
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}
#: conversions of the wrapper that change a parameter, refused before any change
REFUSED: dict[str, Callable[[nn.Module], Any]] = {
    "double": lambda m: m.double(),
    "to_bf16": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "to_meta": lambda m: m.to("meta"),
}
#: conversions that change nothing: they run (torch's no-ops)
NO_OPS: list[Callable[[nn.Module], Any]] = [
    lambda m: m.float(),
    lambda m: m.to("cpu"),
    lambda m: m.to(torch.float32),
    lambda m: m.cpu(),
    lambda m: m.module.float(),
]


def outcome(fn: Callable[..., Any], *args: Any) -> str:
    try:
        fn(*args)
    except StrategyError as e:
        return str(e)
    return "ran"


def train(backend: CommunicationBackend, model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    half = GLOBAL_BATCH // backend.world_size
    mine = slice(backend.rank * half, (backend.rank + 1) * half)
    for s in range(STEPS):
        F.mse_loss(model(xs[s, mine]), ys[s, mine]).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.state_dict())


def dp_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        model = wrap(name, make_module(), backend)
        for how, convert in REFUSED.items():
            out[f"{name}/{how}"] = outcome(convert, model)
        out[f"{name}/dtypes"] = {p.dtype for p in model.module.parameters()}
        for convert in NO_OPS:
            convert(model)
        out[f"{name}/trained"] = train(
            backend, model, OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=LR)
        )
        # on the wrapped module: found at the next forward (and under ZeRO-3/FSDP at a gathering)
        model = wrap(name, make_module(), backend)
        opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=LR)
        model.module.double()
        x = make_data(1, 4)[0][0]
        out[f"{name}/module"] = outcome(model, x.double())
        out[f"{name}/module_state"] = outcome(model.full_state_dict)
        out[f"{name}/module_step"] = outcome(opt.step)
        # converted and back: the parameters are new tensors (of the wrapped dtype)
        model = wrap(name, make_module(), backend)
        opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=LR)
        model.module.double().float()
        out[f"{name}/back"] = outcome(train, backend, model, opt)
        out[f"{name}/back_trained"] = dict(model.state_dict())
    return out


def reference() -> dict[str, torch.Tensor]:
    module = make_module()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        F.mse_loss(module(xs[s]), ys[s]).backward()
        opt.step()
        opt.zero_grad()
    return module.state_dict()


def test_converting_a_wrapped_model_is_refused_under_data_parallel_strategies() -> None:
    ref = reference()
    for rank, res in enumerate(run_world(2, dp_world, timeout=120)):
        for name in STRATEGIES:
            where, cls = f"{name} rank {rank}", CLASSES[name]
            for how, to in (("double", "float64"), ("to_bf16", "bfloat16"), ("half", "float16")):
                got = res[f"{name}/{how}"]
                assert (
                    f"refused converting parameter '0.weight' from torch.float32 on cpu to torch.{to} on cpu"
                    in got
                ), (where, got)
                assert f"{cls}(module.to(torch.{to}), backend)" in got and "torch.autocast" in got, (
                    where,
                    got,
                )
            assert "to torch.float32 on meta" in res[f"{name}/to_meta"], (where, res[f"{name}/to_meta"])
            assert res[f"{name}/dtypes"] == {torch.float32}, where  # nothing changed before the refusal
            assert max_rel_error(res[f"{name}/trained"], ref) <= 1e-5, where
            refused = ["module", "module_step"] + (["module_state"] if name in ("zero3", "fsdp") else [])
            for what in refused:  # ZeRO-3/FSDP: a gathering would have undone the conversion
                got = res[f"{name}/{what}"]
                said = f"{cls}: model.module converted parameter '0.weight' from torch.float32 on cpu to"
                assert f"{said} torch.float64 on cpu" in got, (where, what, got)
            # DDP steps the parameters; ZeRO-1/2 write them back into their bucket, ZeRO-3/FSDP gather
            # them into place
            assert res[f"{name}/back"] == "ran", (where, res[f"{name}/back"])
            assert max_rel_error(res[f"{name}/back_trained"], ref) <= 1e-5, where


def tp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()


def mp_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for kind in ("tensor", "pipeline"):
        for target in ("wrapper", "module"):
            if kind == "tensor":
                model: Any = TensorParallelModel(build(), Mesh(backend, {"tp": 2}), plan=PLAN)
                step = partial(tp_step, model, *data(0))
            else:
                model = PipelineParallelModel(make_module(), Mesh(backend, {"pp": 2}), micro_batches=2)
                x, y = make_data(1, 4)
                step = partial(model.train_step, (x[0], y[0]), F.mse_loss)
            model.float()  # changes nothing: runs
            if target == "wrapper":
                out[f"{kind}/wrapper"] = outcome(model.double)
                out[f"{kind}/dtypes"] = {p.dtype for p in model.module.parameters()}
                out[f"{kind}/step"] = outcome(step)
            else:
                model.module.to(torch.bfloat16)
                out[f"{kind}/module"] = outcome(step)
    return out


def test_converting_is_refused_under_tensor_and_pipeline_parallelism() -> None:
    for rank, res in enumerate(run_world(2, mp_world, timeout=120)):
        for kind, cls in (("tensor", "TensorParallelModel"), ("pipeline", "PipelineParallelModel")):
            where = f"{kind} rank {rank}"
            got = res[f"{kind}/wrapper"]
            assert f"{cls}: refused converting parameter" in got and "to torch.float64 on cpu" in got, (
                where,
                got,
            )
            assert res[f"{kind}/dtypes"] == {torch.float32} and res[f"{kind}/step"] == "ran", where
            got = res[f"{kind}/module"]
            assert f"{cls}: model.module converted parameter" in got and "to torch.bfloat16 on cpu" in got, (
                where,
                got,
            )
