"""The Trainer's default loss as one process computes it on the global batch: the mean over the step's
counted targets (target != -100), whatever the ranks, micro-batches and pipeline chunks.

Each call of the loss gives its own mean over its counted targets, and the strategies average those
means: the Trainer divides each micro-batch's loss by the accumulation steps, a pipeline each chunk's by
its micro-batches, data parallelism the ranks' gradients by dp. Where the calls hold different numbers of
counted targets, that is a mean of means. So the Trainer counts the step's counted targets ``n`` over
every micro-batch and dp rank first (one all-reduce of one number over dp; tensor- and pipeline-parallel
ranks of one dp coordinate hold the same batch, so each counts it alike) and multiplies each call's mean
by ``count * accumulation_steps * dp * micro_batches / n``: the call's summed loss times the averages'
factors over ``n``, which the averages then undo. The logged loss comes out the same way, the global
batch's mean. Where no target is -100 the factor is exactly 1.

A training set known to hold no -100 target (a tensor dataset, checked once before the first step, the
result agreed by every rank) skips the count: no collective. A global batch whose every target is -100
has loss 0 and zero gradients (the optimizer still steps, as a plain loop with ``sum / max(n, 1)``
would). A loss of your own (``model.loss=mse``, a Python ``loss_fn``) keeps its per-call meaning;
wrapped in :class:`SummedLoss` (its call's sum, and how to count its targets) it gets the same global
mean, counted at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Subset

from dtlab.backends.base import CommunicationBackend, ReduceOp
from dtlab.core.plan import RunPlan
from dtlab.errors import ArgumentTypeError
from dtlab.trainers.embedded import cross_entropy_loss
from dtlab.trainers.labels import IGNORE_INDEX

__all__ = ["SummedLoss", "TokenMean", "may_hold_ignored", "token_mean_for"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _targets_tensor(data: Any) -> torch.Tensor | None:
    """The whole target tensor of a tensor dataset (dtlab's ``targets``, torch's ``tensors[1]``; of a
    ``Subset``, its dataset's: a superset)."""
    if isinstance(data, Subset):
        return _targets_tensor(data.dataset)
    targets = getattr(data, "targets", None)
    if isinstance(targets, torch.Tensor):
        return targets
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2 and isinstance(tensors[1], torch.Tensor):
        return tensors[1]
    return None


def may_hold_ignored(data: Any, world: CommunicationBackend) -> bool:
    """Whether a target of ``data`` may be -100: False only for a tensor dataset holding none, agreed
    over ``world`` (collective: one all-reduce of one number; any rank unsure makes every rank count)."""
    targets = _targets_tensor(data)
    unsure = targets is None or targets.is_floating_point() or bool((targets == IGNORE_INDEX).any())
    if world.world_size == 1:
        return unsure
    flag = torch.tensor([int(unsure)], dtype=torch.int64, device=world.device)
    world.all_reduce(flag, ReduceOp.MAX)
    return bool(flag.item())


@dataclass(frozen=True)
class SummedLoss:
    """A loss of your own that the Trainer averages over the global batch's counted targets, as its
    default cross entropy: ``loss(output, target)`` returns the call's **sum** over its counted targets
    (``F.cross_entropy(..., reduction="sum")``), ``count(target)`` how many it counted (default: the
    targets that are not -100). The Trainer trains on the step's summed loss over the step's count, over
    every micro-batch, pipeline chunk and dp rank; evaluation reports the held-out sum over its count."""

    loss: LossFn
    count: Callable[[Any], torch.Tensor | int] | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise ArgumentTypeError(
                f"SummedLoss: loss must be a function of (output, target) returning the sum over its counted "
                f"targets, e.g. partial(F.cross_entropy, reduction='sum'), got {self.loss!r}"
            )
        if self.count is not None and not callable(self.count):
            raise ArgumentTypeError(
                f"SummedLoss: count must be a function of target giving how many it counted (or None: the "
                f"targets that are not -100), got {self.count!r}"
            )

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss(output, target)


class TokenMean:
    """Counts a step's targets and weights each call of the loss by its share of them (see the module).
    ``micro_batches``: the pipeline's micro-batches per Trainer micro-batch (1 without one);
    ``counting``: False where no target can be -100 (every call's factor is then 1: nothing to do);
    ``summed``: the loss a :class:`SummedLoss` (each call's sum), else a mean over its call's counted
    targets, 0 where there are none (the default cross entropy)."""

    def __init__(
        self,
        dp: CommunicationBackend,
        accumulation_steps: int,
        micro_batches: int,
        counting: bool,
        summed: SummedLoss | None = None,
    ) -> None:
        self.dp, self.counting, self.summed = dp, counting, summed
        self.accumulation_steps, self.micro_batches = accumulation_steps, micro_batches

    def count(self, target: Any) -> torch.Tensor:
        """The counted targets of one call (or micro-batch)."""
        if self.summed is not None and self.summed.count is not None:
            return torch.as_tensor(self.summed.count(target))
        counted: torch.Tensor = (target != IGNORE_INDEX).sum()
        return counted

    def step_count(self, micro: Sequence[Any]) -> torch.Tensor | None:
        """``n``, the counted targets of the step's micro-batches over every dp rank, as a float64
        tensor (collective over dp: every rank calls it at every step); None when not counting."""
        if not self.counting:
            return None
        counts = [self.count(batch[1]).to(device=self.dp.device, dtype=torch.float64) for batch in micro]
        n = torch.stack(counts).sum().reshape(1)
        if self.dp.world_size > 1:
            self.dp.all_reduce(n, ReduceOp.SUM)
        return n

    def weighted(self, loss_fn: LossFn, n: torch.Tensor | None) -> LossFn:
        """``loss_fn`` times the averages' factors over the step's ``n`` counted targets (a mean first
        times its call's count); ``loss_fn`` itself when ``n`` is None."""
        if n is None:
            return loss_fn
        times = self.accumulation_steps * self.dp.world_size * self.micro_batches
        whole = n.clamp(min=1)  # every target -100: every call's sum is 0, so its loss 0
        summed = self.summed is not None

        def loss(output: Any, target: Any) -> torch.Tensor:
            value = loss_fn(output, target)
            count = 1 if summed else self.count(target).to(device=whole.device, dtype=torch.float64)
            share = (count * times / whole).reshape(())
            return value * share.to(device=value.device, dtype=value.dtype)

        return loss

    def eval_terms(self, value: float, target: Any) -> tuple[float, float]:
        """An evaluation call's part of the held-out mean: (its summed loss, its counted targets)."""
        count = float(self.count(target))
        return (value if self.summed is not None else value * count), count


def token_mean_for(
    loss_fn: LossFn,
    train_data: Any,
    world: CommunicationBackend,
    dp: CommunicationBackend,
    accumulation_steps: int,
    plan: RunPlan,
) -> TokenMean | None:
    """The weighting of the Trainer's default loss (the task's ``loss_fn`` is dtlab's cross entropy,
    the vocabulary-parallel one under tensor parallelism included) or of a :class:`SummedLoss`; None for
    any other loss of your own (collective over ``world`` for the default loss: :func:`may_hold_ignored`)."""
    micro_batches = plan.micro_batch_count if plan.pipelined else 1
    if isinstance(loss_fn, SummedLoss):  # counted at every step: its count is its own
        return TokenMean(dp, accumulation_steps, micro_batches, True, loss_fn)
    if loss_fn is not cross_entropy_loss:
        return None
    return TokenMean(dp, accumulation_steps, micro_batches, may_hold_ignored(train_data, world))
