"""Ranks routing their batches through different modules (``find_unused_parameters=True``: a branch per
rank, experts chosen per rank), on 2 in-memory ranks against one process on the global batch (3 SGD
steps). DDP, ZeRO-1 and ZeRO-2 hold whole parameters: exact. Under ZeRO-3 and FSDP each unit is gathered
by a collective matched by order alone, so rank 0 gathering branch ``a`` while rank 1 gathered branch
``b`` (the same size) mixed their shards silently (0.16 relative error after 3 steps under ZeRO-3,
0.25 under FSDP with a unit per layer); both ranks now refuse at the end of the backward, naming the
fix. FSDP with the branches in one unit gathers the same unit on every rank: exact."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from test_strategies_helpers import STRATEGIES, max_rel_error, optimizer_for, wrap
from torch import nn
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
ROUTES = [("a", "b"), ("a", "b"), ("b", "a")]  # per step: rank 0's branch, rank 1's


class Branchy(nn.Module):
    """Two branches of the same shape; each forward takes the one it is told."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = (
            nn.Linear(4, 6),
            nn.Linear(6, 6),
            nn.Linear(6, 6),
            nn.Linear(6, 2),
        )

    def forward(self, x: torch.Tensor, route: str) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.a(h) if route == "a" else self.b(h))


def make() -> Branchy:
    return filled(Branchy(), 0, scale=0.4)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 4, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 2, generator=g)


def reference() -> dict[str, torch.Tensor]:
    """One process: each half of the batch through its rank's branch, the mean of the halves' losses."""
    x, y = data()
    module = make()
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    h = GLOBAL_BATCH // 2
    for s, routes in enumerate(ROUTES):
        loss = sum(
            F.mse_loss(module(x[s, r * h : (r + 1) * h], routes[r]), y[s, r * h : (r + 1) * h])
            for r in (0, 1)
        )
        (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = data()
    r, h = backend.rank, GLOBAL_BATCH // 2
    out: dict[str, Any] = {}
    for name in (*STRATEGIES, "fsdp_one_unit"):
        kw: dict[str, Any] = {"wrap_policy": None} if name == "fsdp_one_unit" else {}
        model = wrap(name.removesuffix("_one_unit"), make(), backend, find_unused_parameters=True, **kw)
        opt = optimizer_for(name.removesuffix("_one_unit"), model, "sgd")
        try:
            for s, routes in enumerate(ROUTES):
                F.mse_loss(model(x[s, r * h : (r + 1) * h], routes[r]), y[s, r * h : (r + 1) * h]).backward()
                opt.step()
                opt.zero_grad()
            out[name] = model.full_state_dict()
        except StrategyError as exc:
            out[name] = str(exc)
    return out


def test_ranks_running_different_modules_are_exact_or_refused_together() -> None:
    ref = reference()
    for rank, res in enumerate(run_world(2, world, timeout=60)):
        for name in ("ddp", "zero1", "zero2", "fsdp_one_unit"):
            assert not isinstance(res[name], str), f"{name} rank {rank}: {res[name]}"
            assert max_rel_error(res[name], ref) <= 1e-6, f"{name} rank {rank}"
        for name in ("zero3", "fsdp"):
            msg = res[name]
            assert isinstance(msg, str) and "gathered different units" in msg, f"{name} rank {rank}: {msg}"
            assert "run every branch on every rank" in msg and "DDPModel, ZeRO1Model or ZeRO2Model" in msg
