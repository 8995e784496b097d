"""A torch user's optimizer habits under DDP, ZeRO-1/2/3, FSDP and tensor parallelism (tp=2), on 2
in-memory ranks against one process on the global batch (3 steps), or refused with the fix.

- torch's Adafactor under ZeRO-1/2/3 and FSDP stepped each rank's flat shard as if it were a whole
  parameter (no factored moments, the RMS of a piece): 7.5e-3 relative error after 3 steps, silently;
  torch's Muon under tensor parallelism orthogonalized each rank's slice (6.6e-3), and under ZeRO
  stopped with torch's raw ``ValueError`` (1-D shards). Both are now refused when the optimizer
  strategy is built, naming the fix; Adafactor under DDP, and the element-wise optimizers (Adagrad,
  centered RMSprop, Adamax, NAdam, RAdam, Rprop, Adadelta, ASGD) under ZeRO, equal one process.
- ``opt.state = collections.defaultdict(dict)`` (resetting the state mid-run) rebound an attribute the
  step never read, under every strategy (3.1e-2 relative error after 3 AdamW steps): it now resets.
- ``opt.state[p]`` under ZeRO/FSDP gave an empty dict (``KeyError`` on reading ``exp_avg``): refused
  naming the fix; under DDP it is the parameter's state, as in torch.
- torch's Adafactor on a pipeline rank (pp=2, DDPOptimizer: each stage's whole parameters) was refused
  with an error about ``clip_grad_norm_`` (its row norms met the guard on ``param.grad``): it now
  equals one process.
- Muon on the matrices and AdamW on the rest (two torch optimizers): under DDP, AdamW in the optimizer
  strategy and Muon plain equal one process; under ZeRO the plain one is refused at its step.
- A scheduler built on the torch optimizer before handing it to the strategy changed a copy of its
  groups (0.11 relative error after 3 steps, every strategy): the groups are now shared; the handed
  instance's own ``step()`` and ``state_dict()`` (no state: a checkpoint without it) are refused.
- Hooks registered on the torch optimizer instance before handing it over (``register_step_post_hook``:
  an EMA update; state-dict hooks) were silently dropped, and the strategy's own state-dict hooks never
  ran: now carried over and run as torch runs them (global hooks: tests/test_optimizer_state_habits.py);
  one registered on the instance after handing it over is registered on the strategy.
- Param groups built on the plain module before wrapping a pipeline: refused naming the fix (groups
  from ``model.module`` after wrapping), which equals one process; a user's own LAMB class refused.
- ``opt.clip_grad_norm_(max_norm, error_if_nonfinite=True)`` raised a raw ``TypeError``: it takes torch's
  arguments and raises torch's RuntimeError on every rank when the global norm is not finite.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, max_rel_error, wrap
from test_tensor_habits import PLAN, build, data
from torch.nn import functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.models import PipelineParallelModel, TensorParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH = 3, 8
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}
ELEMENTWISE: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "nadam": (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    "radam": (torch.optim.RAdam, {"lr": 0.01}),
    "rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "asgd": (torch.optim.ASGD, {"lr": 0.01, "t0": 1}),
}
REFUSED = "element-wise optimizers"


class Lamb(torch.optim.Optimizer):
    """A user's own layer-wise optimizer: the step scaled by the parameter's norm over its gradient's."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = float(p.norm() / (p.grad.norm() + 1e-6))
                    p.add_(p.grad, alpha=-group["lr"] * trust)


def loop(model: Any, opt: torch.optim.Optimizer, part: slice, habit: str = "") -> None:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        if habit == "clip":
            clip = getattr(opt, "clip_grad_norm_", None)
            if clip is None:  # one process: torch's own
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True)
            else:
                clip(0.05, error_if_nonfinite=True, foreach=True)
        opt.step()
        opt.zero_grad()
        if habit == "reset" and s == 1:
            opt.state = collections.defaultdict(dict)


