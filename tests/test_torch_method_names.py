"""torch DDP's and FSDP2's methods called on dtlab's wrappers. FSDP2's gradient accumulation switch
``model.set_requires_gradient_sync(False)`` stopped with a bare AttributeError; it now accumulates
locally as ``no_sync()`` does, equal to one process on the global batch under every strategy. The other
methods a ported script calls (``unshard``, ``register_comm_hook``, ...) are refused naming what dtlab
does instead. On a composition, ``model.require_backward_grad_sync = False`` (torch DDP's switch) was
set on the wrapper and ignored (every backward still reduced); it now reaches the data-parallel
strategy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, optimizer_for, wrap
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel
from dtlab.testing import run_world

STEPS, BATCH = 3, 8


def _steps(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, switch: bool) -> None:
    """Two micro-batches per step, the first with the gradient sync off (FSDP2's switch)."""
    for s in range(STEPS):
        half = len(x[s]) // 2
        if switch:
            model.set_requires_gradient_sync(False)
        (nn.functional.mse_loss(model(x[s][:half]), y[s][:half]) / 2).backward()
        if switch:
            model.set_requires_gradient_sync(True)
        (nn.functional.mse_loss(model(x[s][half:]), y[s][half:]) / 2).backward()
        opt.step()
        opt.zero_grad()


def _world(backend: CommunicationBackend) -> dict[str, Any]:
    x, y = make_data(STEPS, BATCH)
    mine = slice(backend.rank * BATCH // 2, (backend.rank + 1) * BATCH // 2)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        sent = []
        for switch in (True, False):  # without the switch each micro-batch's backward reduces
            model = wrap(name, make_module(), backend)
            before = backend.stats.bytes_sent
            _steps(model, optimizer_for(name, model, "sgd_plain"), x[:, mine], y[:, mine], switch)
            sent.append(backend.stats.bytes_sent - before)
            if switch:
                state = model.full_state_dict()
        out[name] = (state, sent)
    for attr in ("unshard", "register_comm_hook", "no_such_method"):
        with pytest.raises(AttributeError) as err:
            getattr(model, attr)
        out[attr] = str(err.value)
    return out


def test_fsdp2_gradient_sync_switch_accumulates_as_one_process() -> None:
    x, y = make_data(STEPS, BATCH)
    plain = make_module()
    opt = torch.optim.SGD(plain.parameters(), lr=0.2)
    _steps(plain, opt, x, y, False)
    got = run_world(2, _world, timeout=120)[0]
    for name in STRATEGIES:
        state, (switched, every) = got[name]
        assert switched < every, f"{name}: {switched} bytes sent with the switch, {every} without"
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"{name} {k}")
    assert "has no 'unshard' (a method of torch's DDP or FSDP2)" in got["unshard"]
    assert "summon_full_params" in got["unshard"]
    assert "GradientCompressionOptimizer" in got["register_comm_hook"]
    assert got["no_such_method"] == "'FSDPModel' object has no attribute 'no_such_method'"


def _composition(backend: CommunicationBackend) -> tuple[bool, bool, bool]:
    model = HybridShardedModel(make_module(), Mesh(backend, {"dp": 2, "pp": 2}), "ddp", micro_batches=2)
    model.require_backward_grad_sync = False  # torch DDP's switch, on the composition
    off = model.dp_strategy.require_backward_grad_sync
    model.set_requires_gradient_sync(True)
    return off, model.dp_strategy.require_backward_grad_sync, model.require_backward_grad_sync


def test_a_compositions_switch_reaches_its_data_parallel_strategy() -> None:
    assert run_world(4, _composition, timeout=60) == [(False, True, True)] * 4
