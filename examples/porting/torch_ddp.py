"""A torch DDP script (torchrun --nproc-per-node 2 torch_ddp.py); dtlab_ddp.py is its dtlab port."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        for micro in range(2):  # accumulate 2 micro-batches, synchronize on the last
            model.require_backward_grad_sync = micro == 1
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y) / 2
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    state = {"model": model.module.state_dict(), "opt": opt.state_dict()}
    if rank == 0:
        torch.save(state, "ddp.pt")
        print(f"{sum(p.numel() for p in model.parameters())} parameters, last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
