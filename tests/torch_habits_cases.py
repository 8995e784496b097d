"""A torch user's habits under DDP, ZeRO-1/2/3 and FSDP (no tests here): each case runs on one rank of
a world and returns what it measured, so the same cases run on in-memory ranks and, grouped, in one
spawned Gloo world (tests/test_torch_habits.py)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from sync_bn_cases import distributed as sync_bn_case
from test_strategies_helpers import STRATEGIES, make_data, make_module, wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer

STEPS, GLOBAL_BATCH, MAX_NORM = 4, 8, 0.05
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def opt_class(name: str) -> Any:
    return OPT.get(name, ZeRO3Optimizer)


def _batch(backend: CommunicationBackend, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    local = GLOBAL_BATCH // backend.world_size
    r = backend.rank
    return x[s, r * local : (r + 1) * local], y[s, r * local : (r + 1) * local]


def _raises(fn: Callable[[], Any], match: str) -> str:
    """``"refused"`` when ``fn`` raises a StrategyError naming ``match``, else what it returned."""
    try:
        out = fn()
    except StrategyError as exc:
        if match not in str(exc):
            raise
        return "refused"
    return f"ran: {out!r}"


# ---------------------------------------------------------------------------- clipping
def clip_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process AdamW with torch's clip_grad_norm_ active (norms above MAX_NORM)."""
    x, y = make_data(STEPS, GLOBAL_BATCH)
    module = make_module()
    o = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    norms = []
    for s in range(STEPS):
        nn.functional.mse_loss(module(x[s]), y[s]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)))
        o.step()
        o.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, norms


def clip_case(backend: CommunicationBackend, name: str, **kw: Any) -> dict[str, Any]:
    """torch's clip_grad_norm_ on the wrapped model's parameters: the global norm and clipped (DDP,
    ZeRO-1 with all-reduce), or refused naming opt.clip_grad_norm_; the step then clips with
    opt.clip_grad_norm_; plus torch's clip_grad_value_ and a plain torch optimizer on the model."""
    model = wrap(name, make_module(), backend, **kw)
    opt = opt_class(name)(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    torch_norms, norms, verdicts = [], [], set()
    for s in range(STEPS):
        xb, yb = _batch(backend, s)
        nn.functional.mse_loss(model(xb), yb).backward()
        got = _raises(
            lambda: float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)), "opt.clip_grad_norm_"
        )
        verdicts.add("refused" if got == "refused" else "ran")
        if got == "refused":
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        else:
            torch_norms.append(float(got[len("ran: ") :]))
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict()
    xb, yb = _batch(backend, 0)
    nn.functional.mse_loss(model(xb), yb).backward()
    value = _raises(lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3), "opt.clip_grad_value_")
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_step = _raises(plain.step, "opt.clip_grad_norm_")
    opt.zero_grad()
    return {
        "state": state,
        "torch_norms": torch_norms,
        "norms": norms,
        "verdicts": sorted(verdicts),
        "clip_value": "refused" if value == "refused" else "ran",
        "plain_step": "refused" if plain_step == "refused" else "ran",
    }


