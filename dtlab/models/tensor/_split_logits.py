"""The output of a tensor plan that leaves the head split over tp (``"colwise"``, dtlab's transformer):
this rank's ``V/tp`` of the logits' classes, marked as :class:`SplitLogits`.

A loss or a decoding step over the class dim on it (``F.cross_entropy``, ``softmax``, ``argmax``, ...)
would see one rank's classes only: a loss that differs between tp ranks and a wrong gradient with no
error where the targets fall below ``V/tp``, or torch's "Target out of bounds" where they do not. The
mark survives the ops after the head (``reshape``, ``float()``, a Hugging Face output's ``logits``), and
those reductions refuse it, naming ``model.cross_entropy`` (which unmarks it) and the gathering style.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from dtlab.errors import StrategyError

__all__ = ["SplitLogits", "as_split_logits", "unmarked"]


def _refused() -> frozenset[Callable[..., Any]]:
    """What reduces over the class dim as if it were whole (functions and their Tensor methods)."""
    return frozenset({
        F.cross_entropy, F.nll_loss, F.log_softmax, F.softmax, F.gumbel_softmax,
        torch.log_softmax, torch.softmax, torch.logsumexp, torch.argmax, torch.topk,
        torch.Tensor.log_softmax, torch.Tensor.softmax, torch.Tensor.logsumexp, torch.Tensor.argmax,
        torch.Tensor.topk,
    })  # fmt: skip


class SplitLogits(torch.Tensor):
    """Logits split over tp along the last dim (see the module docstring); a plain tensor otherwise."""

    refused: ClassVar[frozenset[Callable[..., Any]]] = _refused()

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in cls.refused:
            name = getattr(func, "__name__", str(func))
            raise StrategyError(
                f"{name} on the model's output: the tensor plan leaves the head split over tp ('colwise'), "
                "so the output's last dim is this rank's part of the classes and it would see only those (a "
                "loss that differs between the tp ranks, a wrong gradient or token). Use "
                "model.cross_entropy(logits, targets) (the cross entropy over the whole vocabulary, without "
                "gathering the logits), or gather the head's output in the plan ('colwise_gather_output')"
            )
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]

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
