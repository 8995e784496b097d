"""Gradients at the right scale: plain SGD (no momentum, no clipping: an update proportional to the
gradient) under every data-parallel strategy, accumulating over several backward passes (inside
``no_sync()``, and synchronized every time without ``zero_grad``) and through the Trainer's
``data.accumulation_steps``, against one process on the whole batch. A gradient off by a constant
factor (a lost ``1 / accumulation_steps``, a late gradient overwriting instead of adding) fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, max_rel_error, wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import load_config
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import run_training

LR, STEPS, BATCH, MICRO = 0.3, 3, 12, 3
MODES = ("no_sync", "sync_each")


def _optimizer(name: str, model: Any) -> Any:
    cls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(name, ZeRO3Optimizer)
    return cls(model, torch.optim.SGD, lr=LR)


def _accumulating(backend: CommunicationBackend) -> dict[str, dict[str, torch.Tensor]]:
    """Every strategy x mode in one world: each step's local batch split into MICRO micro-batches,
    each loss divided by MICRO, one optimizer step per global batch."""
    torch.set_num_threads(1)
    x, y = make_data(STEPS, BATCH)
    p, r = backend.world_size, backend.rank
    local = BATCH // p
    bounds = [r * local + (local * i) // MICRO for i in range(MICRO + 1)]  # uneven when MICRO !| local
    out = {}
    for name in STRATEGIES:
        for mode in MODES:
            model = wrap(name, make_module(), backend)
            opt = _optimizer(name, model)
            for s in range(STEPS):
                for i in range(MICRO):
                    lo, hi = bounds[i], bounds[i + 1]
                    # sum of squared errors / global element count: micro-batches of any size add up
                    # to the whole batch's mean
                    loss = nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi], reduction="sum")
                    loss = loss * (p / y[s].numel())
                    if mode == "no_sync" and i < MICRO - 1:
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                opt.step()
                opt.zero_grad()
            out[f"{name}/{mode}"] = model.full_state_dict()
    return out


def _reference() -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for s in range(STEPS):
        nn.functional.mse_loss(module(x[s]), y[s]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_strategy_accumulates_at_the_right_scale(world_size: int) -> None:
    """2 ranks (6 samples each, micro-batches of 2) and 3 ranks (4 each, micro-batches of 1, 1, 2)."""
    ref = _reference()
    moved = max_rel_error(make_module().state_dict(), ref)
    assert moved > 0.05  # the steps move the parameters far more than the tolerance
    for rank, runs in enumerate(run_world(world_size, _accumulating, timeout=60)):
        assert sorted(runs) == sorted(f"{s}/{m}" for s in STRATEGIES for m in MODES)
        for run, state in runs.items():
            err = max_rel_error(state, ref)
            assert err <= 1e-5, f"{run} on {world_size} ranks, rank {rank}: relative error {err:.2e}"


# ------------------------------------------------------------------------------------ the Trainer
PLAIN_SGD = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=2",
    "data.shuffle=false",
    "optimizer.name=sgd",
    "optimizer.lr=0.5",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
    "optimizer.clip_grad_norm=null",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "train.steps=3",
    "train.eval_every=0",
    "strategy.persistence_threshold=0",
    "logging.progress=false",
    "logging.run_dir=null",
]


def _losses(*overrides: str) -> list[float]:
    results = run_training(load_config(overrides=[*PLAIN_SGD, *overrides]))
    losses = [v for _, v in results[0].losses]
    for r in results[1:]:
        assert [v for _, v in r.losses] == losses
    return losses


def test_trainer_accumulation_keeps_the_gradient_scale() -> None:
    """One process on the whole batch against 2 ranks x 2 accumulation steps under each strategy, a
    tensor-parallel mesh with 2 accumulation steps, a pipeline with 4 micro-batches, and the dense
    compressed reducer: the same losses at every step (the steps change the loss far more)."""
    ref = _losses("backend.world_size=1")
    assert abs(ref[-1] - ref[0]) > 1e-2 * abs(ref[0])
    runs = {
        **{s: ("backend.world_size=2", f"strategy.model={s}") for s in STRATEGIES},
        "tp2": ("backend.world_size=2", "parallel.tp=2"),
        "dense compression": (
            "backend.world_size=2",
            "compression.algorithm=dense",
            "compression.dense_warmup_steps=0",
        ),
    }
    for name, overrides in runs.items():
        losses = _losses(*overrides, "data.accumulation_steps=2")
        assert losses == pytest.approx(ref, rel=1e-5), name
    pipeline = _losses("backend.world_size=2", "parallel.pp=2", "parallel.micro_batches=4")
    assert pipeline == pytest.approx(ref, rel=1e-5), "pp2"
