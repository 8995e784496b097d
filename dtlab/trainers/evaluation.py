"""Evaluation of a :class:`~dtlab.trainers.Trainer`'s model on held-out data: the mean loss (and accuracy
for classification), the same on every rank."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch

from dtlab.backends.base import ReduceOp
from dtlab.models.tensor import vocab_parallel_argmax
from dtlab.trainers.run_view import ForwardRun
from dtlab.trainers.tasks import Task, logits_of
from dtlab.trainers.token_mean import TokenMean

__all__ = ["EvalRun", "evaluate"]

#: a target left out of the loss and of the accuracy (torch's ``ignore_index`` default)
IGNORED = -100


class EvalRun(ForwardRun, Protocol):
    """What evaluation reads of a run (a Trainer is one)."""

    @property
    def task(self) -> Task: ...
    @property
    def token_mean(self) -> TokenMean | None: ...


def predicted(model: object, logits: torch.Tensor) -> torch.Tensor:
    """The class each position's logits pick: over the whole vocabulary where a tensor-parallel model's
    logits are split over tp (each rank holds part of the classes)."""
    if getattr(model, "logits_split", False):
        return vocab_parallel_argmax(logits, cast(Any, model).tp_group)
    return logits.argmax(-1)


@torch.no_grad()
def evaluate(trainer: EvalRun) -> dict[str, float]:
    """Mean loss (and accuracy for classification) over ``train.eval_batches`` held-out batches; with
    the default loss, the samples after the last whole batch too (within ``train.eval_batches``), as one
    more batch whose padding rows' targets are -100.

    Every rank runs the same number of equal batches (sharded strategies gather in forward); each
    data-parallel rank takes its own slice of each batch, and the sums travel over the dp group. The
    default loss (and a ``SummedLoss``): the mean over every held-out counted target (not -100; 0 where
    there is none); any other loss of your own: its batches' values averaged, weighted by their samples."""
    data, dp, model, task = trainer.task.eval_data, trainer.dp, trainer.model, trainer.task
    p = dp.world_size
    n, asked = len(data), trainer.config.train.eval_batches
    local = max(1, min(trainer.config.data.global_batch_size // p, n // p))
    whole = n // (local * p)
    tokens = trainer.token_mean
    # the held-out samples after the last whole batch: one more batch, its padding rows' targets -100
    # (counted 0), where the mean is over counted targets (the default loss); others keep whole batches
    padded = tokens is not None and tokens.summed is None and whole < asked and n % (local * p) > 0
    batches = min(asked, whole + 1) if padded else max(1, min(asked, whole))
    device = trainer.backend.device
    model.eval()
    total = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, its weight, correct, labels
    try:
        for b in range(batches):
            start = (b * p + dp.rank) * local
            rows = torch.arange(start, start + local)
            x, y = trainer.feed.held_out(data, rows.clamp(max=n - 1))
            if b == whole:  # the padded batch (the same on every rank: every rank stops or runs it)
                if not isinstance(y, torch.Tensor) or y.is_floating_point():
                    break  # no -100 to put in a float target: the whole batches only
                y = y.masked_fill((rows >= n).reshape(-1, *[1] * (y.dim() - 1)), IGNORED)
            x, y = trainer.feed.to_device((x, y))
            with trainer.precision.autocast(device.type):
                out = model(x)
                loss = trainer.loss_fn(out, y)
            value, weight = (
                (float(loss) * local, local) if tokens is None else tokens.eval_terms(float(loss), y)
            )
            total[0] += value
            total[1] += weight
            if task.classification:
                total[2] += float((predicted(model, logits_of(out)) == y).sum())
                total[3] += float((y != IGNORED).sum())  # every label of a sequence; none left out (-100)
    finally:
        model.train()
    dp.all_reduce(total, ReduceOp.SUM)
    result = {"eval_loss": float(total[0] / total[1].clamp(min=1))}
    if task.classification and total[3] > 0:  # (every held-out label -100: no accuracy to report)
        result["eval_accuracy"] = float(total[2] / total[3])
    return result
