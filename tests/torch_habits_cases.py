"""A torch user's habits under DDP, ZeRO-1/2/3 and FSDP (no tests here): each case runs on one rank of
a world and returns what it measured, so the same cases run on in-memory ranks and, grouped, in one
spawned Gloo world (tests/test_torch_habits.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
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

        out[flip] = _raises(step, "before wrapping")
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


def all_cases(backend: CommunicationBackend) -> dict[str, Any]:
    """Every case under every strategy in one world (a spawned world is costly to start)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        out[f"clip/{name}"] = clip_case(backend, name)
        out[f"requires_grad/{name}"] = requires_grad_case(backend, name)
        out[f"grad_sync/{name}"] = grad_sync_case(backend, name)
    return out


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)
