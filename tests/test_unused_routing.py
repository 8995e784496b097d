"""Ranks routing their batches through different modules (``find_unused_parameters=True``: a branch per
rank, experts chosen per rank), on 2 in-memory ranks against one process on the global batch (3 SGD
steps). DDP, ZeRO-1 and ZeRO-2 hold whole parameters: exact. Under ZeRO-3 and FSDP each unit is gathered
by a collective matched by order alone, so rank 0 gathering branch ``a`` while rank 1 gathered branch
``b`` (the same size) mixed their shards silently (0.16 relative error after 3 steps under ZeRO-3,
0.25 under FSDP with a unit per layer); both ranks now refuse at the end of the backward, naming the
fix. FSDP with the branches in one unit gathers the same unit on every rank: exact.

A parameter no rank used in a step (a branch or task head skipped on every rank) was stepped with a
zero gradient: momentum, weight decay and Adam's step moved it, where one process (and torch's DDP)
leave its ``.grad`` None and torch's optimizer skips it (0.019 relative error after these 3
SGD-momentum steps; 0.013 with AdamW in a like probe; under all five strategies). The strategies
now all-reduce which parameters each rank used and the optimizer strategy leaves out those no rank
did: exact; with ``zero_grad(set_to_none=False)`` a parameter that had a gradient is stepped with
zeros, as in torch, and one that never had one is not (clearing before the first backward too, or
with model.zero_grad(set_to_none=False))."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from filled import filled
from test_strategies_helpers import STRATEGIES, max_rel_error, optimizer_for, wrap
from torch import nn
from torch.nn import functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
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
        if route == "both":
            return self.out(self.a(h) + self.b(h))
        if route == "none":
            return self.out(h)
        return self.out(self.a(h) if route == "a" else self.b(h))


def make() -> Branchy:
    return filled(Branchy(), 0, scale=0.4)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 4, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 2, generator=g)


#: per step, each rank's branch (the same: ZeRO-3/FSDP refuse others): b unused at step 0, a and b at 1
SKIPPING = [("a", "a"), ("none", "none"), ("both", "both")]
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
    "adamw_wd": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def reference(
    routes_per_step: list[tuple[str, str]] = ROUTES, opt_name: str = "sgd", set_to_none: bool = True
) -> dict[str, torch.Tensor]:
    """One process: each half of the batch through its rank's branch, the mean of the halves' losses."""
    x, y = data()
    module = make()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(module.parameters(), **kw)
    h = GLOBAL_BATCH // 2
    for s, routes in enumerate(routes_per_step):
        loss = sum(
            F.mse_loss(module(x[s, r * h : (r + 1) * h], routes[r]), y[s, r * h : (r + 1) * h])
            for r in (0, 1)
        )
        (loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
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


#: (optimizer, set_to_none, clearing before each forward instead of after each step: torch gives both
#: the same result, the first clearing finding no .grad to zero; clearing by model.zero_grad(), not
#: the optimizer's)
RUNS = [
    ("sgd", True, False, False),
    ("adamw", True, False, False),
    ("sgd", False, False, False),
    ("adamw", False, True, False),
    ("adamw", False, False, True),
    ("adamw", True, False, True),
]
STRATEGY_OPTIMIZERS: dict[str, Any] = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def skipping_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = data()
    r, h = backend.rank, GLOBAL_BATCH // 2
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for opt_name, set_to_none, first, by_model in RUNS:
            model = wrap(name, make(), backend, find_unused_parameters=True)
            cls, kw = OPTIMIZERS[opt_name]
            opt = STRATEGY_OPTIMIZERS.get(name, ZeRO3Optimizer)(model, cls, **kw)
            clear = model.zero_grad if by_model else opt.zero_grad
            for s, routes in enumerate(SKIPPING):
                if first:
                    clear(set_to_none=set_to_none)
                F.mse_loss(model(x[s, r * h : (r + 1) * h], routes[r]), y[s, r * h : (r + 1) * h]).backward()
                opt.step()
                if not first:
                    clear(set_to_none=set_to_none)
            out[f"{name}/{opt_name}/{set_to_none}/{first}/{by_model}"] = model.full_state_dict()
    return out


def test_parameters_no_rank_used_are_left_out_of_the_step_as_in_torch() -> None:
    refs = {run[:2]: reference(SKIPPING, *run[:2]) for run in RUNS}
    for rank, res in enumerate(run_world(2, skipping_world, timeout=60)):
        for name in STRATEGIES:
            for opt_name, set_to_none, first, by_model in RUNS:
                where = f"{name}/{opt_name}/{set_to_none}/{first}/{by_model}"
                err = max_rel_error(res[where], refs[(opt_name, set_to_none)])
                assert err <= 1e-6, f"{where} rank {rank}: relative error {err:.2e}"


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(h))


def _staged() -> nn.Module:
    return filled(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _WithUnused(), nn.Linear(6, 2)), 0, scale=0.4)


def _staged_reference() -> dict[str, torch.Tensor]:
    x, y = data()
    module = _staged()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    for s in range(STEPS):
        F.mse_loss(module(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def pipeline_world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = data()
    out: dict[str, Any] = {}
    for dp, schedule in (("ddp", "1f1b"), ("fsdp", "1f1b"), ("zero1", "zero_bubble")):
        model = HybridShardedModel(
            _staged(),
            Mesh(backend, {"pp": 2}),
            dp,
            micro_batches=2,
            schedule=schedule,
            find_unused_parameters=True,
        )
        opt = STRATEGY_OPTIMIZERS.get(dp, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        for s in range(STEPS):
            model.train_step((x[s], y[s]), F.mse_loss)
            opt.step()
            opt.zero_grad()
        out[f"{dp}/{schedule}"] = model.full_state_dict()
    return out


def test_a_pipeline_with_find_unused_parameters_leaves_an_unused_parameter_out() -> None:
    """A pipeline reduces its accumulated gradients with zeros for a parameter no micro-batch used;
    without find_unused_parameters AdamW's weight decay moves it (3.0e-3 relative error after 3 steps,
    docs/strategies.md); with it, it is left out as in torch under DDP, ZeRO-1 and FSDP over dp, 1F1B
    and zero-bubble (whose deferred weight gradients are written by hand: the hooks still mark them)."""
    ref = _staged_reference()
    for rank, res in enumerate(run_world(2, pipeline_world, timeout=60)):
        for where, got in res.items():
            assert max_rel_error(got, ref) <= 1e-6, f"{where} rank {rank}"


#: (data-parallel strategy, schedule) for the pipelines below, each at pp=2 with dp=1 and with dp=2
PIPELINES = (("ddp", "1f1b"), ("fsdp", "1f1b"), ("zero1", "zero_bubble"), ("zero3", "gpipe"))


class _Switched(nn.Module):
    """``extra`` used only while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.extra, self.on = nn.Linear(6, 6), nn.Linear(6, 6), True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.used(h))
        return h + self.extra(h) if self.on else h


