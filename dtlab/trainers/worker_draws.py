"""Random draws in ``DataLoader`` worker processes (a dataset's augmentation) keyed by each sample's
place in the epoch, so a run resumed mid-epoch draws what the uninterrupted run drew.

torch seeds a worker once per ``iter(loader)`` (``base_seed + worker_id``) and the worker's generators
then advance sample after sample. A resumed run starts a new iterator at the saved position with a
fresh base seed and with worker ``w`` handed other batches than before, so every augmented sample after
the resume would differ from the uninterrupted run's. Here each sample's fetch, in a worker, first seeds
torch's, Python's and NumPy's global generators from ``(train.seed, epoch, position)``, the position
being the sample's place in the epoch's order over all ranks: the draws depend on neither the resume
point nor the number of workers (nor the world size). With ``num_workers=0`` the rank's own generators
draw (restored from the checkpoint on the same world size and ``parallel.tp``), and nothing is seeded.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from dtlab.data import DistributedSampler

__all__ = ["PlacedSampler", "SeededFetch", "sample_seed"]

#: a sample's key: (seed, epoch, place in the epoch's order over all ranks) and its dataset index
Key = tuple[tuple[int, int, int], int]


def sample_seed(seed: int, epoch: int, place: int) -> int:
    """The seed of the sample at ``place`` of epoch ``epoch``'s order (a 63-bit hash of the three)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{place}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PlacedSampler(Sampler[Key]):
    """``sampler``'s indices, each with its key: this rank's ``k``-th index of the epoch (after
    ``start_at``) is the order's place ``k * num_replicas + rank``."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Key]:
        s = self.sampler
        # as the iteration starts (set before iter(loader)); the keys made as the loader asks for them
        first, seed, epoch, replicas, rank = s.start, s.seed, s.epoch, s.num_replicas, s.rank
        return (((seed, epoch, (first + k) * replicas + rank), int(i)) for k, i in enumerate(iter(s)))

    def __len__(self) -> int:
        return len(self.sampler)


class SeededFetch(Dataset[Any]):
    """``dataset[i]`` for a key of :class:`PlacedSampler`, in a worker after seeding its generators from
    the key (outside a worker, as given)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> Any:
        (seed, epoch, place), index = key
        if get_worker_info() is not None:
            s = sample_seed(seed, epoch, place)
            # torch's CPU generator: torch.manual_seed seeds every device's too, 85 us a call (1.5 us)
            torch.default_generator.manual_seed(s)
            random.seed(s)
            np.random.seed(s % 2**32)
        return self.dataset[index]
