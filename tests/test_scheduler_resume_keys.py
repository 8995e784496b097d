"""A torch LR scheduler built after loading a dtlab checkpoint, resuming with ``last_epoch`` (torch's
habit: ``opt.load_state_dict(ckpt["optimizer"])``, then ``LambdaLR(opt, fn, last_epoch=step - 1)``),
on 2 in-memory ranks against one process training without a break (4 steps, saved after 2).

``opt.load_sharded_state_dict`` restored only the group options the new optimizer already had, so
the ones a scheduler added when the checkpoint was written (``initial_lr``; OneCycleLR's ``max_lr``,
``min_lr``) were dropped, and the scheduler stopped with torch's ``KeyError: param 'initial_lr' is not
specified in param_groups[0] when resuming scheduler``, under every strategy. They are now restored as
torch's ``load_state_dict`` restores them, and the run continues as the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from test_strategies_helpers import make_data, make_module, max_rel_error, wrap
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import read_checkpoint, save_checkpoint
from dtlab.optimizers import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

STEPS, SAVED, GLOBAL_BATCH = 4, 2, 8
OPT = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer, "fsdp": ZeRO3Optimizer}


def scheduler(kind: str, opt: torch.optim.Optimizer, last_epoch: int = -1) -> Any:
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s), last_epoch=last_epoch)
    return torch.optim.lr_scheduler.OneCycleLR(opt, 0.05, total_steps=STEPS, last_epoch=last_epoch)


def train(model: Any, opt: Any, sched: Any, part: slice, first: int, last: int) -> None:
    xs, ys = make_data(STEPS, GLOBAL_BATCH)
    for s in range(first, last):
        F.mse_loss(model(xs[s][part]), ys[s][part]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def world(backend: CommunicationBackend, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    half = GLOBAL_BATCH // 2
    part = slice(backend.rank * half, (backend.rank + 1) * half)
    out: dict[str, Any] = {}
    for name, cls in OPT.items():
        for kind in ("lambda", "onecycle"):
            path = f"{root}/{name}_{kind}"
            model = wrap(name, make_module(), backend)
            opt = cls(model, torch.optim.AdamW, lr=0.01)
            train(model, opt, scheduler(kind, opt), part, 0, SAVED)
            save_checkpoint(
                path, SAVED, backend, model.sharded_state_dict(), opt.sharded_state_dict(), {}, {}
            )
            model = wrap(name, make_module(), backend)
            opt = cls(model, torch.optim.AdamW, lr=0.01)
            ckpt = read_checkpoint(path)
            model.load_sharded_state_dict(ckpt.model)
            opt.load_sharded_state_dict(ckpt.optim)
            try:
                sched = scheduler(kind, opt, last_epoch=SAVED - 1)
            except KeyError as exc:
                out[f"{name}/{kind}"] = str(exc)
                continue
            train(model, opt, sched, part, SAVED, STEPS)
            out[f"{name}/{kind}"] = model.full_state_dict()
    return out


def test_a_scheduler_resumed_with_last_epoch_after_a_sharded_load_continues(tmp_path: Path) -> None:
    refs = {}
    for kind in ("lambda", "onecycle"):
        module = make_module()
        opt = torch.optim.AdamW(module.parameters(), lr=0.01)
        train(module, opt, scheduler(kind, opt), slice(None), 0, STEPS)
        refs[kind] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for rank, res in enumerate(run_world(2, world, str(tmp_path), timeout=120)):
        for key, got in res.items():
            assert not isinstance(got, str), f"{key} rank {rank}: {got}"
            assert max_rel_error(got, refs[key.split("/")[1]]) <= 1e-5, f"{key} rank {rank}"
