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
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from dtlab.errors import StrategyError

__all__ = ["SplitLogits", "as_split_logits", "unmarked"]

_T = torch.Tensor


def _refused() -> frozenset[Callable[..., Any]]:
    """What reduces over the class dim as if it were whole (functions and their Tensor methods)."""
    return frozenset({
        F.cross_entropy, F.nll_loss, F.log_softmax, F.softmax, F.gumbel_softmax,
        torch.log_softmax, torch.softmax, torch.logsumexp, torch.argmax, torch.topk,
        torch.Tensor.log_softmax, torch.Tensor.softmax, torch.Tensor.logsumexp, torch.Tensor.argmax,
        torch.Tensor.topk, torch.special.log_softmax, torch.special.softmax, torch.special.logsumexp,
        F.softmin, F.multi_margin_loss, F.multilabel_margin_loss, F.multilabel_soft_margin_loss,
    })  # fmt: skip


def _over_dim() -> dict[Callable[..., Any], int | None]:
    """Reductions refused over the class dim or the whole tensor: each with its default dim."""
    whole = (torch.max, _T.max, torch.min, _T.min, torch.amax, _T.amax, torch.amin, _T.amin, torch.argmin,
             _T.argmin, torch.mean, _T.mean, torch.nanmean, _T.nanmean, torch.std, _T.std, torch.var, _T.var,
             torch.median, _T.median, torch.aminmax, _T.aminmax)  # fmt: skip
    last = (torch.sort, _T.sort, torch.argsort, _T.argsort, torch.logcumsumexp, _T.logcumsumexp)
    return {**dict.fromkeys(whole, None), **dict.fromkeys(last, -1)}


def _sums() -> frozenset[Callable[..., Any]]:
    return frozenset({torch.sum, _T.sum, torch.nansum, _T.nansum})


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

    refused: ClassVar[frozenset[Callable[..., Any]]] = _refused()
    over_dim: ClassVar[dict[Callable[..., Any], int | None]] = _over_dim()
    sums: ClassVar[frozenset[Callable[..., Any]]] = _sums()

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
