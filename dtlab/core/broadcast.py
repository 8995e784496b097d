"""Tensors set to rank 0's values over a group, in place: what a model strategy does with the buffers
before each forward with gradients (torch DDP's ``broadcast_buffers``) and with parameters when it
wraps a module.

Small tensors travel together, one message per dtype and device (a model with 50 BatchNorm layers
sends 1 message per forward, not 150); a large contiguous one (a DDP bucket) goes alone, with no copy.
Under ``torch.compile`` the broadcast runs eagerly (a graph break): a collective is never traced.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

from dtlab.backends.base import CommunicationBackend

__all__ = ["broadcast_from_rank0"]

#: elements from which a contiguous tensor is broadcast alone, in place (below: concatenated with others)
ALONE = 1 << 16


def broadcast_from_rank0(tensors: Iterable[torch.Tensor], group: CommunicationBackend) -> None:
    """Every tensor takes group rank 0's values, in place (one that appears twice, tied, is sent once)."""
    if group.world_size == 1:
        return
    if "torch._dynamo" in sys.modules:  # torch.compile loaded (disable() would load it: seconds)
        torch.compiler.disable(_broadcast)(tensors, group)
    else:
        _broadcast(tensors, group)


def _broadcast(tensors: Iterable[torch.Tensor], group: CommunicationBackend) -> None:
    together: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    with torch.no_grad():
        # a complex tensor travels as its real pairs (the engines move real dtypes), written in place
        for t in {
            id(t): torch.view_as_real(t) if t.is_complex() else t for t in tensors if t.numel()
        }.values():
            if t.numel() >= ALONE and t.is_contiguous():
                group.broadcast(t.detach(), 0)
            else:
                together.setdefault((t.dtype, t.device), []).append(t)
        for same in together.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            group.broadcast(flat, 0)
            for t, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(part.view_as(t))
