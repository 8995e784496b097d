"""Gradients accumulated inside ``no_sync()`` and reduced at once: by ``reduce_accumulated_grads()``
called by the user (all five strategies, 2 in-memory ranks), by a pipeline's step (pp=2).

``reduce_accumulated_grads()`` reduced zeros for a parameter no backward gave a gradient since
``zero_grad()`` and the step moved it: 1.35e-2 relative error after 3 AdamW steps with weight decay
(the routes of ``SKIPPING``, under all five strategies) where one process leaves its ``.grad`` None and
skips it. Without find_unused_parameters it is now refused on every rank before reducing (one
all-reduce of a count per rank: also when only one rank skipped it); with it, it is left out as in torch
(exact before too). Under a DDP pipeline ``model.zero_grad()`` (not the optimizer's) left the marks of
the step before, and a parameter unused since was stepped with zeros instead of refused. At pp=2 x dp=2
a parameter reached by one replica's batches only was refused by the replica that had not used it
alone, while the other waited in the dp reduction until the backend's timeout; now every rank refuses."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from filled import filled
from test_strategies_helpers import STRATEGIES, max_rel_error, wrap
from test_unused_routing import GLOBAL_BATCH, SKIPPING, STRATEGY_OPTIMIZERS, _switched, data, make, reference
from torch import nn
from torch.nn import functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import HybridShardedModel
from dtlab.optimizers import DDPOptimizer, ZeRO3Optimizer
from dtlab.testing import run_world

#: step 1's routes, refused (b unused on rank 1; ZeRO-3/FSDP gather alike: on both ranks)
REFUSED = {"whole": ("both", "a"), "sharded": ("a", "a")}


def _accumulated_step(
    model: Any, x: torch.Tensor, y: torch.Tensor, rank: int, routes: tuple[str, str]
) -> None:
    """Two micro-batches of this rank's half inside ``no_sync()``, then ``reduce_accumulated_grads()``."""
    q = GLOBAL_BATCH // 4
    with model.no_sync():
        for lo in (2 * rank * q, (2 * rank + 1) * q):
            (F.mse_loss(model(x[lo : lo + q], routes[rank]), y[lo : lo + q]) / 2).backward()
    model.reduce_accumulated_grads()


def accumulated_world(backend: CommunicationBackend) -> dict[str, Any]:
    """With find_unused_parameters: SKIPPING. Without: step 0 on both branches, ``model.zero_grad()``,
    step 1 refused (then ``opt.step()``), ``opt.zero_grad()`` and step 1 again on both branches."""
    torch.set_num_threads(1)
    (x, y), r, both = data(), backend.rank, ("both", "both")
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for flag in (True, False):
            model = wrap(name, make(), backend, find_unused_parameters=flag)
            opt = STRATEGY_OPTIMIZERS.get(name, ZeRO3Optimizer)(
                model, torch.optim.AdamW, lr=0.01, weight_decay=0.1
            )
            if flag:
                for s, routes in enumerate(SKIPPING):
                    _accumulated_step(model, x[s], y[s], r, routes)
                    opt.step()
                    opt.zero_grad()
                out[f"{name}/skipping"] = model.full_state_dict()
                continue
            _accumulated_step(model, x[0], y[0], r, both)
            opt.step()
            model.zero_grad()  # DDP, ZeRO-1: .grad None, the marks of step 0 still there
            refused = REFUSED["sharded" if name in ("zero3", "fsdp") else "whole"]
            got = []
            for call in (partial(_accumulated_step, model, x[1], y[1], r, refused), opt.step):
                try:
                    call()
                    got.append("ran")
                except StrategyError as exc:
                    got.append(str(exc))
            opt.zero_grad()
            _accumulated_step(model, x[1], y[1], r, both)
            opt.step()
            out[f"{name}/refused"] = (model.full_state_dict(), got)
    return out


