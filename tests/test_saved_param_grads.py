"""A custom autograd Function that saves a weight itself and writes its ``.grad`` in ``backward``
(gradient-accumulation fusion, Megatron-style) under the five strategies on 2 in-memory ranks, against
one process on the global batch (3 AdamW steps). ZeRO-3 and FSDP hand ``ctx.saved_tensors`` back through
their saved-tensor hooks, which torch rewraps as a new tensor: the write used to land on that copy and
the gradient was lost silently (0.06 relative error here). Also: the same function returning the
gradient instead, the weight used twice in one forward (two writes into one ``.grad``), gradient
accumulation under ``no_sync()``, ZeRO-3's persistent (small) parameters, pipelines (pp=2: the pipeline's
activation meter has saved-tensor hooks too, which lost the write under DDP/ZeRO-1/ZeRO-2: 0.067
relative error), and the fused module under
reentrant activation checkpointing (its recomputation saves the parameter itself, outside the
strategy's hooks; non-reentrant checkpointing hands the function a recomputed copy in one process too,
so the write is lost there under every strategy, as in torch)."""

from __future__ import annotations

from typing import Any

import torch
from filled import filled
from test_strategies_helpers import STRATEGIES, max_rel_error, optimizer_for, wrap
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import HybridShardedModel, ModuleClassPolicy
from dtlab.testing import run_world

STEPS, GLOBAL_BATCH, IN, DIM = 3, 8, 12, 10


class WritesGrad(torch.autograd.Function):
    """``x @ weight.t()``; backward accumulates the weight's gradient into ``weight.grad`` by hand."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        gw = g.t() @ x
        if weight.grad is None:
            weight.grad = gw
        else:
            weight.grad += gw
        return g @ weight, None


class ReturnsGrad(torch.autograd.Function):
    """The same, returning the weight's gradient from backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        assert weight.data_ptr() != 0  # what a kernel (Triton, C++) is handed: its storage
        return g @ weight, g.t() @ x


class Fused(nn.Module):
    """The weight through the function twice: two backward nodes write (or return) its gradient."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(DIM, DIM))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(torch.tanh(self.fn.apply(x, self.weight)), self.weight)


class CheckpointedFused(Fused):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(super().forward, x, use_reentrant=True)
        return out


def make(fn: Any, reentrant_checkpoint: bool = False) -> nn.Module:
    fused = CheckpointedFused(fn) if reentrant_checkpoint else Fused(fn)
    return filled(nn.Sequential(nn.Linear(IN, DIM), fused, nn.Linear(DIM, 3)), 0, scale=0.4)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, IN, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 3, generator=g)


def train(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, micro: int) -> dict[str, torch.Tensor]:
    """``micro`` micro-batches per step, all but the last under ``no_sync()`` (one process: none)."""
    for s in range(STEPS):
        for i, (xm, ym) in enumerate(zip(x[s].chunk(micro), y[s].chunk(micro), strict=True)):
            last = i == micro - 1
            with model.no_sync() if hasattr(model, "no_sync") and not last else torch.enable_grad():
                (F.mse_loss(model(xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    full = getattr(model, "full_state_dict", model.state_dict)()
    return {k: v.detach().clone() for k, v in full.items()}


def reference() -> dict[str, torch.Tensor]:
    model = make(ReturnsGrad)
    x, y = data()
    return train(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), x, y, 1)


def world(backend: CommunicationBackend) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = data()
    out: dict[str, Any] = {}
    for name, schedule in (("ddp", "1f1b"), ("zero1", "zero_bubble"), ("zero2", "1f1b"), ("zero3", "gpipe")):
        model = HybridShardedModel(
            make(WritesGrad), Mesh(backend, {"pp": 2}), name, micro_batches=2, schedule=schedule
        )
        opt = optimizer_for(name, model, "adamw")
        for s in range(STEPS):
            model.train_step((x[s], y[s]), F.mse_loss)
            opt.step()
            opt.zero_grad()
        out[f"pp2/{name}/{schedule}"] = model.full_state_dict()
    h = GLOBAL_BATCH // backend.world_size
    x, y = x[:, backend.rank * h : (backend.rank + 1) * h], y[:, backend.rank * h : (backend.rank + 1) * h]
    policy = {"wrap_policy": ModuleClassPolicy((Fused, nn.Linear))}
    runs: list[tuple[str, str, Any, int, dict[str, Any]]] = [
        (f"{name}/{fn.__name__}/micro{micro}", name, fn, micro, policy if name == "fsdp" else {})
        for name in STRATEGIES
        for fn, micro in ((WritesGrad, 1), (ReturnsGrad, 1), (WritesGrad, 2))
    ]
    runs += [
        (f"{name}/checkpointed", name, "checkpointed", 1, policy if name == "fsdp" else {})
        for name in ("ddp", "zero3", "fsdp")
    ]
    # ZeRO-3 keeps parameters up to its threshold whole (persistent: the fused weight), the rest sharded
    runs.append(
        ("zero3-persistent/WritesGrad/micro1", "zero3", WritesGrad, 1, {"persistence_threshold": DIM * DIM})
    )
    for key, name, fn, micro, kw in runs:
        module = make(WritesGrad, reentrant_checkpoint=True) if fn == "checkpointed" else make(fn)
        model = wrap(name, module, backend, **kw)
        out[key] = train(model, optimizer_for(name, model, "adamw"), x, y, micro)
    return out


def test_a_function_writing_a_saved_weights_grad_equals_one_process() -> None:
    ref = reference()
    one = make(WritesGrad)  # one process: the written gradient is the returned one
    x, y = data()
    assert (
        max_rel_error(
            train(one, torch.optim.AdamW(one.parameters(), lr=0.01, weight_decay=0.1), x, y, 1), ref
        )
        <= 1e-6
    )
    for rank, res in enumerate(run_world(2, world, timeout=90)):
        assert len(res) == 3 * len(STRATEGIES) + 8
        for key, got in res.items():
            assert max_rel_error(got, ref) <= 1e-5, f"{key} rank {rank}: {max_rel_error(got, ref)}"
