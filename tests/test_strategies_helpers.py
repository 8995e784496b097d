"""Shared pieces of the strategy tests (no tests here): tiny models, data, the single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from steps import plain_steps
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.models import DDPModel, FSDPModel, ModuleClassPolicy, ZeRO1Model, ZeRO2Model, ZeRO3Model
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    # no momentum: each update is the gradient itself, so a gradient off by a constant factor shows
    "sgd_plain": (torch.optim.SGD, {"lr": 0.2}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
IN, HIDDEN, OUT = 6, 10, 3


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def make_module(seed: int = 0) -> nn.Module:
    """Values from a private generator: in-memory ranks are threads sharing torch's global RNG."""
    module = nn.Sequential(nn.Linear(IN, HIDDEN), Block(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    return filled(module, seed, scale=0.4)


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, global_batch, IN, generator=g), torch.randn(
        steps, global_batch, OUT, generator=g
    )


def wrap(name: str, module: nn.Module, backend: CommunicationBackend, **kw: Any) -> Any:
    if name == "ddp":
        return DDPModel(module, backend, **kw)
    if name == "zero1":
        return ZeRO1Model(module, backend, **kw)
    if name == "zero2":
        return ZeRO2Model(module, backend, **kw)
    if name == "zero3":
        return ZeRO3Model(module, backend, **{"persistence_threshold": 0, **kw})
    return FSDPModel(module, backend, **{"wrap_policy": ModuleClassPolicy((Block, nn.Linear)), **kw})


def optimizer_for(name: str, model: Any, opt: str) -> Any:
    cls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(name, ZeRO3Optimizer)
    ocls, kw = OPTIMIZERS[opt]
    return cls(model, ocls, **kw)


def train_distributed(
    backend: CommunicationBackend, name: str, opt: str, steps: int, global_batch: int, **kw: Any
) -> dict[str, torch.Tensor]:
    x, y = make_data(steps, global_batch)
    model = wrap(name, make_module(), backend, **kw)
    o = optimizer_for(name, model, opt)
    p, r = backend.world_size, backend.rank
    local = global_batch // p
    mine = slice(r * local, (r + 1) * local)
    plain_steps(model, o, zip(x[:steps, mine], y[:steps, mine], strict=True), nn.functional.mse_loss)
    return model.full_state_dict()


def train_reference(opt: str, steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    x, y = make_data(steps, global_batch)
    module = make_module()
    ocls, kw = OPTIMIZERS[opt]
    o = ocls(module.parameters(), **kw)
    plain_steps(module, o, zip(x[:steps], y[:steps], strict=True), nn.functional.mse_loss)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"keys differ: {sorted(set(a) ^ set(b))}")
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def train_all(
    backend: CommunicationBackend, steps: int, global_batch: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Every strategy with every optimizer in one world (spawned Gloo/MPI worlds are costly to start)."""
    torch.set_num_threads(1)
    return {
        f"{name}/{opt}": train_distributed(backend, name, opt, steps, global_batch)
        for name in STRATEGIES
        for opt in OPTIMIZERS
    }