def test_reduce_accumulated_grads_refuses_or_leaves_out_a_parameter_without_gradient() -> None:
    """``reduce_accumulated_grads()`` called by the user reduced zeros for a parameter no backward gave a
    gradient since ``zero_grad()`` and the step moved it (1.35e-2 relative error after these 3 AdamW
    steps with weight decay, all five strategies). Without find_unused_parameters it is now refused on
    every rank before reducing (also when only one rank skipped it, and after ``model.zero_grad()``),
    leaving nothing behind; with it, it is left out as in torch."""
    skipping, retried = reference(SKIPPING, "adamw_wd"), reference([("both", "both")] * 2, "adamw_wd")
    for rank, res in enumerate(run_world(2, accumulated_world, timeout=60)):
        for name in STRATEGIES:
            assert max_rel_error(res[f"{name}/skipping"], skipping) <= 1e-6, f"{name} rank {rank}"
            state, (msg, after) = res[f"{name}/refused"]
            assert max_rel_error(state, retried) <= 1e-6, f"{name} rank {rank}"
            ranks = [0, 1] if name in ("zero3", "fsdp") else [1]
            assert "find_unused_parameters=True" in msg and f"rank(s) {ranks}" in msg, f"{name} {rank}: {msg}"
            assert ("'b.weight'" in msg) == (rank in ranks), f"{name} rank {rank}: {msg}"
            assert "found no synchronized gradients" in after, f"{name} rank {rank}: {after}"


def pipeline_world(backend: CommunicationBackend) -> list[str]:
    """A DDP pipeline (pp=2): ``extra`` used at step 0 only, ``model.zero_grad()`` after each step."""
    torch.set_num_threads(1)
    x, y = data()
    net = _switched()
    model = HybridShardedModel(net, Mesh(backend, {"pp": 2}), "ddp", micro_batches=2, schedule="1f1b")
    opt = DDPOptimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    got = []
    for s in range(2):
        net[2].on = s == 0
        try:
            model.train_step((x[s], y[s]), F.mse_loss)
            opt.step()
            got.append("ran")
        except StrategyError as exc:
            got.append(str(exc))
        model.zero_grad()
    return got


def test_a_ddp_pipeline_cleared_by_model_zero_grad_refuses_a_parameter_unused_since() -> None:
    for rank, (first, second) in enumerate(run_world(2, pipeline_world, timeout=60)):
        assert first == "ran", f"rank {rank}: {first}"
        assert "find_unused_parameters=True" in second and "pipeline rank(s) [1]" in second, second
        assert ("'2.extra.weight'" in second) == (rank == 1), f"rank {rank}: {second}"


