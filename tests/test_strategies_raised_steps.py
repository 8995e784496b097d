"""A training step that raises on every rank and is caught (a bad batch skipped): the next steps equal
plain training over the same batches minus the bad one, for every data-parallel strategy and optimizer,
with the exception raised partway through backward (a custom autograd Function, a tensor hook),
partway through the forward, or in the loss function. After a backward raised partway the gradients
are partial: forward, backward and step are refused until ``opt.zero_grad()``, as the error says.
ZeRO-3/FSDP free the units the raised step gathered (counted in bytes, exactly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from steps import plain_steps
from test_strategies_helpers import (
    OPTIMIZERS,
    STRATEGIES,
    make_data,
    make_module,
    max_rel_error,
    optimizer_for,
    wrap,
)
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.testing import run_world

STEPS, BAD, BATCH = 4, 1, 4
CASES = ("backward_function", "backward_hook", "forward", "loss")
# one bucket per layer but the Block's bias alone (the last layer's 132 bytes fill the first bucket):
# when backward raises inside the Block, bucket 0 is launched and the other four are not
SMALL_BUCKETS = 140 / 2**20


class BadBatch(Exception):
    """The user's own exception for a batch to skip."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise BadBatch("a NaN check in backward")


@dataclass
class Trap:
    """Where the current step raises (None: nowhere); one per rank, installed on the Block."""

    case: str | None = None

    def after_block(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self.case == "forward":
            raise BadBatch("a NaN check in the forward")
        if self.case == "backward_function":
            return _RaiseInBackward.apply(out)
        if self.case == "backward_hook":

            def hook(grad: torch.Tensor) -> None:
                raise BadBatch("a NaN check in a tensor hook")

            out.register_hook(hook)
        return None

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, y)
        if self.case == "loss":
            raise BadBatch("a NaN loss")
        return loss


def _options(name: str) -> dict[str, Any]:
    return {"bucket_cap_mb": SMALL_BUCKETS} if name in ("ddp", "zero1", "zero2") else {}


def _at_rest_bytes(model: Any) -> int:
    """What ZeRO-3/FSDP hold of the parameters between steps: this rank's shard of each unit."""
    return sum(u.shard_numel * u.params[0].element_size() for u in model.shard_units())


def _skip_one(backend: CommunicationBackend, name: str, opt_name: str, case: str) -> dict[str, Any]:
    x, y = make_data(STEPS, BATCH)
    local = BATCH // backend.world_size
    mine = slice(backend.rank * local, (backend.rank + 1) * local)
    module = make_module()
    trap = Trap()
    module[1].register_forward_hook(trap.after_block)  # before wrapping: runs before the strategy's
    model = wrap(name, module, backend, **_options(name))
    opt = optimizer_for(name, model, opt_name)
    out: dict[str, Any] = {"refusals": []}
    for step in range(STEPS):
        trap.case = case if step == BAD else None
        try:
            trap.loss(model(x[step, mine]), y[step, mine]).backward()
        except BadBatch:
            trap.case = None
            out["parameters_after_raise"] = model.memory_report()["parameters"]
            if case.startswith("backward"):  # partial gradients: refused until zero_grad()
                with torch.no_grad():
                    model(x[0, mine])  # an evaluation forward is not refused (it reads no gradient)
                for what, call in (("forward", lambda: model(x[0, mine])), ("step", opt.step)):
                    try:
                        call()
                    except StrategyError as exc:
                        out["refusals"].append((what, str(exc)))
                opt.zero_grad()
            out["parameters_recovered"] = model.memory_report()["parameters"]
            continue
        opt.step()
        opt.zero_grad()
        if step == 0:
            out["parameters_at_rest"] = model.memory_report()["parameters"]
    out["expected_at_rest"] = _at_rest_bytes(model)
    out["state"] = model.full_state_dict()
    return out


def _reference(opt_name: str) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, BATCH)
    module = make_module()
    ocls, kw = OPTIMIZERS[opt_name]
    kept = [s for s in range(STEPS) if s != BAD]
    plain_steps(
        module, ocls(module.parameters(), **kw), zip(x[kept], y[kept], strict=True), nn.functional.mse_loss
    )
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_caught_exception_skips_the_batch_like_plain_training(name: str, case: str) -> None:
    for opt_name in ("sgd", "adamw"):
        ref = _reference(opt_name)
        for rank, res in enumerate(run_world(2, _skip_one, name, opt_name, case, timeout=30)):
            err = max_rel_error(res["state"], ref)
            assert err <= 1e-5, f"{name} {opt_name} {case} rank {rank}: off by {err:.3g}"
            if case.startswith("backward"):
                assert [w for w, _ in res["refusals"]] == ["forward", "step"], res["refusals"]
                for _, msg in res["refusals"]:
                    assert "raised partway" in msg and "opt.zero_grad()" in msg, msg
            else:
                assert res["refusals"] == []
            if name in ("zero3", "fsdp"):  # the units the raised step gathered are freed, exactly
                rest = res["expected_at_rest"]
                assert res["parameters_at_rest"] == rest
                if case != "backward_function" and case != "backward_hook":
                    assert res["parameters_after_raise"] == rest, (case, res["parameters_after_raise"], rest)
                assert res["parameters_recovered"] == rest, (case, res["parameters_recovered"], rest)
