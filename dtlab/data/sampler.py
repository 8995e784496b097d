"""``DistributedSampler``: a ``torch.utils.data.Sampler``, a drop-in for torch's, resumable mid-epoch.

As torch's: ``DistributedSampler(dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False)``;
each epoch's order is ``randperm(len(dataset))`` seeded by ``seed + epoch`` (``set_epoch``), the same on
every rank without communicating; ``drop_last=False`` repeats the first indices so every rank gets as
many, ``drop_last=True`` drops the tail; rank ``r`` takes every ``num_replicas``-th index from ``r``.

So when each rank batches its indices ``B`` at a time, the ranks' batches of step ``s`` together are
the order's positions ``[s*G, (s+1)*G)`` with ``G = B * num_replicas``: the samples of a global batch do
not depend on the world size. :meth:`start_at` resumes an epoch after ``offset`` samples counted over
all ranks, so a run resumed at another world size continues with the same samples (the consumer
counts what it used: with DataLoader workers the sampler runs ahead of the training loop).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not torch.distributed.is_available() or not torch.distributed.is_initialized():
                raise ValueError(
                    "DistributedSampler: pass num_replicas and rank (e.g. backend.world_size and "
                    "backend.rank); they default to torch.distributed's only once it is initialized"
                )
            num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
            rank = torch.distributed.get_rank() if rank is None else rank
        for name, v in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"DistributedSampler: {name} must be an int, got {v!r}")
        if not isinstance(dataset, Sized):  # a generator or an iterable-style dataset: no len()
            raise TypeError(
                f"DistributedSampler needs a map-style dataset (with __len__), got {type(dataset).__name__}"
            )
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank={rank} outside [0, num_replicas={num_replicas})")
        self.dataset_size = len(dataset)
        # a NumPy integer as an int: torch.Generator.manual_seed takes no other (seed + epoch at iteration)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        n, p = self.dataset_size, num_replicas
        #: indices per rank per epoch (torch's rule)
        self.num_samples = math.ceil((n - p) / p) if drop_last and n % p else math.ceil(n / p)
        self.total_size = self.num_samples * p
        self.epoch = 0
        self.start = 0  # this rank's first index of the epoch (start_at)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from its beginning."""
        self.epoch, self.start = int(epoch), 0

    def start_at(self, offset: int) -> None:
        """Resume the current epoch after its first ``offset`` samples over all ranks (a multiple of
        ``num_replicas``): this rank skips its first ``offset / num_replicas`` indices."""
        if offset % self.num_replicas or not 0 <= offset <= self.total_size:
            raise ValueError(
                f"DistributedSampler.start_at({offset}): need a multiple of num_replicas="
                f"{self.num_replicas} within the epoch's {self.total_size} samples"
            )
        self.start = offset // self.num_replicas

    def order(self) -> torch.Tensor:
        """The epoch's order over all ranks (``total_size`` indices)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.dataset_size, generator=g)
        else:
            idx = torch.arange(self.dataset_size)
        if self.total_size > idx.numel():  # drop_last=False: repeat from the start, as torch does
            reps = math.ceil(self.total_size / max(1, idx.numel()))
            idx = idx.repeat(reps)
        return idx[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        mine = self.order()[self.rank : self.total_size : self.num_replicas]
        return iter(mine[self.start :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start
