"""LoRA by hand and other parameters added to a wrapped model, on 2 in-memory ranks against one process
on the global batch. Adapters put around layers of the plain module before wrapping (base weights
frozen there) train exactly under DDP, ZeRO-1/2/3, FSDP and tensor parallelism. Put into
``model.module`` after wrapping they were trained on no rank (the optimizer strategy steps the
parameters the wrapper was built on: 0.060 relative error after 3 steps under every strategy, the
adapters still at their initial values); a parametrization registered after wrapping (its
``original`` parameters) was the same. Now the step refuses them by name, with the fix; a layer
replaced before the optimizer strategy is built is named there (it was called a stranger to the
module). Also refused: an adapter built before wrapping and put in after, and adapters added frozen
(their steps run) then unfrozen."""

from __future__ import annotations

from typing import Any

import torch
from test_strategies_helpers import HIDDEN, OUT, STRATEGIES, make_data, make_module, max_rel_error, wrap
from test_tensor_habits import LR, PLAN, build, data
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import TensorParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
HALVES = [slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)]
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}
ADDED = "trainable parameters were added to the module after wrapping it"


class LoRA(nn.Module):
    """``base(x) + x A^T B^T``: a low-rank adapter around a frozen ``nn.Linear`` (values from a private
    generator: in-memory ranks share torch's global RNG)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(3)
        self.a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen) * 0.3)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def freeze_base(module: nn.Module) -> None:
    """The first two layers frozen (their adapters train), the head trainable."""
    for p in [*module[0].parameters(), *module[1].parameters()]:
        p.requires_grad_(False)


def adapt(module: nn.Module) -> None:
    module[0] = LoRA(module[0])
    module[1].fc = LoRA(module[1].fc)


def train(model: Any, opt: torch.optim.Optimizer, part: slice) -> None:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()


def reference() -> dict[str, torch.Tensor]:
    module = make_module()
    freeze_base(module)
    adapt(module)
    train(module, torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1), slice(None))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def dp_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for when in ("before", "after", "parametrized", "replaced", "prebuilt", "unfrozen"):
        for name in STRATEGIES:
            module = make_module()
            freeze_base(module)
            if when == "before":
                adapt(module)
            prebuilt = LoRA(module[0]) if when == "prebuilt" else None  # put in after wrapping
            model = wrap(name, module, backend)
            try:
                if when == "replaced":  # a new head, then the optimizer strategy
                    model.module[3] = nn.Linear(HIDDEN, OUT)
                opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=0.1)
                if when == "after":
                    adapt(model.module)
                if when == "parametrized":  # after the optimizer strategy: weight_norm's original0/1
                    parametrizations.weight_norm(model.module[3])
                if prebuilt is not None:  # no parameter is registered when it is put in
                    model.module[0] = prebuilt
                if when == "unfrozen":  # added frozen: the steps run; unfrozen later: refused
                    adapt(model.module)
                    adapters = [p for n, p in model.module.named_parameters() if n.endswith((".a", ".b"))]
                    for p in adapters:
                        p.requires_grad_(False)
                    train(model, opt, HALVES[backend.rank])
                    for p in adapters:
                        p.requires_grad_(True)
                train(model, opt, HALVES[backend.rank])
                out[f"{when}/{name}"] = model.full_state_dict()
            except StrategyError as exc:
                out[f"{when}/{name}"] = str(exc)
    return out


def tp_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = Mesh(backend, {"tp": 2})
    out: dict[str, Any] = {}
    for when in ("before", "after"):
        net = build()
        for p in [*net.emb.parameters(), *net.fc1.parameters()]:
            p.requires_grad_(False)
        if when == "before":
            net.emb = LoRA(net.emb)
        model = TensorParallelModel(net, mesh, plan=PLAN)
        if when == "after":
            model.module.emb = LoRA(model.module.emb)
        opt = DDPOptimizer(model, torch.optim.SGD, lr=LR)
        try:
            for s in range(STEPS):
                x, y = data(s)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out[when] = model.full_state_dict()
        except StrategyError as exc:
            out[when] = str(exc)
    return out


def tp_reference() -> dict[str, torch.Tensor]:
    net = build()
    for p in [*net.emb.parameters(), *net.fc1.parameters()]:
        p.requires_grad_(False)
    net.emb = LoRA(net.emb)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR)
    for s in range(STEPS):
        x, y = data(s)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def test_adapters_added_before_wrapping_train_exactly_and_after_are_refused() -> None:
    ref = reference()
    for rank, res in enumerate(run_world(2, dp_world, timeout=120)):
        for name in STRATEGIES:
            where = f"{name} rank {rank}"
            assert max_rel_error(res[f"before/{name}"], ref) <= 1e-6, where
            got = res[f"after/{name}"]
            assert isinstance(got, str) and ADDED in got, f"{where}: {got}"
            assert "['0.a', '0.b', '1.fc.a', '1.fc.b']" in got and "before wrapping it" in got, got
            fix = "full_state_dict()" if name in ("zero3", "fsdp") else "build a new wrapper"
            assert fix in got, f"{where}: {got}"
            got = res[f"parametrized/{name}"]
            assert isinstance(got, str) and ADDED in got and "3.parametrizations.weight.original0" in got, got
            got = res[f"prebuilt/{name}"]
            assert isinstance(got, str) and ADDED in got and "['0.a', '0.b']" in got, f"{where}: {got}"
            got = res[f"unfrozen/{name}"]
            assert isinstance(got, str) and ADDED in got and "['0.a', '0.b', '1.fc.a', '1.fc.b']" in got, got
            got = res[f"replaced/{name}"]  # named when the optimizer strategy is built on the wrapper
            assert "parameters ['3.weight', '3.bias']" in got and "are no longer in its module" in got, got
    ref = tp_reference()
    for res in run_world(2, tp_world, timeout=120):
        assert max_rel_error(res["before"], ref) <= 1e-6
        assert isinstance(res["after"], str) and ADDED in res["after"] and "'emb.a'" in res["after"]