def reference(
    cls: type[torch.optim.Optimizer], kw: dict[str, Any], habit: str = ""
) -> dict[str, torch.Tensor]:
    module = make_module()
    if cls is torch.optim.Muon:  # Muon steps matrices only
        for p in module.parameters():
            p.requires_grad_(p.dim() == 2)
    loop(module, cls([p for p in module.parameters() if p.requires_grad], **kw), slice(None), habit)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _train(
    backend: CommunicationBackend,
    name: str,
    cls: type[torch.optim.Optimizer],
    kw: dict[str, Any],
    habit: str = "",
) -> Any:
    """The state after training, or the StrategyError's message."""
    half = GLOBAL_BATCH // 2
    module = make_module()
    if cls is torch.optim.Muon:
        for p in module.parameters():
            p.requires_grad_(p.dim() == 2)
    model = wrap(name, module, backend)
    try:
        opt = OPT.get(name, ZeRO3Optimizer)(model, cls, **kw)
        loop(model, opt, slice(backend.rank * half, (backend.rank + 1) * half), habit)
    except StrategyError as exc:
        return str(exc)
    return model.full_state_dict()


def _state_item(backend: CommunicationBackend, name: str) -> Any:
    """``opt.state[p]['exp_avg'].zero_()`` after a step: the state or the StrategyError's message."""
    model = wrap(name, make_module(), backend)
    opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.AdamW, lr=0.01)
    half = GLOBAL_BATCH // 2
    loop(model, opt, slice(backend.rank * half, (backend.rank + 1) * half))
    try:
        for p in model.module.parameters():
            opt.state[p]["exp_avg"].zero_()
    except StrategyError as exc:
        return str(exc)
    return {k: v.clone() for k, v in model.module.state_dict().items()}, p in opt.state


def _nonfinite(backend: CommunicationBackend, name: str) -> str:
    model = wrap(name, make_module(), backend)
    opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=0.1)
    x, y = make_data(1, GLOBAL_BATCH)
    loss = F.mse_loss(model(x[0]), y[0])
    (loss * (float("inf") if backend.rank == 1 else 1.0)).backward()  # rank 1's gradient overflows
    try:
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        return str(exc)
    return "clipped"


def _tp(backend: CommunicationBackend, cls: type[torch.optim.Optimizer], ocls: type[Any]) -> str:
    net = build()
    if cls is torch.optim.Muon:
        for p in net.parameters():
            p.requires_grad_(p.dim() == 2)
    model = TensorParallelModel(net, Mesh(backend, {"tp": 2}), plan=PLAN)
    try:
        opt = ocls(model, cls, lr=0.01)
        x, y = data(0)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except StrategyError as exc:
        return str(exc)
    return "trained"


def _pp(backend: CommunicationBackend, ocls: type[Any]) -> Any:
    """torch's Adafactor on a pipeline rank (pp=2): whole parameters of its stages."""
    model = PipelineParallelModel(make_module(), Mesh(backend, {"pp": 2}), micro_batches=2)
    try:
        opt = ocls(model, torch.optim.Adafactor, lr=0.01)
        xs, ys = make_data(STEPS, GLOBAL_BATCH)
        for s in range(STEPS):
            model.train_step((xs[s], ys[s]), F.mse_loss)
            opt.step()
            opt.zero_grad()
    except StrategyError as exc:
        return str(exc)
    return model.full_state_dict()


def two_optimizers(model: Any, name: str | None, part: slice) -> Any:
    """Muon on the matrices and AdamW on the rest: under DDP AdamW in the optimizer strategy and Muon
    plain (docs/porting.md); ``name`` None: one process, both plain."""
    params = list(getattr(model, "module", model).parameters())
    muon = torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.02)
    adamw = torch.optim.AdamW([p for p in params if p.dim() < 2], lr=0.01)
    opt = adamw if name is None else OPT.get(name, ZeRO3Optimizer)(model, adamw)
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    try:
        for s in range(STEPS):
            F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
            muon.step()
            opt.step()
            opt.zero_grad()
            muon.zero_grad()
    except StrategyError as exc:
        return str(exc)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hooks_case(backend: CommunicationBackend, name: str) -> list[str]:
    """Hooks registered on the torch optimizer instance before it is handed to the strategy (an EMA
    updated from a step post-hook), and state-dict hooks on the strategy: what ran, in order."""
    seen: list[str] = []
    model = wrap(name, make_module(), backend)
    inst = torch.optim.AdamW(model.module.parameters(), lr=0.01)
    inst.register_step_pre_hook(lambda o, a, k: seen.append(f"pre {type(o).__name__}"))
    inst.register_step_post_hook(lambda o, a, k: seen.append("post"))
    inst.register_state_dict_post_hook(lambda o, sd: seen.append(f"sd {len(sd['param_groups'])}"))
    inst.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load_pre"))
    opt = OPT.get(name, ZeRO3Optimizer)(model, inst)
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    inst.register_step_post_hook(lambda o, a, k: seen.append("late"))  # on the instance, after: never ran
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(2):
        F.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    return seen


