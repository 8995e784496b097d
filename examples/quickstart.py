"""Data parallelism on 4 in-memory ranks: each rank trains on its own slice of every batch and the
gradients are averaged with ``all_reduce``. Run: ``python examples/quickstart.py``."""

from __future__ import annotations

import torch
from torch import nn

from dtlab.backends import CommunicationBackend, ReduceOp
from dtlab.core import seeded_init
from dtlab.testing import run_world

WORLD_SIZE, STEPS, GLOBAL_BATCH = 4, 60, 64


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w / 2) + 0.05 * torch.randn(4096, 1, generator=g)
    return x, y


def train(backend: CommunicationBackend) -> list[float]:
    # every rank builds the same initial model, in every run: in-memory ranks are threads sharing torch's
    # global RNG, so a plain torch.manual_seed(0) here would race with the other ranks' seeding and drawing;
    # seeded_init draws from generators of its own
    with seeded_init(0):
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = make_data()
    local = GLOBAL_BATCH // backend.world_size
    losses = []
    for step in range(STEPS):
        start = (step * GLOBAL_BATCH) % len(x) + backend.rank * local
        xb, yb = x[start : start + local], y[start : start + local]
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            backend.all_reduce(p.grad, ReduceOp.AVG)
        opt.step()
        mean_loss = loss.detach().clone()
        backend.all_reduce(mean_loss, ReduceOp.AVG)
        losses.append(mean_loss.item())
        if backend.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {mean_loss.item():.4f}")
    return losses


if __name__ == "__main__":
    losses = run_world(WORLD_SIZE, train)[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} on {WORLD_SIZE} in-memory ranks")
