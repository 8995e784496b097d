"""Datasets of ``(input, target)`` pairs: the in-memory :class:`TensorDataset` and :func:`fetch`, which
gathers a batch from any map-style torch ``Dataset``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

__all__ = ["TensorDataset", "fetch"]


class TensorDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``inputs[i], targets[i]`` for ``i`` along the first dimension (a map-style torch ``Dataset``)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        for name, t in (("inputs", inputs), ("targets", targets)):
            if not (isinstance(t, torch.Tensor) and t.dim() >= 1):
                got = "a 0-dim tensor" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(
                    f"TensorDataset: {name} must be a tensor with one row per sample (torch.as_tensor(...)), "
                    f"got {got}"
                )
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs hold {inputs.shape[0]} samples but targets {targets.shape[0]}; "
                "both need one row per sample"
            )
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]

    def split(self, eval_fraction: float) -> tuple[TensorDataset, TensorDataset]:
        """The last ``eval_fraction`` of the samples (in order) is held out for evaluation."""
        n_eval = max(1, int(len(self) * eval_fraction))
        cut = len(self) - n_eval
        if cut < 1:
            raise ValueError(f"eval_fraction={eval_fraction} leaves no training samples out of {len(self)}")
        return (
            TensorDataset(self.inputs[:cut], self.targets[:cut]),
            TensorDataset(self.inputs[cut:], self.targets[cut:]),
        )


def fetch(dataset: Any, indices: Sequence[int] | torch.Tensor) -> Any:
    """The batch of ``dataset`` at ``indices``: ``dataset.batch`` where it has one (one indexing per
    tensor), else ``default_collate`` of the samples (what a ``DataLoader`` does)."""
    batch = getattr(dataset, "batch", None)
    if callable(batch):
        return batch(torch.as_tensor(indices))
    return default_collate([dataset[int(i)] for i in indices])