class _Gated(nn.Module):
    """``extra`` reached only by a micro-batch whose every first feature is positive (shape-static: the
    meta forward, which computes the stage shapes, takes the other branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.extra = nn.Linear(4, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.used(x))
        return h + self.extra(h) if not x.is_meta and bool((x[:, 0] > 0).all()) else h


def _gated() -> nn.Sequential:
    return filled(nn.Sequential(_Gated(), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 2)), 0, scale=0.4)


#: per step, the sign of x[:, 0] in dp replica 0's and replica 1's half of the batch: extra used on
#: replica 0 only, on none, on both, on replica 1 only
SIGNS = ((1, -1), (-1, -1), (1, 1), (-1, 1))


def _gated_data() -> tuple[torch.Tensor, torch.Tensor]:
    g, h = torch.Generator().manual_seed(2), GLOBAL_BATCH // 2
    x, y = (
        torch.randn(len(SIGNS), GLOBAL_BATCH, 4, generator=g),
        torch.randn(len(SIGNS), GLOBAL_BATCH, 2, generator=g),
    )
    for s, signs in enumerate(SIGNS):
        for d, sign in enumerate(signs):
            x[s, d * h : (d + 1) * h, 0] = x[s, d * h : (d + 1) * h, 0].abs() * sign
    return x, y


def _gated_reference(steps: list[int]) -> dict[str, torch.Tensor]:
    """One process on the global batch, micro-batch by micro-batch (the gate decides per micro-batch),
    the mean of their losses; AdamW with weight decay (a zero gradient stepped would move ``extra``)."""
    (x, y), q = _gated_data(), GLOBAL_BATCH // 4
    module = _gated()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    for s in steps:
        losses = [F.mse_loss(module(x[s, k * q : (k + 1) * q]), y[s, k * q : (k + 1) * q]) for k in range(4)]
        (sum(losses) / 4).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


#: (data-parallel strategy, schedule, options) of the pipelines at pp=2 x dp=2 below
REPLICATED = (
    ("ddp", "1f1b", {}),
    ("zero1", "zero_bubble", {}),
    ("zero3", "gpipe", {"persistence_threshold": 0}),
    ("fsdp", "1f1b", {}),
)


def replicas_world(backend: CommunicationBackend) -> dict[str, Any]:
    """pp=2 x dp=2, ``extra`` on pipeline rank 0. With find_unused_parameters: every step of SIGNS.
    Without: step 0 (extra used on replica 0 only), ``opt.step()``, ``opt.zero_grad()``, step 2."""
    torch.set_num_threads(1)
    (x, y), mesh = _gated_data(), Mesh(backend, {"pp": 2, "dp": 2})
    h, d = GLOBAL_BATCH // 2, mesh.coordinate("dp")
    out: dict[str, Any] = {}
    for flag in (True, False):
        for dp, schedule, kw in REPLICATED:
            model = HybridShardedModel(
                _gated(), mesh, dp, micro_batches=2, schedule=schedule, find_unused_parameters=flag, **kw
            )
            opt = STRATEGY_OPTIMIZERS.get(dp, ZeRO3Optimizer)(
                model, torch.optim.AdamW, lr=0.01, weight_decay=0.1
            )
            got = []
            for s in range(len(SIGNS)) if flag else (0, 2):
                batch = (x[s, d * h : (d + 1) * h], y[s, d * h : (d + 1) * h])
                for call in (partial(model.train_step, batch, F.mse_loss), opt.step):
                    try:
                        call()
                        got.append("ran")
                    except StrategyError as exc:
                        got.append(str(exc))
                opt.zero_grad()
            out[f"{dp}/{flag}"] = (got, model.full_state_dict())
    return out


def test_a_pipeline_whose_replicas_disagree_on_an_unused_parameter_refuses_on_every_rank() -> None:
    """pp=2 x dp=2, a parameter reached only by some replicas' batches. Without find_unused_parameters
    the replica that had not used it refused alone while the other waited in the dp reduction until the
    backend's timeout; now every rank of every replica refuses, naming (dp rank, pipeline rank), then
    goes on. With it, one process on the global batch, exact (a replica that did not use it adds zeros
    to the average; a step no replica used it leaves it out)."""
    every, after = _gated_reference(list(range(len(SIGNS)))), _gated_reference([2])
    for rank, res in enumerate(run_world(4, replicas_world, timeout=30)):
        pp_rank = rank // 2  # the mesh's pp axis is outermost
        for dp, _, _ in REPLICATED:
            got, state = res[f"{dp}/True"]
            assert got == ["ran"] * 2 * len(SIGNS), f"{dp} rank {rank}: {got}"
            assert max_rel_error(state, every) <= 1e-6, f"{dp} rank {rank}"
            got, state = res[f"{dp}/False"]
            step, after_step = got[:2]
            assert "find_unused_parameters=True" in step and "(dp rank, pipeline rank) [(1, 0)]" in step, (
                f"{dp} rank {rank}: {step}"
            )
            assert ("'0.extra.weight'" in step) == (rank == 1), f"{dp} rank {rank}: {step}"
            assert "found no synchronized gradients" in after_step, f"{dp} rank {rank}: {after_step}"
            assert got[2:] == ["ran", "ran"] and max_rel_error(state, after) <= 1e-6, f"{dp} {rank}: {got}"
            assert f"on pipeline rank {pp_rank} of dp rank {rank % 2}" in step, step
