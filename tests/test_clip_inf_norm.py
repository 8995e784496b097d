"""``opt.clip_grad_norm_(max_norm, norm_type=float("inf"))`` with a NaN in one gradient, on 2
in-memory ranks under DDP, ZeRO-1/2/3 and FSDP, against torch's ``clip_grad_norm_`` on one process.

The largest element was taken with Python's ``max()`` over each gradient tensor's maximum, which keeps
whichever came first when one is NaN: a NaN in any but the first tensor was lost. Under ZeRO-3 and
FSDP (a tensor per parameter or unit) a NaN only in the last parameter's gradient gave a finite norm
(0.989), so ``error_if_nonfinite=True`` did not raise and a loop skipping steps whose norm is not
finite stepped the NaN in; torch's norm is NaN. The norm now is NaN on every rank (the NaN carried
apart from the MAX reduction, which a backend need not propagate), and the error is raised.
"""

from __future__ import annotations

from typing import Any

import torch
from test_strategies_helpers import STRATEGIES, make_data, make_module, wrap
from torch.nn import functional as F

from dtlab.backends.base import CommunicationBackend
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer
from dtlab.testing import run_world

GLOBAL_BATCH = 8
OPT = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer, "zero2": ZeRO2Optimizer}


def backward_with_nan(model: Any, part: slice, nan: bool) -> None:
    """A backward whose last parameter's gradient is NaN (on this rank when ``nan``)."""
    last = list(getattr(model, "module", model).parameters())[-1]
    if nan:
        last.register_hook(lambda g: g * float("nan"))
    x, y = make_data(1, GLOBAL_BATCH)
    F.mse_loss(model(x[0][part]), y[0][part]).backward()


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    half = GLOBAL_BATCH // 2
    part = slice(backend.rank * half, (backend.rank + 1) * half)
    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for check in (False, True):
            model = wrap(name, make_module(), backend)
            opt = OPT.get(name, ZeRO3Optimizer)(model, torch.optim.SGD, lr=0.1)
            backward_with_nan(model, part, backend.rank == 1)
            try:
                norm = opt.clip_grad_norm_(1.0, norm_type=float("inf"), error_if_nonfinite=check)
                out[f"{name}/{check}"] = float(norm)
            except RuntimeError as exc:
                out[f"{name}/{check}"] = str(exc)
    return out


def test_a_nan_in_any_gradient_makes_the_inf_norm_nan_as_torch() -> None:
    module = make_module()
    backward_with_nan(module, slice(None), True)
    assert torch.isnan(torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, norm_type=float("inf")))
    for rank, res in enumerate(run_world(2, world, timeout=120)):
        for name in STRATEGIES:
            norm, raised = res[f"{name}/False"], res[f"{name}/True"]
            assert isinstance(norm, float) and norm != norm, f"{name} rank {rank}: norm {norm}"
            assert isinstance(raised, str) and "non-finite" in raised, f"{name} rank {rank}: {raised}"