def handed_case(backend: CommunicationBackend | None, name: str | None) -> Any:
    """A scheduler built on the torch optimizer before it is handed to the strategy (``name`` None: one
    process, nothing handed); then the handed instance's own step() and state_dict()."""
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    module = make_module()
    model = module if backend is None or name is None else wrap(name, module, backend)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 3 * s))
    opt = optimizer if model is module else OPT.get(name, ZeRO3Optimizer)(model, optimizer)
    part = slice(None) if backend is None else slice(backend.rank * 4, backend.rank * 4 + 4)
    for s in range(STEPS):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model is module:
        return state
    refused = []
    for call in (optimizer.step, optimizer.state_dict):
        try:
            call()
        except StrategyError as exc:
            refused.append(str(exc))
    return state, refused


def grouped(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")], "lr": 0.02, "weight_decay": 0.3},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.005},
        ],
        lr=0.01,
    )


def pp_groups(backend: CommunicationBackend, after: bool) -> Any:
    """Param groups on a pipeline rank, built from the plain module before wrapping (refused: another
    stage's parameters are not this rank's) or from ``model.module`` after."""
    module = make_module()
    before = list(module.named_parameters())
    model = PipelineParallelModel(module, Mesh(backend, {"pp": 2}), micro_batches=2)
    try:
        opt = DDPOptimizer(model, grouped(list(model.module.named_parameters()) if after else before))
    except StrategyError as exc:
        return str(exc)
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(STEPS):
        model.train_step((xs[s], ys[s]), F.mse_loss)
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        out[f"adafactor/{name}"] = _train(backend, name, torch.optim.Adafactor, {"lr": 0.01})
        out[f"reset/{name}"] = _train(
            backend, name, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, "reset"
        )
        out[f"clip/{name}"] = _train(backend, name, torch.optim.AdamW, {"lr": 0.01}, "clip")
        out[f"state_item/{name}"] = _state_item(backend, name)
        out[f"nonfinite/{name}"] = _nonfinite(backend, name)
        out[f"handed/{name}"] = handed_case(backend, name)
    for name in ("zero2", "fsdp"):
        out[f"muon/{name}"] = _train(backend, name, torch.optim.Muon, {"lr": 0.01})
        out[f"lamb/{name}"] = _train(backend, name, Lamb, {"lr": 0.01})
        for opt, (cls, kw) in ELEMENTWISE.items():
            out[f"{opt}/{name}"] = _train(backend, name, cls, kw)
    out["muon/ddp"] = _train(backend, "ddp", torch.optim.Muon, {"lr": 0.01})
    for cls in (torch.optim.Adafactor, torch.optim.Muon):
        out[f"tp/{cls.__name__}"] = _tp(backend, cls, DDPOptimizer)
    out["tp/AdamW"] = _tp(backend, torch.optim.AdamW, ZeRO1Optimizer)
    half = slice(backend.rank * GLOBAL_BATCH // 2, (backend.rank + 1) * GLOBAL_BATCH // 2)
    for name in ("ddp", "zero2"):
        out[f"two/{name}"] = two_optimizers(wrap(name, make_module(), backend), name, half)
    for name in ("ddp", "zero2"):
        out[f"hooks/{name}"] = hooks_case(backend, name)
    out["pp/groups_before"], out["pp/groups_after"] = pp_groups(backend, False), pp_groups(backend, True)
    out["pp/ddp"], out["pp/zero1"] = _pp(backend, DDPOptimizer), _pp(backend, ZeRO1Optimizer)
    return out


def test_optimizer_habits_equal_one_process_or_are_refused() -> None:
    results = run_world(2, world, timeout=120)
    adafactor = reference(torch.optim.Adafactor, {"lr": 0.01})
    reset = reference(torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, "reset")
    clip = reference(torch.optim.AdamW, {"lr": 0.01}, "clip")
    muon = reference(torch.optim.Muon, {"lr": 0.01})
    refs = {opt: reference(cls, kw) for opt, (cls, kw) in ELEMENTWISE.items()}
    handed = handed_case(None, None)
    for rank, res in enumerate(results):
        for name in STRATEGIES:
            where = f"{name} rank {rank}"
            got = res[f"adafactor/{name}"]
            if name == "ddp":  # whole parameters: torch's Adafactor as on one process
                assert max_rel_error(got, adafactor) <= 1e-5, where
            else:
                assert isinstance(got, str) and "Adafactor" in got and REFUSED in got, f"{where}: {got}"
                assert "Use DDPModel with DDPOptimizer" in got, got
            assert max_rel_error(res[f"reset/{name}"], reset) <= 1e-5, f"reset {where}"
            assert max_rel_error(res[f"clip/{name}"], clip) <= 1e-5, f"clip {where}"
            state, refused = res[f"handed/{name}"]
            assert max_rel_error(state, handed) <= 1e-5, f"scheduler on the instance, {where}"
            assert len(refused) == 2 and all("holds no optimizer state" in r for r in refused), refused
            said = res[f"nonfinite/{name}"]
            assert "non-finite, so it cannot be clipped" in said, f"{where}: {said}"
            item = res[f"state_item/{name}"]
            if name == "ddp":  # torch's opt.state[p]: the parameter's own state
                assert isinstance(item, tuple) and item[1] is True, where
            else:
                assert isinstance(item, str) and "opt.state_dict()['state'][index]" in item, (
                    f"{where}: {item}"
                )
        for name in ("zero2", "fsdp"):
            got = res[f"muon/{name}"]
            assert isinstance(got, str) and "Muon" in got and "stepping pieces failed" in got, got
            got = res[f"lamb/{name}"]
            assert isinstance(got, str) and "Lamb (param group 0)" in got and REFUSED in got, got
            for opt in ELEMENTWISE:
                assert max_rel_error(res[f"{opt}/{name}"], refs[opt]) <= 1e-5, f"{opt} {name} rank {rank}"
        assert max_rel_error(res["muon/ddp"], muon) <= 1e-5
        for cls in ("Adafactor", "Muon"):
            got = res[f"tp/{cls}"]
            assert isinstance(got, str) and "tensor-parallel pieces" in got and REFUSED in got, got
        assert res["tp/AdamW"] == "trained"
        assert max_rel_error(res["two/ddp"], two_optimizers(make_module(), None, slice(None))) <= 1e-5
        assert "param.grad of '0.weight' is not the whole gradient" in res["two/zero2"], res["two/zero2"]
        for name, cls in (("ddp", "DDPOptimizer"), ("zero2", "ZeRO2Optimizer")):
            want = [f"pre {cls}", "post", "late"] * 2 + ["sd 1", "load_pre", "load_post"]
            assert res[f"hooks/{name}"] == want, (name, res[f"hooks/{name}"])
        assert "build the groups after wrapping" in res["pp/groups_before"], res["pp/groups_before"]
        module = make_module()
        one = grouped(list(module.named_parameters()))
        loop(module, one, slice(None))
        assert max_rel_error(res["pp/groups_after"], module.state_dict()) <= 1e-5
        assert max_rel_error(res["pp/ddp"], adafactor) <= 1e-5  # a stage's whole parameters
        assert isinstance(res["pp/zero1"], str) and REFUSED in res["pp/zero1"], res["pp/zero1"]
