"""torch_fsdp2.py ported to dtlab (torchrun --nproc-per-node 2 dtlab_fsdp.py, or mpiexec, or python)."""

import torch
from torch import nn

from dtlab.backends import init_backend
from dtlab.models import FSDPModel, ModuleClassPolicy
from dtlab.optimizers import ZeRO3Optimizer


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def main() -> None:
    backend = init_backend()
    rank = backend.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), Block(64), Block(64), nn.Linear(64, 4))
    model = FSDPModel(model, backend, wrap_policy=ModuleClassPolicy((Block,)))
    opt = ZeRO3Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # every rank evaluates (each on its own data)
        val = nn.functional.cross_entropy(model(x), y)
    full = model.state_dict()
    if rank == 0:
        torch.save(full, "fsdp.pt")
        print(f"{sum(p.numel() for p in model.parameters())} parameters, val loss {val.item():.4f}")
    backend.close()


if __name__ == "__main__":
    main()
