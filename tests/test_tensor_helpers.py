"""Shared pieces of the tensor-parallel tests: a tiny transformer, the single-process reference and one
rank's training (module-level, so spawned gloo/MPI worlds can import them).

AdamW parity runs in float64: Adam divides by ``sqrt(v) + eps``, which turns float32 round-off in
gradients that are zero in exact arithmetic (the key bias of attention: softmax ignores a per-row
constant) into full-size updates; SGD with momentum runs in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.models import TensorParallelModel, transformer_plan
from dtlab.optimizers import DDPOptimizer, ZeRO1Optimizer
from dtlab.trainers.models import TransformerLM

CFG = {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 8}
BATCH, SEQ, STEPS = 4, 8, 5
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], torch.dtype]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}, torch.float32),
    # no momentum: each update is the gradient itself, so a gradient off by a constant factor shows
    "sgd_plain": (torch.optim.SGD, {"lr": 0.5}, torch.float32),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}, torch.float64),
}
STRATEGIES = {"ddp": DDPOptimizer, "zero1": ZeRO1Optimizer}


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    net = TransformerLM(**CFG)  # type: ignore[arg-type]
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in net.state_dict().items()}


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (BATCH, SEQ), generator=gen),
        torch.randint(0, 256, (BATCH, SEQ), generator=gen),
    )


def build(state: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> TransformerLM:
    net = TransformerLM(**CFG).to(dtype)  # type: ignore[arg-type]
    if state is not None:
        net.load_state_dict(state)
    return net


def train_reference(opt: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training on the whole batch: losses and the final state."""
    cls, kwargs, dtype = OPTIMIZERS[opt]
    net = build(initial_state(), dtype)
    optimizer = cls(net.parameters(), **kwargs)
    x, y = batch()
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1))
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses, net.state_dict()


def train_tensor(
    backend: CommunicationBackend,
    shape: dict[str, int],
    opt: str,
    sequence_parallel: bool = False,
    strategy: str = "ddp",
    steps: int = STEPS,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One rank: rank 0 alone loads the initial state (the others start random, so the broadcast is
    tested); each dp replica trains on its part of the batch; returns the dp-averaged losses and the
    full state."""
    cls, kwargs, dtype = OPTIMIZERS[opt]
    mesh = Mesh(backend, shape)
    net = build(initial_state() if backend.rank == 0 else None, dtype)
    model = TensorParallelModel(net, mesh, plan=transformer_plan(sequence_parallel=sequence_parallel))
    optimizer = STRATEGIES[strategy](model, cls, **kwargs)
    x, y = batch()
    dp, coord = mesh.size("dp"), mesh.coordinate("dp")
    x, y = x.chunk(dp)[coord], y.chunk(dp)[coord]
    losses = []
    for _ in range(steps):
        loss = model.cross_entropy(model(x), y)
        loss.backward()
        mean = loss.detach().reshape(1).clone()
        mesh["dp"].all_reduce(mean)
        losses.append(mean.item() / dp)
        optimizer.step()
        optimizer.zero_grad()
    return losses, model.full_state_dict()


def engine_world(backend: CommunicationBackend) -> dict[str, Any]:
    """Everything the gloo/MPI test checks, in one 2-process world: parity of SGD-momentum without and
    AdamW with sequence parallelism (the in-memory tests cover the other combinations)."""
    return {
        f"{opt}/sp={sp}": train_tensor(backend, {"tp": 2}, opt, sequence_parallel=sp)
        for opt, sp in (("sgd", False), ("adamw", True))
    }


def max_rel_error(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(state) == sorted(ref)
    return max(
        float((state[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp(min=1e-30))
        for k in ref
    )


Reference = tuple[list[float], dict[str, torch.Tensor]]


def check_parity(results: list[Reference], ref: Reference, where: str, tol: float = 1e-5) -> None:
    """Every rank's losses and parameters against one process's (relative errors at most ``tol``)."""
    ref_losses, ref_state = ref
    for rank, (losses, state) in enumerate(results):
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        assert loss_err <= tol, f"{where}, rank {rank}: loss relative error {loss_err:.2e}"
        err = max_rel_error(state, ref_state)
        assert err <= tol, f"{where}, rank {rank}: parameter relative error {err:.2e}"


def clip_reference(norm_type: float) -> tuple[float, TransformerLM]:
    """One process's gradient norm of one batch (clipped to 0.05) and the model after one SGD step."""
    net = build(initial_state(), torch.float32)
    x, y = batch()
    F.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1)).backward()
    want = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05, norm_type))
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    return want, net
