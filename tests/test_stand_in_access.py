"""Reading or writing ZeRO-3/FSDP parameters outside the forward (docs/porting.md, "Reading or writing
ZeRO-3/FSDP parameters outside the forward"), on 2 in-memory ranks against one process on the global
batch (3 SGD steps): the documented ways equal one process (an L2 penalty as the optimizer's
``weight_decay`` or inside ``summon_full_params()``; a manual weight decay and WGAN's weight clipping
inside ``summon_full_params()``), and an in-place write into a stand-in stops with the torch error the
guide quotes."""

from __future__ import annotations

from typing import Any

import torch
from test_strategies_helpers import make_data, make_module, max_rel_error, wrap
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.core.torch_private import global_optimizer_step_pre_hooks
from dtlab.errors import StrategyError
from dtlab.models.dp._grad_guard import refuse_plain_step
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH, WD = 3, 8, 0.02


def _after_step(params: list[torch.nn.Parameter], habit: str) -> None:
    with torch.no_grad():
        for p in params:
            if habit == "decay":  # a manual weight decay
                p.mul_(0.99)
            elif habit == "clip":  # WGAN's weight clipping
                p.clamp_(-0.3, 0.3)


def reference(habit: str) -> dict[str, torch.Tensor]:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    module = make_module()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for s in range(STEPS):
        loss = F.mse_loss(module(xs[s]), ys[s])
        if habit == "penalty":
            loss = loss + WD / 2 * sum((p**2).sum() for p in module.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
        _after_step(list(module.parameters()), habit)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _train(backend: CommunicationBackend, name: str, habit: str) -> dict[str, torch.Tensor]:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    half = slice(backend.rank * GLOBAL_BATCH // 2, (backend.rank + 1) * GLOBAL_BATCH // 2)
    model = wrap(name, make_module(), backend)
    opt = ZeRO3Optimizer(model, torch.optim.SGD, lr=0.1, weight_decay=WD if habit == "weight_decay" else 0.0)
    for s in range(STEPS):
        x, y = xs[s][half], ys[s][half]
        if habit == "penalty":  # forward, penalty and backward with the whole model gathered
            with model.summon_full_params():
                loss = F.mse_loss(model(x), y) + WD / 2 * sum((p**2).sum() for p in model.parameters())
                loss.backward()
        else:
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with model.summon_full_params():
            _after_step(list(model.module.parameters()), habit)
    return model.full_state_dict()


def _raw_write(backend: CommunicationBackend, name: str) -> str:
    model = wrap(name, make_module(), backend)
    try:
        torch.nn.init.normal_(model.module[0].weight, generator=torch.Generator().manual_seed(0))
    except RuntimeError as exc:
        return str(exc)
    return "wrote"


def _plain_adamw(backend: CommunicationBackend, name: str) -> str:
    """A plain torch AdamW over the sharded model: its decoupled weight decay writes into the parameter
    before it reads the gradient stand-in; refused before it writes, naming the optimizer strategy."""
    model = wrap(name, make_module(), backend)
    xs, ys = make_data(1, GLOBAL_BATCH)
    F.mse_loss(model(xs[0]), ys[0]).backward()
    try:
        torch.optim.AdamW(model.parameters(), lr=0.1).step()
    except StrategyError as exc:
        return str(exc)
    return "stepped"


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in ("zero3", "fsdp"):
        for habit in ("weight_decay", "penalty", "decay", "clip"):
            out[f"{habit}/{name}"] = _train(backend, name, habit)
        out[f"raw/{name}"] = _raw_write(backend, name)
        out[f"adamw/{name}"] = _plain_adamw(backend, name)
    return out


def test_documented_ways_to_touch_sharded_parameters_equal_one_process() -> None:
    refs = {h: reference(h) for h in ("penalty", "decay", "clip")}
    refs["weight_decay"] = refs["penalty"]  # SGD's weight_decay is the L2 penalty's gradient
    for rank, res in enumerate(run_world(2, world, timeout=60)):
        for name in ("zero3", "fsdp"):
            for habit, ref in refs.items():
                assert max_rel_error(res[f"{habit}/{name}"], ref) <= 1e-5, f"{habit}/{name} rank {rank}"
            said = res[f"raw/{name}"]
            assert "more than one element of the written-to tensor" in said, said
            said = res[f"adamw/{name}"]
            assert (
                "AdamW.step(): parameter 0 of param group 0 (shape (10, 6)) is sharded" in said
                and "opt = ZeRO3Optimizer(model" in said
            ), said


def _step_hook(backend: CommunicationBackend) -> dict[str, Any]:
    class Lion(torch.optim.SGD):  # a user's own optimizer class
        pass

    for _ in range(2):  # a second model registers nothing more
        model = wrap("zero3", make_module(), backend)
    hooks = [h for h in global_optimizer_step_pre_hooks() if h is refuse_plain_step]
    try:
        Lion(model.parameters(), lr=0.1).step()
        said = ""
    except StrategyError as e:
        said = str(e)
    return {"hooks": len(hooks), "said": said}


def test_the_plain_step_check_is_registered_once_and_names_a_users_class_as_it_is() -> None:
    for res in run_world(2, _step_hook, timeout=60):
        assert res["hooks"] == 1
        assert "opt = ZeRO3Optimizer(model, Lion(model.parameters(), ...))" in res["said"], res["said"]
