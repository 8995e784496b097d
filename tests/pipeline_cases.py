"""Shared pieces of the pipeline tests: tiny models, data, the one-process reference and a rank's run
(module-level, so spawned gloo/MPI worlds can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from filled import filled
from torch import nn

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.models import PipelineParallelModel
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.trainers.models import TransformerLM

STEPS = 5
WIDTH = 6


def make_mlp(layers: int = 8, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear(6, 6), Tanh), values from a private generator (no global seeding)."""
    g = torch.Generator().manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) * 0.5)
            lin.bias.copy_(torch.randn(WIDTH, generator=g) * 0.1)
        mods += [lin, nn.Tanh()]
    return nn.Sequential(*mods)


def make_lm(seed: int = 0) -> TransformerLM:
    return filled(TransformerLM(d_model=16, n_layers=2, n_heads=2, seq_len=8), seed, scale=0.1)


def mlp_data(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, batch, WIDTH, generator=g), torch.randn(STEPS, batch, WIDTH, generator=g)


def lm_data(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (STEPS, batch, 9), generator=g)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


MODELS: dict[str, Any] = {
    "mlp": (make_mlp, mlp_data, F.mse_loss),
    "lm": (make_lm, lm_data, lm_loss),
}


def optimizer_args(name: str, kind: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    if name == "sgd_plain":  # no momentum: a gradient off by a constant factor shows in every update
        return torch.optim.SGD, {"lr": 0.2}
    # the attention's key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a
    # shift of every key), so its computed gradient is round-off, which Adam with eps=1e-8 turns into
    # lr-sized steps of either sign; a larger eps keeps that noise from deciding the comparison
    return torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.01, "eps": 1e-4 if kind == "lm" else 1e-8}


def reference(
    kind: str, opt: str, batch: int, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final state of one process training on the whole batch."""
    make, data, loss_fn = MODELS[kind]
    model = make()
    cls, kwargs = optimizer_args(opt, kind)
    optimizer = cls(model.parameters(), **kwargs)
    xs, ys = data(batch)
    losses = []
    for s in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(model(xs[s]), ys[s])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipeline_rank(
    backend: CommunicationBackend | Mesh,
    kind: str,
    mesh_shape: dict[str, int],
    schedule: str,
    micro_batches: int,
    opt: str,
    batch: int,
    stages_per_rank: int = 1,
    zero1: bool = False,
    clip: float | None = None,
    checkpointing: bool = False,
) -> dict[str, Any]:
    """Train ``STEPS`` steps on this rank's dp share (``backend``: a backend, or a mesh to reuse);
    losses averaged over dp, the full state, the memory report and the pp group's send/recv counters
    of the last step."""
    make, data, loss_fn = MODELS[kind]
    mesh = backend if isinstance(backend, Mesh) else Mesh(backend, mesh_shape)
    model = PipelineParallelModel(
        make(),
        mesh,
        schedule,
        micro_batches=micro_batches,
        stages_per_rank=stages_per_rank,
        activation_checkpointing=checkpointing,
    )
    torch_cls, kwargs = optimizer_args(opt, kind)
    optimizer = (ZeRO1Optimizer if zero1 else DDPOptimizer)(model, torch_cls, **kwargs)
    xs, ys = data(batch)
    dp, coord = mesh.size("dp"), mesh.coordinate("dp")
    share = batch // dp
    losses, norms = [], []
    for s in range(STEPS):
        before = (model.pp_group.stats["send"], model.pp_group.stats["recv"])
        part = slice(coord * share, (coord + 1) * share)
        loss = model.train_step((xs[s][part], ys[s][part]), loss_fn)
        after = (model.pp_group.stats["send"], model.pp_group.stats["recv"])
        if clip is not None:
            norms.append(float(optimizer.clip_grad_norm_(clip)))
        optimizer.step()
        optimizer.zero_grad()
        total = loss.reshape(1).clone()
        mesh["dp"].all_reduce(total, ReduceOp.SUM)
        losses.append(total.item() / dp)
    return {
        "losses": losses,
        "state": model.full_state_dict(),
        "memory": model.memory_report(),
        "sent": after[0].bytes_sent - before[0].bytes_sent,
        "received": after[1].bytes_received - before[1].bytes_received,
        "norms": norms,
        "stage_output_bytes": [
            spec.nbytes for spec in model._pipe.specs_for(xs[0][:share].chunk(micro_batches)[0])
        ],
    }


def worst_error(results: list[dict[str, Any]], ref: tuple[list[float], dict[str, torch.Tensor]]) -> float:
    """Largest relative error of any rank's losses or any parameter against the reference."""
    losses, state = ref
    worst = 0.0
    for r in results:
        worst = max(worst, *(abs(a - b) / abs(b) for a, b in zip(r["losses"], losses, strict=True)))
        assert r["state"].keys() == state.keys()
        for key, want in state.items():
            worst = max(worst, float((r["state"][key] - want).norm() / want.norm().clamp_min(1e-12)))
    return worst
