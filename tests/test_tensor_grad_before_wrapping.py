"""A ``.grad`` left on the plain module from before wrapping adds into the first synchronized gradient,
as under torch's DDP (tests/test_strategies_semantics.py), also under tensor parallelism. It was
dropped by every split layer (its new shard parameters started without it) and counted tp times by the
sequence-parallel norms and row-parallel biases (whole on every tp rank, then summed over tp): 0.5
relative error against one process in every such gradient at tp=2 (TransformerLM, the batch backward
twice). Now each split parameter starts with its part of the gradient, and a parameter whose gradient
is summed over tp keeps it on tp rank 0 only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hybrid_cases import OPTIMIZER_OF

from dtlab.backends import Mesh
from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.models import HybridShardedModel, ModuleClassPolicy, transformer_plan
from dtlab.testing import run_world
from dtlab.zoo import Block, TransformerLM

LR = 0.5


def _net() -> TransformerLM:
    with seeded_init(0):
        return TransformerLM(d_model=16, n_layers=1, n_heads=2, seq_len=8, dropout=0.0).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _one_process() -> dict[str, torch.Tensor]:
    net, (x, y) = _net(), _batch()
    _loss(net(x), y).backward()  # before wrapping: kept, no zero_grad
    _loss(net(x), y).backward()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    return net.state_dict()


def _world(backend: CommunicationBackend, data_parallel: str, sp: bool) -> dict[str, torch.Tensor]:
    net, (x, y) = _net(), _batch()
    _loss(net(x), y).backward()
    extra: dict[str, Any] = {"wrap_policy": ModuleClassPolicy((Block,))} if data_parallel == "fsdp" else {}
    plan = transformer_plan(sequence_parallel=sp)
    model = HybridShardedModel(net, Mesh(backend, {"tp": 2}), data_parallel, tensor_plan=plan, **extra)
    opt = OPTIMIZER_OF[data_parallel](model, torch.optim.SGD, lr=LR)
    model.cross_entropy(model(x), y).backward()
    opt.step()
    return model.full_state_dict()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_a_grad_left_from_before_wrapping_adds_once_into_the_first_step_under_tp(
    data_parallel: str, sp: bool
) -> None:
    want = _one_process()
    for rank, got in enumerate(run_world(2, _world, data_parallel, sp)):
        err = {k: float((got[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)) for k, v in want.items()}
        worst = max(err, key=err.__getitem__)
        assert err[worst] < 1e-9, f"rank {rank}: {worst} off by {err[worst]:.3g} relative to one process"