# ---------------------------------------------------------------------------- requires_grad after wrapping
def requires_grad_case(backend: CommunicationBackend, name: str) -> dict[str, str]:
    out = {}
    for flip in ("unfreeze", "freeze"):
        module = make_module()
        first = next(module.parameters())
        if flip == "unfreeze":
            first.requires_grad_(False)
        model = wrap(name, module, backend)
        opt = opt_class(name)(model, torch.optim.SGD, lr=0.1)
        first.requires_grad_(flip == "unfreeze")
        xb, yb = _batch(backend, 0)

        def step(model: Any = model, opt: Any = opt, xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> None:
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()

        # the advice fits the strategy: ZeRO-3/FSDP hold flat shards, so a new wrapper needs a whole module
        advice = (
            "to change which parameters train, load full_state_dict()"
            if name in ("zero3", "fsdp")
            else ("rebuild the wrapper")
        )
        out[flip] = _raises(step, f"before wrapping it ({advice}")
    return out


# ---------------------------------------------------------------------------- require_backward_grad_sync
def _reduced(backend: CommunicationBackend) -> int:
    """Bytes this rank sent in gradient reductions (all-reduce, reduce-scatter) so far."""
    return sum(backend.stats[k].bytes_sent for k in ("all_reduce", "reduce_scatter"))


def grad_sync_case(backend: CommunicationBackend, name: str) -> dict[str, Any]:
    """Accumulate 2 micro-batches with torch DDP's switch: bytes of one synchronized backward, not two;
    the result equals single-process training on the global batch."""
    model = wrap(name, make_module(), backend)
    opt = opt_class(name)(model, torch.optim.SGD, lr=0.1)
    sent = []
    for s in range(2):
        before = _reduced(backend)
        for micro in range(2):
            model.require_backward_grad_sync = micro == 1
            xb, yb = _batch(backend, s)
            half = xb.shape[0] // 2
            sl = slice(micro * half, (micro + 1) * half)
            (nn.functional.mse_loss(model(xb[sl]), yb[sl]) / 2).backward()
        after_backward = _reduced(backend)
        opt.step()
        opt.zero_grad()
        sent.append(after_backward - before)
    once = []
    for s in range(1):  # the same step without accumulation: one synchronized backward's bytes
        before = _reduced(backend)
        xb, yb = _batch(backend, s)
        nn.functional.mse_loss(model(xb), yb).backward()
        once.append(_reduced(backend) - before)
        opt.zero_grad()
    return {"state": model.full_state_dict(), "accumulated_bytes": sent, "one_backward_bytes": once[0]}


def grad_sync_reference() -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    module = make_module()
    o = torch.optim.SGD(module.parameters(), lr=0.1)
    for s in range(2):
        nn.functional.mse_loss(module(x[s]), y[s]).backward()
        o.step()
        o.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------- groups, schedulers, state
def make_groups(module: nn.Module) -> torch.optim.Optimizer:
    """The usual split, built on the plain module: weight decay on matrices, none on biases, and a
    larger learning rate for the biases."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    other = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
    )


def make_scheduler(opt: torch.optim.Optimizer, kind: str) -> Any:
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.04], total_steps=STEPS)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def groups_reference(kind: str) -> dict[str, torch.Tensor]:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    module = make_module()
    opt = make_groups(module)
    sched = make_scheduler(opt, kind)
    for s in range(STEPS):
        nn.functional.mse_loss(module(x[s]), y[s]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return _state(module)


def _train(model: Any, opt: Any, sched: Any, backend: CommunicationBackend | None, steps: range) -> None:
    x, y = make_data(STEPS, GLOBAL_BATCH)
    for s in steps:
        xb, yb = (x[s], y[s]) if backend is None else _batch(backend, s)
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def groups_case(backend: CommunicationBackend, name: str, kind: str) -> dict[str, Any]:
    """Two param groups built on the module before wrapping, the user's AdamW instance handed to the
    strategy, torch's scheduler attached to the strategy; then the optimizer state round-tripped
    through a plain torch optimizer both ways, each run compared with one process."""
    module = make_module()
    torch_opt = make_groups(module)
    model = wrap(name, module, backend)
    opt = opt_class(name)(model, torch_opt)
    sched = make_scheduler(opt, kind)
    _train(model, opt, sched, backend, range(STEPS))
    trained = model.full_state_dict()
    # dtlab -> plain: after 2 steps, a plain script takes over from opt.state_dict()
    module = make_module()
    model = wrap(name, module, backend)
    opt = opt_class(name)(model, make_groups(module))
    sched = make_scheduler(opt, kind)
    _train(model, opt, sched, backend, range(2))
    saved, sched_state, weights = opt.state_dict(), sched.state_dict(), model.full_state_dict()
    plain = make_module()
    plain.load_state_dict(weights)
    plain_opt = make_groups(plain)
    plain_sched = make_scheduler(plain_opt, kind)  # torch's order: build both, then load both
    plain_opt.load_state_dict(copy.deepcopy(saved))  # torch adopts the tensors it is given
    plain_sched.load_state_dict(sched_state)
    _train(plain, plain_opt, plain_sched, None, range(2, STEPS))
    # plain -> dtlab: the plain run's state dicts resume an already-wrapped model (weights loaded
    # with model.load_state_dict, groups built on the wrapped model's parameters)
    module = make_module()
    model = wrap(name, module, backend)
    model.load_state_dict(weights)
    resumed = make_groups(model)
    opt = opt_class(name)(model, resumed)
    sched = make_scheduler(opt, kind)
    opt.load_state_dict(saved)
    sched.load_state_dict(sched_state)
    _train(model, opt, sched, backend, range(2, STEPS))
    return {"trained": trained, "to_plain": _state(plain), "from_plain": model.full_state_dict()}


# ---------------------------------------------------------------------------- counts and dims
def counts_case(backend: CommunicationBackend, name: str) -> dict[str, Any]:
    """Parameter counts, dims and shapes of the wrapped model between uses, after a forward, after a
    step and after an eval forward, as the plain module's."""
    model = wrap(name, make_module(), backend)
    opt = opt_class(name)(model, torch.optim.SGD, lr=0.1)
    seen = [[(tuple(p.shape), p.dim(), p.numel()) for p in model.parameters()]]
    xb, yb = _batch(backend, 0)
    nn.functional.mse_loss(model(xb), yb).backward()
    seen.append([(tuple(p.shape), p.dim(), p.numel()) for p in model.parameters()])
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(xb)
    seen.append([(tuple(p.shape), p.dim(), p.numel()) for p in model.module.parameters()])
    keys = sorted(model.state_dict())
    return {"seen": seen, "count": sum(p.numel() for p in model.parameters()), "keys": keys}


# ---------------------------------------------------------------------------- one-rank evaluation
def one_rank_eval_case(
    backend: CommunicationBackend, name: str, other: str = "leave", call: str = "forward"
) -> dict[str, Any]:
    """Rank 0 alone evaluates (a DDP habit), or with ``call="state_dict"`` saves (``if rank == 0:
    torch.save(model.state_dict(), path)``); the other ranks ``leave`` (return) or wait at a
    ``barrier``. Under ZeRO-3/FSDP the forward or state dict must stop with an error naming the cause,
    quickly (it hung for the collective timeout before on Gloo and NCCL)."""
    backend.check_collectives = False  # a user's default (spawned test worlds check every call)
    wait = 3.0 if call == "forward" else 1.0
    model = wrap(name, make_module(), backend, forward_wait_s=wait)
    xb, _ = _batch(backend, 0)
    if backend.rank != 0:
        if other == "barrier":
            backend.barrier()
        elif other == "rejoin":  # come back after rank 0 gave up, to meet its pending gather: the
            time.sleep(2 * wait)  # world then closes cleanly (a test's choreography, not a user's)
            unit = model.shard_units()[0]
            backend.all_gather(unit.new_flat(), model.shard_param(unit))
        return {}
    t0 = time.monotonic()
    try:
        if call == "forward":
            with torch.no_grad():
                model(xb)
        else:
            model.state_dict()
    except StrategyError as exc:
        said = f"every rank must call {'forward' if call == 'forward' else 'it'}"
        return {"named": said in str(exc), "seconds": time.monotonic() - t0, "message": str(exc)}
    return {"named": False, "seconds": time.monotonic() - t0}


def all_cases(backend: CommunicationBackend) -> dict[str, Any]:
    """Every case under every strategy in one world (a spawned world is costly to start)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        out[f"clip/{name}"] = clip_case(backend, name)
        out[f"requires_grad/{name}"] = requires_grad_case(backend, name)
        out[f"grad_sync/{name}"] = grad_sync_case(backend, name)
        out[f"counts/{name}"] = counts_case(backend, name)
        out[f"groups/{name}/lambda"] = groups_case(backend, name, "lambda")
    # SyncBatchNorm with torch.distributed initialized: dtlab's sync replaces torch's (which would
    # sync over WORLD, and on a CPU refuse to)
    out["sync_bn/initialized"] = torch.distributed.is_initialized()
    for name in ("ddp", "fsdp"):
        out[f"sync_bn/{name}"] = sync_bn_case(backend, name)
    # last: rank 0's forward (then state dict) leaves an all-gather pending that nothing else may meet
    out["one_rank_eval/zero3"] = one_rank_eval_case(backend, "zero3", "rejoin")
    out["one_rank_state/fsdp"] = one_rank_eval_case(backend, "fsdp", "rejoin", "state_dict")
    return out


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)
