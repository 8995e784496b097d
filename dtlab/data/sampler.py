"""A distributed sampler in the spirit of ``torch.utils.data.DistributedSampler``, resumable mid-epoch.

Each step takes the next ``global_batch_size`` indices of the epoch's permutation (seeded by
``seed + epoch``, so every rank computes the same one without communicating). Rank ``r`` takes the
``r``-th contiguous block of ``global_batch_size / world_size`` indices and splits it into
``accumulation_steps`` micro-batches. The global batch of a step does not depend on the world size,
so a run resumed at another world size sees the same data. The tail of an epoch shorter than a
global batch is dropped.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DistributedSampler"]


class DistributedSampler:
    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        world_size: int,
        rank: int,
        accumulation_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        per_step = world_size * accumulation_steps
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by world_size x "
                f"accumulation_steps = {world_size} x {accumulation_steps}"
            )
        if num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}; "
                "lower data.global_batch_size or use more data"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside [0, {world_size})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.accumulation_steps = accumulation_steps
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # samples of this epoch already consumed
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def next_global_batch(self) -> torch.Tensor:
        """Indices of the next global batch (the same on every rank); advances the position."""
        if self.offset + self.global_batch_size > self.num_samples:
            self.epoch += 1
            self.offset = 0
        idx = self._permutation()[self.offset : self.offset + self.global_batch_size]
        self.offset += self.global_batch_size
        return idx

    def next_micro_batches(self) -> list[torch.Tensor]:
        """This rank's ``accumulation_steps`` micro-batches of the next global batch."""
        idx = self.next_global_batch()
        local = self.global_batch_size // self.world_size
        mine = idx[self.rank * local : (self.rank + 1) * local]
        return list(mine.chunk(self.accumulation_steps))

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"the saved data position is for {state['num_samples']} samples but this dataset has "
                f"{self.num_samples}; resume with the same data settings"
            )
        self.epoch, self.offset, self.seed = int(state["epoch"]), int(state["offset"]), int(state["seed"])