def _switched() -> nn.Sequential:
    return filled(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _Switched(), nn.Linear(6, 2)), 0, scale=0.4)


def _switched_reference(always: bool = False) -> dict[str, torch.Tensor]:
    """``extra`` used at the first step only, ``zero_grad(set_to_none=False)``: torch steps it with zeros
    (``always``: used at every step, ``zero_grad()``)."""
    x, y = data()
    module = _switched()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    for s in range(STEPS):
        module[2].on = always or s == 0
        F.mse_loss(module(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad(set_to_none=always)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def refused_pipeline_world(backend: CommunicationBackend) -> dict[str, Any]:
    """4 ranks: pp=2 x dp=2, and pp=2 alone on each half of the world (dp=1). Without
    find_unused_parameters each step is refused on every rank, before reducing: ``opt.step()`` then
    finds no synchronized gradient."""
    torch.set_num_threads(1)
    x, y = data()
    half = backend.split(backend.rank // 2, backend.rank)
    out: dict[str, Any] = {}
    for layout, mesh in (("pp2dp2", Mesh(backend, {"pp": 2, "dp": 2})), ("pp2", Mesh(half, {"pp": 2}))):
        dp_rank, dp_size = mesh.coordinate("dp"), mesh.size("dp")
        for dp, schedule in PIPELINES:
            kw: dict[str, Any] = {"persistence_threshold": 0} if dp == "zero3" else {}
            model = HybridShardedModel(_staged(), mesh, dp, micro_batches=2, schedule=schedule, **kw)
            opt = STRATEGY_OPTIMIZERS.get(dp, ZeRO3Optimizer)(
                model, torch.optim.AdamW, lr=0.01, weight_decay=0.1
            )
            local = GLOBAL_BATCH // dp_size
            batch = (
                x[0, dp_rank * local : (dp_rank + 1) * local],
                y[0, dp_rank * local : (dp_rank + 1) * local],
            )
            got = []
            for call in (partial(model.train_step, batch, F.mse_loss), opt.step):
                try:
                    call()
                    got.append("ran")
                except StrategyError as exc:
                    got.append(str(exc))
            out[f"{layout}/{dp}/{schedule}"] = (mesh.coordinate("pp"), got)
    mesh = Mesh(backend, {"pp": 2, "dp": 2})
    local, dp_rank = GLOBAL_BATCH // 2, mesh.coordinate("dp")
    for dp, schedule in PIPELINES[:3]:  # a zero gradient kept by zero_grad(set_to_none=False): stepped
        net = _switched()
        model = HybridShardedModel(net, mesh, dp, micro_batches=2, schedule=schedule)
        opt = STRATEGY_OPTIMIZERS.get(dp, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        for s in range(STEPS):
            net[2].on = s == 0
            part = slice(dp_rank * local, (dp_rank + 1) * local)
            model.train_step((x[s, part], y[s, part]), F.mse_loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
        out[f"kept/{dp}/{schedule}"] = model.full_state_dict()
    for schedule in ("1f1b", "zero_bubble"):  # DDP, every .grad cleared the torch way (model.zero_grad())
        for always in (False, True):
            net = _switched()
            model = HybridShardedModel(net, mesh, "ddp", micro_batches=2, schedule=schedule)
            opt = DDPOptimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
            got: list[str] = []
            for s in range(STEPS if always else 2):
                net[2].on = always or s == 0
                part = slice(dp_rank * local, (dp_rank + 1) * local)
                try:
                    model.train_step((x[s, part], y[s, part]), F.mse_loss)
                    opt.step()
                    got.append("ran")
                except StrategyError as exc:
                    got.append(str(exc))
                model.zero_grad()
            out[f"cleared/{schedule}/{always}"] = (got, model.full_state_dict() if always else None)
    return out


def test_a_pipeline_without_find_unused_parameters_refuses_an_unused_parameter_on_every_rank() -> None:
    """Stepped with the zeros reduced for it, AdamW's weight decay moved it (3.0e-3 relative error after
    3 steps); now every rank of the pipeline refuses the step, the stage holding it naming it. A
    parameter holding a zero gradient kept by ``zero_grad(set_to_none=False)`` is stepped, as in torch."""
    ref, used_ref = _switched_reference(), _switched_reference(always=True)
    for rank, res in enumerate(run_world(4, refused_pipeline_world, timeout=60)):
        for where in [w for w in res if w.startswith("kept/")]:
            assert max_rel_error(res.pop(where), ref) <= 1e-6, f"{where} rank {rank}"
        # DDP with the gradients cleared the torch way: refused at the first step extra is unused
        # (its zeros were stepped once before: 2.5e-2 relative error after 2 steps), and a model
        # using everything trains as torch
        for where in [w for w in res if w.startswith("cleared/")]:
            got, state = res.pop(where)
            if where.endswith("True"):
                assert got == ["ran"] * STEPS and max_rel_error(state, used_ref) <= 1e-6, f"{where} {rank}"
            else:
                assert got[0] == "ran" and "received no gradient" in got[1], f"{where} rank {rank}: {got}"
        for where, (pp_rank, (step, after)) in res.items():
            ranks = "(dp rank, pipeline rank) [(0, 1), (1, 1)]" if "dp2" in where else "pipeline rank(s) [1]"
            assert "find_unused_parameters=True" in step and ranks in step, f"{where} {rank}: {step}"
            named = "'2.unused.weight'" in step and "'2.unused.bias'" in step
            assert named == (pp_rank == 1), f"{where} rank {rank}: {step}"
            assert "found no synchronized gradients" in after, f"{where} rank {rank}: {after}"


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.h1, self.h2 = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.h1(h), self.h2(h)


def two_backwards_world(backend: CommunicationBackend) -> dict[str, str]:
    """``l1.backward(retain_graph=True); l2.backward()`` over one forward, each loss on one head."""
    x, y = data()
    out = {}
    for name in STRATEGIES:
        model = wrap(name, filled(_TwoHeads(), 0, scale=0.4), backend)
        a, b = model(x[0, :4])
        try:
            F.mse_loss(a, y[0, :4]).backward(retain_graph=True)
            F.mse_loss(b, -y[0, :4]).backward()
            out[name] = "ran"
        except StrategyError as exc:
            out[name] = str(exc)
    return out


def test_two_backwards_over_one_forward_name_adding_the_losses() -> None:
    for res in run_world(2, two_backwards_world, timeout=60):
        for name, msg in res.items():
            assert "'h2.weight'" in msg and "(l1 + l2).backward()" in msg, f"{name}: {msg}"
