"""More torch habits under DDP, ZeRO-1/2/3 and FSDP on 2 in-memory ranks: each equals one process on
the global batch, or stops with an error naming the fix. Habits: a gradient penalty
(``torch.autograd.grad(..., create_graph=True)`` then ``backward()``), two backward passes over one
forward (``retain_graph=True``), the module called twice per step (through the wrapper, or inside its
own forward), ``zero_grad(set_to_none=False)``, an evaluation forward between steps, training in
``eval()`` mode, param groups with their own lr and weight decay, ``opt.add_param_group`` (refused
under ZeRO/FSDP after a step: tests/test_outside_grads.py) and ``model.load_state_dict`` mid-run,
``backward(create_graph=True)``, a write into ``model.state_dict()``'s tensors (the forums'
``load_my_state_dict``) and ``state_dict(keep_vars=True)``."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from filled import filled
from live_bytes import LiveBytes
from test_strategies_helpers import (
    HIDDEN,
    IN,
    OUT,
    STRATEGIES,
    Block,
    make_data,
    make_module,
    max_rel_error,
    wrap,
)
from torch import nn
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
HALVES = [slice(0, GLOBAL_BATCH // 2), slice(GLOBAL_BATCH // 2, GLOBAL_BATCH)]
Model = Any
Params = Callable[[], list[torch.Tensor]]


class Twice(nn.Module):
    """One block applied twice in its own forward (its parameters are used twice per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = Block(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(self.blk(x))


def module_for(habit: str) -> nn.Module:
    if habit == "twice_inside":
        return filled(nn.Sequential(nn.Linear(IN, HIDDEN), Twice(), nn.Linear(HIDDEN, OUT)), 0, scale=0.4)
    return make_module()


def optimizer(habit: str, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    if habit == "add_group":  # the biases join after the first step
        return torch.optim.SGD([p for n, p in named if n.endswith("weight")], lr=0.1, momentum=0.9)
    if habit != "groups":
        return torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")], "lr": 0.02, "weight_decay": 0.3},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.005, "weight_decay": 0.0},
        ],
        lr=0.01,
    )


def penalized(model: Model, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, params(), create_graph=True)
    return loss + 0.1 * sum((g**2).sum() for g in grads)


def one_step(
    habit: str, model: Model, params: Params, x: torch.Tensor, y: torch.Tensor, parts: list[slice]
) -> None:
    """One step's backward over ``parts`` of the batch (one per rank; the reference sums the ranks')."""
    n = len(parts)
    if habit == "penalty":  # each rank's penalty is on its own gradient, as under torch DDP
        (sum(penalized(model, params, x[p], y[p]) for p in parts) / n).backward()
    elif habit == "input_penalty":  # WGAN-GP's: the output's gradient in the input, kept in the graph
        total = torch.zeros(())
        for p in parts:
            xp = x[p].clone().requires_grad_(True)
            out = model(xp)
            (gx,) = torch.autograd.grad(out.sum(), xp, create_graph=True)
            total = total + F.mse_loss(out, y[p]) + 0.5 * ((gx.norm(dim=1) - 1) ** 2).mean()
        (total / n).backward()
    elif habit == "input_grad":  # an adversarial step: the input's gradient, then the model's
        advs = []
        for p in parts:
            xp = x[p].clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(F.mse_loss(model(xp), y[p]), xp)
            advs.append((xp + 0.1 * gx.sign()).detach())
        (sum(F.mse_loss(model(a), y[p]) for a, p in zip(advs, parts, strict=True)) / n).backward()
    elif habit == "create_graph":  # torch warns of a reference cycle; the step is what counts here
        (sum(F.mse_loss(model(x[p]), y[p]) for p in parts) / n).backward(create_graph=True)
    elif (
        habit == "target_no_grad"
    ):  # a target from the same model under no_grad, between forward and backward
        for p in parts:
            out = model(x[p])
            with torch.no_grad():
                target = model(x[p] * 0.5)
            (F.mse_loss(out, target + y[p]) / n).backward()
    elif habit == "siamese":
        for p in parts:
            (F.mse_loss(model(x[p]) * model(x[p] * 0.5), y[p]) / n).backward()
    elif habit == "retain":
        loss = sum(F.mse_loss(model(x[p]), y[p]) for p in parts) / n
        loss.backward(retain_graph=True)
        loss.backward()
    else:
        if habit == "eval_between":
            model.eval()
            with torch.no_grad():
                model(x[parts[0]])
            model.train()
        if habit == "train_false":
            model.train(False)
        (sum(F.mse_loss(model(x[p]), y[p]) for p in parts) / n).backward()


def train(habit: str, model: Model, opt: torch.optim.Optimizer, params: Params, parts: list[slice]) -> None:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        one_step(habit, model, params, xs[s], ys[s], parts)
        opt.step()
        opt.zero_grad(set_to_none=habit != "set_to_none_false")
        if habit == "load_mid" and s == 0:
            model.load_state_dict(make_module(7).state_dict())
        if habit == "inner_load" and s == 0:  # the wrapped module's own load_state_dict
            getattr(model, "module", model).load_state_dict(make_module(7).state_dict())
        if habit == "own_state" and s == 0:  # load_my_state_dict: a copy_ into each of state_dict()'s tensors
            own = model.state_dict()
            for k, v in make_module(7).state_dict().items():
                own[k].copy_(v)
        if habit == "add_group" and s == 0:
            named = list(getattr(model, "module", model).named_parameters())
            opt.add_param_group({"params": [p for n, p in named if n.endswith("bias")], "lr": 0.03})


def reference(habit: str) -> dict[str, torch.Tensor]:
    module = module_for(habit)
    opt = optimizer(habit, list(module.named_parameters()))
    train(
        habit,
        module,
        opt,
        lambda: list(module.parameters()),
        HALVES if habit in ("penalty", "input_penalty") else [slice(None)],
    )
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def case(
    backend: CommunicationBackend, habits: list[str], names: tuple[str, ...] = STRATEGIES
) -> dict[str, dict[str, Any]]:
    """Every habit under every strategy on this rank: the full state, or the error it stopped with."""
    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    for habit in habits:
        for name in names:
            model = wrap(name, module_for(habit), backend)
            ocls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(
                name, ZeRO3Optimizer
            )
            opt = ocls(model, optimizer(habit, list(model.module.named_parameters())))
            try:
                train(habit, model, opt, lambda m=model: list(m.parameters()), [HALVES[backend.rank]])
                out.setdefault(habit, {})[name] = model.full_state_dict()
            except StrategyError as e:
                out.setdefault(habit, {})[name] = str(e)
    return out


def check(
    results: list[dict[str, dict[str, Any]]],
    habit: str,
    refused: dict[str, str],
    names: tuple[str, ...] = STRATEGIES,
) -> None:
    ref = reference(habit)
    for rank, res in enumerate(results):
        for name in names:
            got, where = res[habit][name], f"{habit}/{name} rank {rank}"
            if name in refused:
                assert isinstance(got, str) and refused[name] in got, f"{where}: {got}"
            else:
                assert not isinstance(got, str), f"{where}: {got}"
                assert max_rel_error(got, ref) <= 1e-5, where


def test_gradient_penalty_and_two_backwards_per_forward() -> None:
    """autograd.grad fills no .grad: DDP/ZeRO-1/2 skip it and synchronize the backward after it (they
    refused it as 'no gradient' before). ZeRO-3/FSDP refuse it for parameters or with create_graph, and
    skip an input gradient without create_graph as the others do (refused as 'no gradient' before).
    retain_graph: DDP adds both passes as torch does; the others refuse naming the fix."""
    results = run_world(
        2, case, ["penalty", "input_grad", "input_penalty", "retain", "inner_load"], timeout=60
    )
    check(results, "penalty", {"zero3": "torch.autograd.grad() asked", "fsdp": "torch.autograd.grad() asked"})
    inputs = "torch.autograd.grad(loss, inputs)"
    check(results, "input_grad", {})  # an input gradient without create_graph: equal everywhere
    check(results, "input_penalty", {"zero3": inputs, "fsdp": inputs})
    again = "retain_graph=True"
    check(results, "retain", {"zero1": again, "zero2": again, "zero3": again, "fsdp": again})
    wrapper = "through the wrapper, model.load_state_dict(state)"
    check(results, "inner_load", {"zero3": wrapper, "fsdp": wrapper})


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_ordinary_habits_equal_one_process() -> None:
    habits = [
        "siamese",
        "target_no_grad",
        "twice_inside",
        "set_to_none_false",
        "eval_between",
        "train_false",
        "groups",
        "add_group",
        "load_mid",
        "create_graph",
    ]
    results = run_world(2, case, habits, timeout=60)
    for habit in habits:
        if habit != "add_group":
            check(results, habit, {})
    # the biases' gradient of step 0 is kept outside the groups (torch's zero_grad() clears only its
    # groups'): DDP keeps it as torch; where gradients are shards it is dropped and the add refused
    added = "add_param_group(): parameters ['0.bias'"
    check(results, "add_group", {"zero1": added, "zero2": added, "zero3": added, "fsdp": added})


def trainable_keys(backend: CommunicationBackend) -> dict[str, Any]:
    """``[k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad]`` (saving only the
    trainable weights), the first layer frozen before wrapping."""
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        module = make_module()
        module[0].requires_grad_(False)
        model = wrap(name, module, backend)
        try:
            out[name] = sorted(k for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad)
        except StrategyError as e:
            out[name] = str(e)
    return out


def test_state_dict_tensors_are_the_model_s_where_parameters_are_whole() -> None:
    """Before: the wrapper's state_dict() gave copies under every strategy, so a write into them was lost
    (DDP/ZeRO-1/2: 1.5 relative error after 3 steps, silently) and keep_vars=True gave tensors without
    requires_grad (no trainable key). DDP/ZeRO-1/2 now give the module's own state_dict(), as torch;
    ZeRO-3/FSDP (copies: no whole parameter to return) refuse keep_vars=True naming the fix."""
    whole = ("ddp", "zero1", "zero2")
    check(run_world(2, case, ["own_state"], whole, timeout=60), "own_state", {}, whole)
    trainable = ["1.fc.bias", "1.fc.weight", "3.bias", "3.weight"]
    for res in run_world(2, trainable_keys, timeout=60):
        for name in STRATEGIES:
            if name in whole:
                assert res[name] == trainable, (name, res[name])
            else:
                said = res[name]
                assert "state_dict(keep_vars=True)" in said and "named_parameters()" in said, said


def unfreeze_mid_run(backend: CommunicationBackend | None, name: str) -> Any:
    """Layer 0 frozen for 2 AdamW steps, then trained (torch: ``requires_grad_(True)`` and
    ``opt.add_param_group``); wrapped: the refusal, then the recipe it names (the module wrapped again,
    ZeRO-3/FSDP: a fresh one loaded from the old wrapper; the optimizer state carried over)."""
    module = make_module()
    module[0].requires_grad_(False)
    model: Any = module if backend is None else wrap(name, module, backend)
    ocls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(name, ZeRO3Optimizer)
    opt: Any = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.01)
    opt = opt if backend is None else ocls(model, opt)
    part = slice(None) if backend is None else HALVES[backend.rank]
    xs, ys = make_data(4, GLOBAL_BATCH)
    said = ""
    for s in range(4):
        if s == 2:
            module[0].requires_grad_(True)
            if backend is None:
                opt.add_param_group({"params": list(module[0].parameters()), "lr": 0.02})
            else:
                try:  # refused at the backward or the step
                    F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
                    opt.step()
                except StrategyError as exc:
                    said = str(exc)
                module.zero_grad()  # the refused backward's pieces
                sd = opt.state_dict()
                if name in ("zero3", "fsdp"):
                    module = make_module()
                    module.load_state_dict(model.state_dict())
                before = [p for n, p in module.named_parameters() if not n.startswith("0.")]
                model = wrap(name, module, backend)
                opt = ocls(model, torch.optim.AdamW(before, lr=0.01))
                opt.load_state_dict(sd)
                opt.add_param_group({"params": list(module[0].parameters()), "lr": 0.02})
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()
    state = module.state_dict() if backend is None else model.full_state_dict()
    return said, {k: v.detach().clone() for k, v in state.items()}


