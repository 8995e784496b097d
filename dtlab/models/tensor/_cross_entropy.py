"""The vocabulary-parallel cross entropy (Megatron-LM's): the loss of logits split over tp along
the class dim, without ever building the whole ``(..., V)`` logits."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError
from dtlab.models.tensor._split_logits import unmarked

__all__ = ["vocab_parallel_argmax", "vocab_parallel_cross_entropy", "whole_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: three all-reduces of one scalar per position (max, target logit, sum of exp);
    backward: none (softmax minus the one-hot of the target, on this rank's classes)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: CommunicationBackend, ignore_index: int
    ) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # bf16/fp16: in fp32
        m = x.max(dim=-1).values
        group.all_reduce(m, ReduceOp.MAX)
        shifted = x - m.unsqueeze(-1)
        local = targets - start
        mine = (local >= 0) & (local < per_rank)
        idx = local.masked_fill(~mine, 0)
        picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0).contiguous()
        group.all_reduce(picked, ReduceOp.SUM)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp, ReduceOp.SUM)
        valid = targets != ignore_index
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, mine & valid, valid, count)
        ctx.in_dtype = logits.dtype
        return loss.sum() / count.clamp(min=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if torch.is_grad_enabled():  # create_graph=True: this gradient would hold no graph of the logits
            raise StrategyError(
                "the vocabulary-parallel cross entropy (model.cross_entropy on logits split over tp) has no "
                "second derivative: a backward that builds a graph (create_graph=True: a gradient penalty) "
                "would take its gradient for a constant, a wrong penalty gradient. Gather the head's output "
                "in the plan ('colwise_gather_output') and use F.cross_entropy for such a loss"
            )
        softmax, idx, mine, valid, count = ctx.saved_tensors
        grad = softmax.clone()  # the saved softmax stays intact for a retained graph
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))  # minus the one-hot
        grad.mul_(valid.unsqueeze(-1).to(grad.dtype))
        grad.mul_(g / count.clamp(min=1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: CommunicationBackend, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross entropy of logits split over ``group`` along the class dim (the last), equal to
    ``F.cross_entropy(full_logits.reshape(-1, V), targets.reshape(-1))``.

    ``logits``: ``(..., V/tp)``, this rank's classes ``[rank*V/tp, (rank+1)*V/tp)``; ``targets``:
    ``(...)`` class ids in ``[0, V)`` (``ignore_index`` positions are left out of the mean). Costs three
    all-reduces of one value per position, never the ``(..., V)`` logits.
    """
    logits = unmarked(logits)  # the model's output (SplitLogits): this is the loss made for it
    if targets.shape != logits.shape[:-1]:
        raise StrategyError(
            f"vocab_parallel_cross_entropy: targets of shape {tuple(targets.shape)} do not match logits of "
            f"shape {tuple(logits.shape)} (expected targets of shape {tuple(logits.shape[:-1])})"
        )
    vocab = logits.shape[-1] * group.world_size
    valid = targets[targets != ignore_index]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
        raise StrategyError(
            f"vocab_parallel_cross_entropy: target ids span [{int(valid.min())}, {int(valid.max())}] but the "
            f"vocabulary is {vocab} ({logits.shape[-1]} classes x tp={group.world_size})"
        )
    loss = _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index)  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, loss)


def whole_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """``F.cross_entropy`` of whole ``(..., V)`` logits (bitwise its mean), but 0 with zero gradients where
    every target is ``ignore_index`` (``F.cross_entropy`` gives NaN), as
    :func:`vocab_parallel_cross_entropy` does."""
    flat = targets.reshape(-1)
    summed = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index, reduction="sum"
    )
    return summed / (flat != ignore_index).sum().clamp(min=1)


def vocab_parallel_argmax(logits: torch.Tensor, group: CommunicationBackend) -> torch.Tensor:
    """``argmax(-1)`` of logits split over ``group`` along the class dim, as of the whole logits (the
    first of equal maxima, as torch's): each rank's maximum and its class id, then one all-gather of
    both (two values per position), never the ``(..., V)`` logits."""
    local = unmarked(logits).detach()
    values, index = local.max(dim=-1)
    index = index + group.rank * local.shape[-1]
    both = torch.stack([values.to(torch.float64), index.to(torch.float64)])  # class ids < 2**53
    rows = torch.empty((group.world_size, *both.shape), dtype=both.dtype, device=both.device)
    group.all_gather(rows.view(-1), both.reshape(-1))
    best = rows[:, 0].argmax(dim=0)  # the first rank holding the maximum: the lowest class id
    return rows[:, 1].gather(0, best.unsqueeze(0)).squeeze(0).to(torch.long)
