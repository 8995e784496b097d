"""Random draws in ``DataLoader`` worker processes (a dataset's augmentation) keyed by each sample's
place in the epoch, so a run resumed mid-epoch draws what the uninterrupted run drew.

torch seeds a worker once per ``iter(loader)`` (``base_seed + worker_id``) and the worker's generators
then advance sample after sample. A resumed run starts a new iterator at the saved position with a
fresh base seed and with worker ``w`` handed other batches than before, so every augmented sample after
the resume would differ from the uninterrupted run's. Here each sample's fetch, in a worker, first seeds
torch's, Python's and NumPy's global generators from ``(train.seed, epoch, position)``, the position
being the sample's place in the epoch's order over all ranks: the draws depend on neither the resume
point nor the number of workers (nor the world size). Without workers (``num_workers=0``) the samples
are fetched on the rank itself (:class:`ThreadFetch`), each seeded from its key as in a worker and the
generators' states put back after (the rank's dropout stream is untouched): the draws of
``num_workers > 0``, bitwise, on in-memory ranks and in launched processes alike, so the same config
trains alike in memory, under torchrun or mpiexec, and resumed at any world size. In-memory ranks are
threads sharing those generators: there each micro-batch is fetched alone in the process (the lock
model builds take). Held-out samples (evaluation) are fetched alike (:func:`held_out_batch`), each row
seeded by its index.

A dataset that fetches a batch at once (its own ``__getitems__``, which torch's loader calls with the
batch's indices instead of ``__getitem__`` per sample: Hugging Face's datasets) keeps it
(:class:`SeededBatches`): it draws for the whole batch in one call, so no per-sample key can reach its
draws; the batch's are seeded by the key of its first sample. That is exact on a resume whose
micro-batches hold the same samples (the same data-parallel size and ``data.accumulation_steps``), with
any number of workers; at another layout the batches, and so their draws, are not the uninterrupted
run's (:class:`~dtlab.trainers.feed.DataFeed` notes it at the resume). torch's ``Subset`` and
``StackDataset`` fetch a batch at once only where what they hold does.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, StackDataset, Subset, default_collate, get_worker_info

from dtlab.core.rng import model_building
from dtlab.data import DistributedSampler, fetch

__all__ = [
    "PlacedSampler",
    "SeededBatches",
    "SeededFetch",
    "ThreadFetch",
    "alone",
    "fetches_batches",
    "held_out_batch",
    "sample_seed",
    "seeded_fetch",
]

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
            _seed(sample_seed(seed, epoch, place))
        return self.dataset[index]


class SeededBatches(SeededFetch):
    """:class:`SeededFetch` of a dataset that fetches a batch at once: ``dataset.__getitems__`` of the
    batch's indices, in a worker after seeding the generators from the key of its first sample."""

    def __getitems__(self, keys: list[Key]) -> list[Any]:
        if keys and get_worker_info() is not None:
            (seed, epoch, place), _ = keys[0]
            _seed(sample_seed(seed, epoch, place))
        return list(self.dataset.__getitems__([index for _, index in keys]))


class ThreadFetch(SeededFetch):
    """A rank's fetch without workers (``data.num_workers=0``): the samples of a micro-batch, each after
    seeding torch's, Python's and NumPy's global generators from its key as a worker does (a dataset
    that fetches batches: its ``__getitems__`` once, seeded from the first sample's key), the
    generators' states put back after. ``shared``: the generators are shared with other ranks (an
    in-memory rank, a thread), so the micro-batch is fetched under the process-wide lock model builds
    take; a launched rank (its own process) takes none. torch's loader calls ``__getitems__`` once per
    micro-batch."""

    def __init__(self, dataset: Any, shared: bool = True) -> None:
        super().__init__(dataset)
        self.batched = fetches_batches(dataset)
        self.shared = shared

    def __getitem__(self, key: Key) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Key]) -> list[Any]:
        with alone(self.shared):
            if self.batched:
                if keys:
                    _seed(sample_seed(*keys[0][0]))
                return list(self.dataset.__getitems__([index for _, index in keys]))
            fetched = []
            for place, index in keys:
                _seed(sample_seed(*place))
                fetched.append(self.dataset[index])
            return fetched


#: the "epoch" of held-out samples' keys (a training epoch is >= 0)
HELD_OUT = -1


def held_out_batch(dataset: Any, rows: torch.Tensor, seed: int, shared: bool = True) -> Any:
    """``fetch(dataset, rows)`` (evaluation) with each row's draws seeded from ``(seed, HELD_OUT, row)``
    (a dataset with ``batch``: the batch's, from its first row), the generators put back after; alone
    in the process where they are ``shared`` (in-memory ranks): the same at every evaluation and in
    every run, in memory or launched, whatever the threads' timing."""
    with alone(shared):
        if callable(getattr(dataset, "batch", None)):
            _seed(sample_seed(seed, HELD_OUT, int(rows[0]) if len(rows) else 0))
            return fetch(dataset, rows)
        samples = []
        for row in rows.tolist():
            _seed(sample_seed(seed, HELD_OUT, row))
            samples.append(dataset[row])
        return default_collate(samples)


@contextmanager
def alone(shared: bool = True) -> Iterator[None]:
    """The block with torch's CPU generator, Python's and NumPy's global ones put back as they were
    after it; ``shared`` (threads share them): alone in the process among fetches and model builds
    (``model_building()``'s lock)."""
    with model_building() if shared else nullcontext():
        kept = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
        try:
            yield
        finally:
            torch.default_generator.set_state(kept[0])
            random.setstate(kept[1])
            np.random.set_state(kept[2])


def _seed(s: int) -> None:
    """Seed torch's CPU generator, Python's and NumPy's global ones with ``s``."""
    # torch's CPU generator: torch.manual_seed seeds every device's too, 85 us a call (1.5 us)
    torch.default_generator.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)


def fetches_batches(dataset: Any) -> bool:
    """Whether torch's loader fetches a batch of ``dataset`` by one call of its ``__getitems__``
    (``Subset`` and ``StackDataset`` define one that fetches per sample unless what they hold fetches
    batches)."""
    if not callable(getattr(dataset, "__getitems__", None)):
        return False
    own = getattr(type(dataset), "__getitems__", None)
    if own is Subset.__getitems__:
        return fetches_batches(dataset.dataset)
    if own is StackDataset.__getitems__:
        held = dataset.datasets
        return any(fetches_batches(d) for d in (held.values() if isinstance(held, dict) else held))
    return True


def seeded_fetch(dataset: Any) -> SeededFetch:
    """The seeded wrapper of ``dataset`` for a loader over :class:`PlacedSampler`'s keys."""
    return SeededBatches(dataset) if fetches_batches(dataset) else SeededFetch(dataset)
