"""A dataset of (input, target) tensor pairs indexed along the first dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorDataset"]


@dataclass(frozen=True)
class TensorDataset:
    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise ValueError(
                f"inputs hold {self.inputs.shape[0]} samples but targets {self.targets.shape[0]}; "
                "both need one row per sample"
            )

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

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
