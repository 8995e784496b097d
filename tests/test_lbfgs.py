"""torch.optim.LBFGS under the data-parallel strategies, on 2 in-memory ranks: every optimizer strategy
stopped with torch's raw ``TypeError: LBFGS.step() missing 1 required positional argument: 'closure'`` at
the first step; now refused when built (class or instance form), naming the fix. The fix it names, a
plain torch LBFGS on a DDPModel's parameters with the user's closure, runs as one process on the global
batch does."""

from __future__ import annotations

from typing import Any

import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, max_rel_error, wrap
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def lbfgs_steps(model: Any, opt: torch.optim.Optimizer, part: slice) -> dict[str, torch.Tensor]:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):

        def closure(s: int = s) -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(xs[s][part]), ys[s][part])
            loss.backward()
            return loss

        opt.step(closure)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for form in ("class", "instance"):
            model = wrap(name, make_module(), backend)
            cls = OPT.get(name, ZeRO3Optimizer)
            try:
                if form == "class":
                    cls(model, torch.optim.LBFGS, lr=0.5, max_iter=3)
                else:
                    cls(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3))
                out[f"{name}/{form}"] = "built"
            except StrategyError as exc:
                out[f"{name}/{form}"] = str(exc)
    model = wrap("ddp", make_module(), backend)
    half = GLOBAL_BATCH // 2
    part = slice(backend.rank * half, (backend.rank + 1) * half)
    out["plain_on_ddp"] = lbfgs_steps(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3), part)
    return out


def test_lbfgs_is_refused_by_the_optimizer_strategies_and_runs_plain_on_ddp() -> None:
    module = make_module()
    ref = lbfgs_steps(module, torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=3), slice(None))
    for res in run_world(2, world, timeout=60):
        for name in STRATEGIES:
            for form in ("class", "instance"):
                got = res[f"{name}/{form}"]
                assert "LBFGS evaluates its closure several times" in got, (name, form, got)
                assert "torch.optim.LBFGS(model.parameters(), ...)" in got, got
        assert max_rel_error(res["plain_on_ddp"], ref) <= 1e-5
