"""Class labels checked where it is cheap: a target outside the model's output range is a
:class:`~dtlab.errors.DataError` naming the sample, the value and the range, never torch's bare
``IndexError: Target 300 is out of bounds.`` at some later step.

- Pre-flight (:func:`scan_labels`, from ``check_fit``): every target of a dataset of up to
  ``SCAN_ALL`` samples (the first ``SCAN_ALL`` of a larger one), training and held-out data, in batches.
- At a step (:func:`explain_loss_error`): when the loss raises, the micro-batch's targets are checked
  and an out-of-range one is named with its rank and its sample index in the dataset.

A target equal to ``IGNORE_INDEX`` (-100, torch's ``cross_entropy`` default) is not a class and is
never reported.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from dtlab.data import fetch
from dtlab.errors import DataError

__all__ = [
    "IGNORE_INDEX",
    "SCAN_ALL",
    "explain_loss_error",
    "first_bad_label",
    "refuse_unshifted_labels",
    "shifts_labels_inside",
    "scan_labels",
]

#: datasets up to this many samples have every target checked before the run starts
SCAN_ALL = 4096
IGNORE_INDEX = -100


def first_bad_label(targets: torch.Tensor, classes: int) -> tuple[int, int] | None:
    """``(row, value)`` of the first sample (row of dim 0) holding a target outside ``[0, classes)``."""
    if targets.is_floating_point() or targets.numel() == 0:
        return None
    t = targets.reshape(targets.shape[0], -1) if targets.dim() > 0 else targets.reshape(1, 1)
    bad = ((t < 0) & (t != IGNORE_INDEX)) | (t >= classes)
    rows = bad.any(dim=1).nonzero()
    if rows.numel() == 0:
        return None
    row = int(rows[0])
    return row, int(t[row][bad[row]][0])


def _range(classes: int) -> str:
    return f"the model's {classes} outputs (classes 0..{classes - 1}, or {IGNORE_INDEX} to ignore)"


def scan_labels(data: Any, classes: int, what: str) -> None:
    """Pre-flight: every target of ``data`` (up to ``SCAN_ALL`` samples) inside ``[0, classes)``."""
    n = min(len(data), SCAN_ALL)
    for start in range(0, n, 512):
        _, y = fetch(data, range(start, min(n, start + 512)))
        if not isinstance(y, torch.Tensor):
            return
        found = first_bad_label(y, classes)
        if found is not None:
            row, value = found
            raise DataError(
                f"{what} sample {start + row} has target {value}, outside {_range(classes)}; fix the "
                f"labels or the model's output size (checked: the first {n} of {len(data)} samples)"
            )


def shifts_labels_inside(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face model (a ``config``, and a ``forward`` taking ``labels=``,
    which it shifts inside): where targets equal to the inputs are its habit, not a copy task."""
    forward = getattr(model, "forward", None)
    if not hasattr(model, "config") or forward is None:
        return False
    try:
        return "labels" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def refuse_unshifted_labels(inputs: Any, targets: Any, what: str) -> None:
    """Pre-flight, for the default loss (logits at position t against target t): token targets equal to
    the inputs at every counted position are Hugging Face's ``labels`` (the model shifts them inside),
    which the default loss would train as "predict the token you are given" (on random tokens over 8
    values the loss fell to 0.55, below ln 8, where next-token prediction cannot go)."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return
    if inputs.shape != targets.shape or inputs.dim() < 2 or inputs.is_floating_point():
        return
    if targets.is_floating_point():
        return
    counted = targets != IGNORE_INDEX
    if int(counted.sum()) < 2 or not torch.equal(inputs[counted], targets[counted]):
        return
    raise DataError(
        f"{what}: the targets equal the inputs at every counted position (Hugging Face's labels, which "
        "the model shifts inside); the default loss compares the logits at position t with target t, so "
        "it would train the model to repeat its input. Give next-token pairs (input_ids[:-1], "
        "labels[1:]), or a loss that shifts: loss_fn= / model.loss=package.module:function, e.g. "
        "dtlab.trainers.SummedLoss of a cross entropy of out.logits[:, :-1] against labels[:, 1:] "
        '(docs/your_model.md, "Hugging Face habits")'
    )


def explain_loss_error(
    out: Any, targets: Any, rank: int, indices: Sequence[int] | None, exc: BaseException
) -> DataError | None:
    """The named error for a loss that raised on out-of-range targets; ``None`` when that is not why."""
    if not isinstance(out, torch.Tensor) or not isinstance(targets, torch.Tensor) or out.dim() == 0:
        return None
    if out.dim() != targets.dim() + 1:
        return None
    found = first_bad_label(targets.detach().cpu(), int(out.shape[-1]))
    if found is None:
        return None
    row, value = found
    where = (
        f"sample {indices[row]} of the training data"
        if indices is not None and row < len(indices)
        else (f"row {row} of the batch")
    )
    return DataError(
        f"rank {rank}: {where} has target {value}, outside {_range(int(out.shape[-1]))} "
        f"(the loss raised {type(exc).__name__}: {exc}); fix the labels or the model's output size"
    )
