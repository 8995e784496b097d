"""Buffers broadcast before each forward with gradients (``broadcast_buffers=True``, torch DDP's
default) travel in one message per dtype, not one per buffer, and every rank ends with rank 0's values;
a forward under no_grad broadcasts nothing, as torch's DDP, so rank 0 may evaluate a BatchNorm model
alone under DDP, ZeRO-1 and ZeRO-2 (its broadcast met the other rank's gradient reduction: a
collective mismatch, a hang or mixed messages on a real engine); importing the model and optimizer
strategies does not load ``torch.compile`` (seconds of import time, and it switches the strategies'
hooks to their compile-safe form)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch
from filled import filled
from test_strategies_helpers import optimizer_for, wrap
from torch import nn
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.models import DDPModel, ZeRO2Model, ZeRO3Model
from dtlab.testing import run_world

LAYERS = 4


def _net() -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(LAYERS):
        blocks += [nn.Linear(6, 6), nn.BatchNorm1d(6)]
    return filled(nn.Sequential(*blocks), 0, scale=0.3)


def _broadcasts(backend: CommunicationBackend) -> dict[str, tuple[int, bool]]:
    out = {}
    for cls in (DDPModel, ZeRO2Model, ZeRO3Model):
        model = cls(_net(), backend, **({"persistence_threshold": 0} if cls is ZeRO3Model else {}))
        with torch.no_grad():  # rank 1's running statistics drift from rank 0's
            for b in model.module.buffers():
                b.add_(backend.rank)
        before = backend.stats["broadcast"].calls
        model(torch.ones(3, 6) * (backend.rank + 1))
        calls = backend.stats["broadcast"].calls - before
        # after the forward: rank 0's statistics, updated by this rank's batch (torch DDP's semantics)
        ref = _net()
        ref.train()
        ref(torch.ones(3, 6) * (backend.rank + 1))
        same = all(torch.equal(a, b) for a, b in zip(model.module.buffers(), ref.buffers(), strict=True))
        out[cls.__name__] = (calls, same)
    return out


def test_buffers_travel_in_one_message_per_dtype_with_rank0s_values() -> None:
    for res in run_world(2, _broadcasts, timeout=60):
        # 3 * LAYERS buffers: running_mean and running_var (float32), num_batches_tracked (int64)
        assert res == {name: (2, True) for name in ("DDPModel", "ZeRO2Model", "ZeRO3Model")}


def _one_rank_eval(backend: CommunicationBackend) -> dict[str, tuple[Any, ...]]:
    """3 SGD steps with rank 0 evaluating alone after each (or no evaluation): the same training, and no
    collective in the evaluation."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(3, 8, 6, generator=g), torch.randn(3, 8, 6, generator=g)
    r = backend.rank
    out = {}
    for name in ("ddp", "zero1", "zero2"):
        states = []
        for evaluate in (True, False):
            model = wrap(name, _net(), backend)
            opt = optimizer_for(name, model, "sgd")
            calls = 0
            for s in range(3):
                F.mse_loss(model(xs[s, r * 4 : (r + 1) * 4]), ys[s, r * 4 : (r + 1) * 4]).backward()
                opt.step()
                opt.zero_grad()
                if evaluate and r == 0:
                    before = backend.stats.calls
                    model.eval()
                    with torch.no_grad():
                        model(xs[0])
                    model.train()
                    calls += backend.stats.calls - before
            states.append(model.full_state_dict())
        same = all(torch.equal(states[0][k], states[1][k]) for k in states[1])
        out[name] = (same, calls)
    return out


def test_one_rank_evaluates_a_batchnorm_model_alone() -> None:
    for res in run_world(2, _one_rank_eval, timeout=60):
        assert res == {name: (True, 0) for name in ("ddp", "zero1", "zero2")}, res


def test_importing_the_strategies_does_not_load_torch_compile() -> None:
    code = "import sys, dtlab.models, dtlab.optimizers; print('torch._dynamo' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
