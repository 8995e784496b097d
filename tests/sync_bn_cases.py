"""The cases of tests/test_sync_batchnorm.py (no tests here; the Gloo world of tests/test_torch_habits.py
runs them too): a small CNN with nn.SyncBatchNorm under a data-parallel strategy, against one process's
BatchNorm on the global batch."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from test_strategies_helpers import wrap
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer

STEPS, LR = 2, 0.01
#: per-rank batch sizes of the global batch: unequal, and at 3 ranks one rank with none
SPLITS = {1: (8,), 2: (3, 5), 3: (0, 3, 5)}  # 1 rank: torch's own batch norm path


def make_module(sync: bool) -> nn.Module:
    m = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(36, 6),
        nn.BatchNorm1d(6, momentum=None),  # cumulative average: num_batches_tracked counts
        nn.Tanh(),
        nn.Linear(6, 3),
        nn.BatchNorm1d(3, affine=False),
    )
    filled(m, 0, scale=0.5)
    return nn.SyncBatchNorm.convert_sync_batchnorm(m) if sync else m


def make_data(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, 8, 2, 3, 3, generator=g) * 2 + 1
    return x, torch.randn(STEPS, 8, 3, generator=g), torch.randn(4, 2, 3, 3, generator=g)


def run(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, scale: float) -> dict[str, Any]:
    """Steps of a sum loss times ``scale`` (plain SGD: the parameters show the gradients exactly)."""
    outs, xgrads = [], []
    for s in range(len(x)):
        xs = x[s].clone()
        if s == 1 and xs.shape[0]:
            xs = xs.contiguous(memory_format=torch.channels_last)
        xs.requires_grad_(True)
        out = model(xs)
        (((out - y[s]) ** 2).sum() * scale).backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
        assert xs.grad is not None
        xgrads.append(xs.grad)
    return {"outs": outs, "xgrads": xgrads}


def reference(world: int, seed: int = 3) -> dict[str, Any]:
    """One process, plain BatchNorm, the global batch; the loss divided by ``world`` as the strategies
    average their gradients."""
    x, y, x_eval = make_data(seed)
    m = make_module(sync=False)
    res = run(m, torch.optim.SGD(m.parameters(), lr=LR), x, y, 1 / world)
    res["state"] = {k: v.clone() for k, v in m.state_dict().items()}
    m.eval()
    res["eval"] = m(x_eval).detach()
    return res


OPTIMIZERS = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def distributed(
    backend: CommunicationBackend, name: str, seed: int = 3, compile_module: bool = False, **kw: Any
) -> dict[str, Any]:
    """``name`` over ``backend`` (``kw``: its options) on this rank's part of the global batch."""
    x, y, x_eval = make_data(seed)
    sizes = SPLITS[backend.world_size]
    lo = sum(sizes[: backend.rank])
    mine = slice(lo, lo + sizes[backend.rank])
    module = make_module(sync=True)
    if compile_module:
        module = torch.compile(module, backend="aot_eager")  # type: ignore[assignment]
    model = wrap(name, module, backend, **kw)
    opt = OPTIMIZERS.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=LR)
    res = run(model, opt, x[:, mine], y[:, mine], 1.0)
    res["state"] = {k.removeprefix("_orig_mod."): v for k, v in model.full_state_dict().items()}
    model.eval()
    gathers = backend.stats["all_gather"].calls
    res["eval"] = model(x_eval).detach()
    # ZeRO-3/FSDP gather parameters; DDP and ZeRO-1/2 all-gather nothing but the statistics
    res["eval_gathers"] = 0 if model.shards_at_rest else backend.stats["all_gather"].calls - gathers
    res["mine"] = mine
    return res


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def compare(res: dict[str, Any], ref: dict[str, Any], world: int, where: str) -> float:
    """The largest relative error of this rank against the reference's slice of the global batch."""
    mine = res["mine"]
    errs = {"eval": rel(res["eval"], ref["eval"])}
    for s in range(STEPS):
        if mine.stop > mine.start:
            errs[f"out{s}"] = rel(res["outs"][s], ref["outs"][s][mine])
            # the strategies average parameter gradients; an input gradient is this rank's own
            errs[f"xgrad{s}"] = rel(res["xgrads"][s], ref["xgrads"][s][mine] * world)
    for k, v in ref["state"].items():
        if k.endswith("num_batches_tracked"):
            assert int(res["state"][k]) == int(v) == STEPS, (where, k)
        else:
            errs[k] = rel(res["state"][k], v)
    assert res["eval_gathers"] == 0, f"{where}: evaluation synchronized statistics"
    worst = max(errs, key=lambda k: errs[k])
    assert errs[worst] < 1e-5, f"{where}: {worst} off by {errs[worst]:.2e}"
    return errs[worst]
