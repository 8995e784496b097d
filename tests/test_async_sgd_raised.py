"""AsyncSGDOptimizer when a worker's training step raises and is caught (a bad batch skipped) on every
worker at the same point: in the forward or the loss nothing is pushed and the next steps equal
synchronous SGD over the global batches minus the bad one (staleness 0); partway through backward the
replica's gradients are partial, so the next forward with gradients and ``step()`` are refused until
``opt.zero_grad()``, and then training is again SGD minus that batch."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from raised_cases import BAD, CASES, STEPS, BadBatch, Trap
from test_async_sgd import batches, make_net, rel_err
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.optimizers import AsyncSGDOptimizer
from dtlab.testing import run_world

SERVERS = 1


def _skip_one(b: CommunicationBackend, net0: nn.Module, case: str) -> dict[str, Any]:
    x, y = batches(STEPS)
    net = copy.deepcopy(net0)
    trap = Trap()
    net[1].register_forward_hook(trap.after_block)  # the Tanh between the two layers
    opt = AsyncSGDOptimizer(net, b, torch.optim.SGD, lr=0.1, momentum=0.9, staleness=0, num_servers=SERVERS)
    out: dict[str, Any] = {"refusals": []}
    if opt.is_server:
        opt.serve()
    else:
        w, i = b.world_size - SERVERS, b.rank - SERVERS
        for t in range(STEPS):
            trap.case = case if t == BAD else None
            xs, ys = x[t].chunk(w)[i], y[t].chunk(w)[i]
            try:
                trap.loss(opt.module(xs), ys).backward()
            except (BadBatch, torch.OutOfMemoryError):
                trap.case = None
                if case.startswith("backward"):  # partial gradients: refused until zero_grad()
                    with torch.no_grad():
                        opt.module(xs)  # an evaluation forward reads no gradient: not refused
                    for what, call in (("forward", functools.partial(opt.module, xs)), ("step", opt.step)):
                        try:
                            call()
                        except StrategyError as exc:
                            out["refusals"].append((what, str(exc)))
                    opt.zero_grad()
                continue
            opt.step()
        opt.finish()
    out["state"] = opt.full_state_dict()
    out["clock"] = opt.clock
    return out


def _reference(net0: nn.Module) -> dict[str, torch.Tensor]:
    x, y = batches(STEPS)
    net = copy.deepcopy(net0)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for t in range(STEPS):
        if t == BAD:
            continue
        sgd.zero_grad()
        nn.functional.mse_loss(net(x[t]), y[t]).backward()
        sgd.step()
    return net.state_dict()


@pytest.mark.parametrize("case", CASES)
def test_a_caught_exception_skips_the_batch_like_synchronous_sgd(case: str) -> None:
    net0 = make_net()
    want = _reference(net0)
    res = run_world(SERVERS + 2, _skip_one, net0, case, timeout=30)
    for rank, r in enumerate(res):
        err = rel_err(r["state"], want)
        assert err <= 1e-5, f"{case} rank {rank}: off by {err:.3g}"
        assert r["clock"] == STEPS - 1  # the bad batch was never pushed: one update fewer
        if case.startswith("backward") and rank >= SERVERS:
            assert [w for w, _ in r["refusals"]] == ["forward", "step"], r["refusals"]
            for _, msg in r["refusals"]:
                assert "raised partway" in msg and "opt.zero_grad()" in msg, msg
        else:
            assert r["refusals"] == []
