"""A gradient penalty on the inputs (``torch.autograd.grad(loss, x, create_graph=True)``, then a loss on
that gradient: WGAN-GP, R1) through an ``nn.SyncBatchNorm`` under a data-parallel strategy. dtlab's
synchronized batch norm computes its input gradient outside autograd, so the second backward took it
for a constant: 3.0e-2 relative error against one process's BatchNorm after 3 SGD steps (float64, each
rank given the whole batch), no error, under DDP and ZeRO-2. It is now refused on every rank, naming
nn.BatchNorm or a norm without batch statistics; with plain nn.BatchNorm the penalty equals one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import DDPModel, ZeRO2Model
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer
from dtlab.testing import run_world

LR = 0.5


def _net(sync: bool) -> nn.Module:
    net = filled(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)), 0, scale=0.5)
    net = net.double()  # second derivatives compared without float32 round-off
    return nn.SyncBatchNorm.convert_sync_batchnorm(net) if sync else net


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, 6, generator=gen, dtype=torch.float64)
    return list(zip(x, torch.randint(0, 3, (3, 8), generator=gen), strict=True))


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    loss = F.cross_entropy(model(x), y)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad.pow(2).sum()).backward()
    opt.step()
    opt.zero_grad()


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pairs = (("ddp", DDPModel, DDPOptimizer), ("zero2", ZeRO2Model, ZeRO2Optimizer))
    for name, model_class, opt_class in pairs:
        for sync in (True, False):
            model = model_class(_net(sync), backend)
            opt = opt_class(model, torch.optim.SGD, lr=LR)
            try:
                for x, y in _data():  # every rank the whole batch: one process's statistics and penalty
                    _step(model, opt, x, y)
                out[f"{name}/{sync}"] = model.state_dict()
            except StrategyError as exc:
                out[f"{name}/{sync}"] = str(exc)
    return out


def test_a_penalty_through_sync_batchnorm_is_refused_and_plain_batchnorm_equals_one_process() -> None:
    plain = _net(False)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for x, y in _data():
        _step(plain, opt, x, y)
    for got in run_world(2, _world, timeout=60):
        for name in ("ddp", "zero2"):
            said = got[f"{name}/True"]
            assert isinstance(said, str), f"{name}: a penalty through nn.SyncBatchNorm trained"
            assert "nn.SyncBatchNorm under a data-parallel strategy has no second derivative" in said
            assert "nn.LayerNorm" in said
            for k, v in plain.state_dict().items():
                torch.testing.assert_close(got[f"{name}/False"][k], v, rtol=1e-10, atol=1e-12, msg=k)
