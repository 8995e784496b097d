"""Buffers broadcast before each forward (``broadcast_buffers=True``, torch DDP's default) travel in one
message per dtype, not one per buffer, and every rank ends with rank 0's values; importing the model
and optimizer strategies does not load ``torch.compile`` (seconds of import time, and it switches the
strategies' hooks to their compile-safe form)."""

from __future__ import annotations

import subprocess
import sys

import torch
from filled import filled
from torch import nn

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


def test_importing_the_strategies_does_not_load_torch_compile() -> None:
    code = "import sys, dtlab.models, dtlab.optimizers; print('torch._dynamo' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