def test_unfreezing_mid_run_is_refused_naming_the_recipe_that_equals_torch() -> None:
    """The refusal named rebuilding the wrapper only; a new optimizer lost AdamW's moments. It now names
    carrying the state over (opt.state_dict(), load into the new one, add_param_group), which equals
    torch's add_param_group in one process."""
    want = unfreeze_mid_run(None, "")[1]
    for name in ("zero2", "fsdp"):
        for said, got in run_world(2, unfreeze_mid_run, name, timeout=60):
            assert "requires_grad=True now on ['0.weight', '0.bias']" in said, said
            assert "opt.add_param_group({'params': unfrozen})" in said, said
            assert max_rel_error(got, want) <= 1e-5, name


def switch_optimizer(backend: CommunicationBackend | None, name: str) -> Any:
    """2 Adam steps, then 2 SGD steps (torch: a new optimizer on the same parameters); wrapped: the
    second optimizer strategy's refusal, then the recipe it names (wrap again, ZeRO-3/FSDP a fresh module
    loaded with model.state_dict(), and build the new optimizer strategy on the new wrapper)."""
    module = make_module()
    model: Any = module if backend is None else wrap(name, module, backend)
    ocls = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}.get(name, ZeRO3Optimizer)
    opt: Any = torch.optim.Adam(module.parameters(), lr=0.01)
    opt = opt if backend is None else ocls(model, opt)
    part = slice(None) if backend is None else HALVES[backend.rank]
    xs, ys = make_data(4, GLOBAL_BATCH)
    said = ""
    for s in range(4):
        if s == 2 and backend is None:
            opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        elif s == 2:
            try:
                ocls(model, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
            except StrategyError as exc:
                said = str(exc)
            if name in ("zero3", "fsdp"):
                module = make_module()
                module.load_state_dict(model.state_dict())
            model = wrap(name, module, backend)
            opt = ocls(model, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        opt.zero_grad()
    state = module.state_dict() if backend is None else model.full_state_dict()
    return said, {k: v.detach().clone() for k, v in state.items()}


def test_switching_optimizers_mid_run_names_the_recipe_that_equals_torch() -> None:
    """A second optimizer strategy on one model is refused; the refusal said only 'build one optimizer
    strategy per model'. It now names how to switch (Adam to SGD), which equals torch in one process."""
    want = switch_optimizer(None, "")[1]
    for name in ("zero1", "zero3"):
        for said, got in run_world(2, switch_optimizer, name, timeout=60):
            assert "To switch optimizers mid-run" in said and "model.state_dict()" in said, said
            assert max_rel_error(got, want) <= 1e-5, name


def _input_gradients(backend: CommunicationBackend, name: str) -> list[int]:
    """Live bytes after each of four input-gradient passes (an adversarial step's
    ``torch.autograd.grad(loss, x)``, no backward): the units gathered for them are freed at their end."""

    model = wrap(name, make_module(), backend)
    x, y = make_data(1, 4)
    counted, live = LiveBytes(), []
    with counted:
        for _ in range(4):
            xp = x[0].clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(F.mse_loss(model(xp), y[0]), xp)
            del gx, xp
            backend.barrier()  # the in-memory engine lets go of the peer's last gathered buffers
            gc.collect()  # what a reference cycle keeps until the collector runs is not the point here
            live.append(counted.now)
    return live


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_an_input_gradient_pass_frees_what_it_gathered(name: str) -> None:
    for live in run_world(2, _input_gradients, name, timeout=60):
        assert live == [0] * 4, (name, live)
