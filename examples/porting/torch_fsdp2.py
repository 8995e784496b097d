"""A torch FSDP2 script (torchrun --nproc-per-node 2 torch_fsdp2.py); dtlab_fsdp.py is its port."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), Block(64), Block(64), nn.Linear(64, 4))
    for block in (model[1], model[2]):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # every rank evaluates (each on its own data)
        val = nn.functional.cross_entropy(model(x), y)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, "fsdp.pt")
        print(f"{sum(p.numel() for p in model.parameters())} parameters, val loss {val.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
