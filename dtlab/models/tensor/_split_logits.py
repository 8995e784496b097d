"""The output of a tensor plan that leaves the head split over tp (``"colwise"``, dtlab's transformer):
this rank's ``V/tp`` of the logits' classes, marked as :class:`SplitLogits`.

A loss or a decoding step over the class dim on it (``F.cross_entropy``, ``softmax``, ``argmax``, ...)
would see one rank's classes only: a loss that differs between tp ranks and a wrong gradient with no
error where the targets fall below ``V/tp``, or torch's "Target out of bounds" where they do not. The
mark survives the ops after the head (``reshape``, ``float()``, a Hugging Face output's ``logits``), and
those reductions refuse it, naming ``model.cross_entropy`` (which unmarks it) and the gathering style.
Reductions that take a dim (``max``, ``sort``, ``mean``, ...) are refused only over the class dim or the
whole tensor (a ``mean`` there averages ``V/tp`` classes: a gradient ``tp`` times torch's); a ``sum``
over the classes is each rank's part of the whole sum (right gradients) and drops the mark.

What is made for it (Megatron-LM's): the vocabulary-parallel cross entropy and argmax, which never build
the whole ``(..., V)`` logits, and :func:`whole_cross_entropy`, the same mean on whole logits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.errors import StrategyError

__all__ = [
    "SplitLogits",
    "as_split_logits",
    "unmarked",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "whole_cross_entropy",
]

_T = torch.Tensor


def _dims(args: tuple[Any, ...], kwargs: dict[str, Any], default: int | None) -> Any:
    """The dim(s) a reduction call names: ``None`` for the whole tensor, ``"other"`` for element-wise use."""
    if "other" in kwargs or any(isinstance(a, torch.Tensor) for a in args[1:2]):
        return "other"  # torch.max(a, b): element-wise
    dim = kwargs.get("dim", args[1] if len(args) > 1 else default)
    return None if isinstance(dim, bool) else dim  # std(x, True): unbiased, the whole tensor


def _covers_classes(t: torch.Tensor, dim: Any) -> bool:
    if dim is None:
        return True
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return t.dim() > 0 and any(isinstance(d, int) and d % t.dim() == t.dim() - 1 for d in dims)


class SplitLogits(torch.Tensor):
    """Logits split over tp along the last dim (see the module docstring); a plain tensor otherwise."""

    #: what reduces over the class dim as if it were whole (functions and their Tensor methods)
    refused: ClassVar[frozenset[Callable[..., Any]]] = frozenset({
        F.cross_entropy, F.nll_loss, F.log_softmax, F.softmax, F.gumbel_softmax,
        torch.log_softmax, torch.softmax, torch.logsumexp, torch.argmax, torch.topk,
        torch.Tensor.log_softmax, torch.Tensor.softmax, torch.Tensor.logsumexp, torch.Tensor.argmax,
        torch.Tensor.topk, torch.special.log_softmax, torch.special.softmax, torch.special.logsumexp,
        F.softmin, F.multi_margin_loss, F.multilabel_margin_loss, F.multilabel_soft_margin_loss,
    })  # fmt: skip
    #: reductions refused over the class dim or the whole tensor, each with its default dim
    over_dim: ClassVar[dict[Callable[..., Any], int | None]] = {
        **dict.fromkeys((torch.max, _T.max, torch.min, _T.min, torch.amax, _T.amax, torch.amin, _T.amin,
                         torch.argmin, _T.argmin, torch.mean, _T.mean, torch.nanmean, _T.nanmean, torch.std,
                         _T.std, torch.var, _T.var, torch.median, _T.median, torch.aminmax, _T.aminmax),
                        None),
        **dict.fromkeys((torch.sort, _T.sort, torch.argsort, _T.argsort, torch.logcumsumexp,
                         _T.logcumsumexp), -1),
    }  # fmt: skip
    sums: ClassVar[frozenset[Callable[..., Any]]] = frozenset({torch.sum, _T.sum, torch.nansum, _T.nansum})

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in cls.sums and args and _covers_classes(args[0], _dims(args, kwargs, None)):
            return unmarked(super().__torch_function__(func, types, args, kwargs))  # type: ignore[no-untyped-call]
        over = (
            func in cls.over_dim
            and args
            and _covers_classes(args[0], _dims(args, kwargs, cls.over_dim[func]))
        )
        if func in cls.refused or over:
            name = getattr(func, "__name__", str(func))
            raise StrategyError(
                f"{name} on the model's output: the tensor plan leaves the head split over tp ('colwise'), "
                "so the output's last dim is this rank's part of the classes and it would see only those (a "
                "loss that differs between the tp ranks, a wrong gradient or token). Use "
                "model.cross_entropy(logits, targets) (the cross entropy over the whole vocabulary, without "
                "gathering the logits), or gather the head's output in the plan ('colwise_gather_output')"
            )
        return super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved (torch.save, pickle) as the plain tensor it is
        return unmarked(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:  # a copy is plain values
        return copy.deepcopy(unmarked(self), memo)


def as_split_logits(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked (autograd flows through the mark)."""
    return t.as_subclass(SplitLogits)


def unmarked(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (autograd flows through)."""
    return t.as_subclass(torch.Tensor) if isinstance(t, SplitLogits) else t


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
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise StrategyError(
            f"vocab_parallel_cross_entropy: targets are class ids (an integer tensor, e.g. torch.long), got "
            f"{targets.dtype}; pass targets.long() (class probabilities are not supported)"
        )
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
