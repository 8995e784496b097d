"""The hybrid strategy's own communication (the layers' collectives are in ``_tensor_comm``, the stage
messages in ``_pipeline_comm``, the dp reduction in the data-parallel strategies):

- :func:`sum_over_tp`: sequence parallelism leaves the gradients of replicated parameters used inside
  the sequence-split region (norms, row-parallel biases) as partial sums over tp: one all-reduce of
  all of them, concatenated;
- :func:`gather_over_tp`: a whole tensor from every tp rank's shard (``full_state_dict``);
- :func:`broadcast_over_pp`: a tensor from the pipeline rank that holds it (the loss of the last
  stage; the whole model's tensors for ``full_state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.core.placement import Shard

__all__ = ["broadcast_over_pp", "gather_over_tp", "sum_over_tp"]


def sum_over_tp(tensors: Sequence[torch.Tensor], tp: CommunicationBackend) -> None:
    """Replace each tensor by its sum over ``tp`` (in place; one all-reduce of them concatenated)."""
    tensors = [t for t in tensors if t.numel()]
    if tp.world_size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    tp.all_reduce(flat, ReduceOp.SUM)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def gather_over_tp(local: torch.Tensor, placement: Shard, tp: CommunicationBackend) -> torch.Tensor:
    """The whole tensor from every tp rank's shard ``local`` (collective over ``tp``)."""
    local = local.detach().contiguous()
    if tp.world_size == 1:
        return local.clone()
    gathered = torch.empty((tp.world_size, *local.shape), dtype=local.dtype, device=local.device)
    tp.all_gather(gathered.view(-1), local.view(-1))
    full_shape = list(local.shape)
    full_shape[placement.dim] *= tp.world_size
    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    for c in range(tp.world_size):
        parts = gathered[c].chunk(placement.sections, dim=placement.dim)
        for box, part in zip(placement.boxes(full_shape, c, tp.world_size), parts, strict=True):
            full[box.slices()] = part
    return full


def broadcast_over_pp(
    tensor: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    src: int,
    pp: CommunicationBackend,
) -> torch.Tensor:
    """``tensor`` of pipeline rank ``src`` on every pipeline rank (``tensor`` is ignored elsewhere)."""
    if pp.rank == src:
        if tensor is None:
            raise RuntimeError(f"pipeline rank {src} holds no tensor to broadcast")  # unreachable
        out = tensor.detach().contiguous().clone()
    else:
        out = torch.empty(tuple(shape), dtype=dtype, device=pp.device)
    if pp.world_size > 1:
        pp.broadcast(out, src)
    return out
