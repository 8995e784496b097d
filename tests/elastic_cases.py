"""The elastic optimizer's tests' small FSDP model and how they read its whole state back."""

from __future__ import annotations

import torch
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.shard_index import ShardIndex
from dtlab.models import FSDPModel
from dtlab.optimizers import ZeRO3Optimizer
from dtlab.optimizers.elastic import ElasticOptimizer, StaticMember


def small_net() -> nn.Module:
    return filled(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)), 0, scale=0.3)


def elastic_fsdp(backend: CommunicationBackend, member: StaticMember, copy_to: int = 1) -> ElasticOptimizer:
    """:func:`small_net` under FSDP and ZeRO-3 AdamW, committing every 2 steps to ``member``'s store."""
    inner = ZeRO3Optimizer(FSDPModel(small_net(), backend), torch.optim.AdamW, lr=0.05)
    return ElasticOptimizer(inner, commit_every=2, member=member, copy_to=copy_to)


def full_state(opt: ElasticOptimizer) -> dict[str, torch.Tensor]:
    """Every rank's model and optimizer shards, gathered and read back as full tensors (collective)."""
    out = {}
    for kind, shard in (("m", opt.model.sharded_state_dict()), ("o", opt.inner.sharded_state_dict())):
        index = ShardIndex(opt.model.backend.all_gather_object(shard))
        out.update({f"{kind}.{k}": index.full(k) for k in index.keys()})
    return out
