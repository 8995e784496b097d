"""``DataFeed``: the trainer's input pipeline on one rank, a torch ``DataLoader`` over any map-style
dataset with :class:`dtlab.data.DistributedSampler`, and the data position that checkpoints keep.

Each step takes ``accumulation_steps`` micro-batches of ``global_batch_size / (world_size x
accumulation_steps)`` samples from this rank's loader (workers and pinned memory as configured). The
ranks' batches of one step together are always the epoch order's next ``global_batch_size`` samples,
whatever the world size, so the position ``(epoch, offset)`` — samples of the epoch consumed over all
ranks — resumes exactly, also at another world size. An epoch ends after its last whole global batch.
Each sample's random draws (a dataset's augmentation) are seeded by its place in the epoch, with or
without workers (``worker_draws.py``). ``threads``: this rank is a thread of an in-memory world, sharing
the process's generators with the other ranks: without workers its fetches then take a process-wide
lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from dtlab.data import DistributedSampler
from dtlab.errors import DataError
from dtlab.trainers.worker_draws import (
    PlacedSampler,
    ThreadFetch,
    fetches_batches,
    held_out_batch,
    seeded_fetch,
)

__all__ = ["DataFeed"]


class DataFeed:
    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        world_size: int,
        rank: int,
        accumulation_steps: int = 1,
        *,
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        threads: bool = False,
    ) -> None:
        per_step = world_size * accumulation_steps
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by world_size x "
                f"accumulation_steps = {world_size} x {accumulation_steps}"
            )
        self.num_samples = len(dataset)
        if self.num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{global_batch_size}; lower data.global_batch_size or use more data"
            )
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.seed = seed
        self.dataset, self.world_size, self.rank, self.shuffle = dataset, world_size, rank, shuffle
        self.threads = threads
        self.device = device or torch.device("cpu")
        self.sampler = DistributedSampler(
            dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.steps_per_epoch = self.sampler.num_samples // (global_batch_size // world_size)
        self.pin_memory = pin_memory and self.device.type == "cuda"
        # a sample's random draws (augmentation) are seeded by its place in the epoch, in worker
        # processes and on the rank alike (worker_draws.py): a resume mid-epoch draws what the
        # uninterrupted run drew, and in-memory and launched ranks draw alike; on the rank, the
        # generators put back after (its dropout stream untouched), under a lock where threads share them
        fetched = seeded_fetch(dataset) if num_workers else ThreadFetch(dataset, shared=threads)
        #: a batch fetched at once (the dataset's __getitems__), its draws seeded per batch
        self.batched = fetches_batches(dataset)
        self.micro_batch = global_batch_size // per_step  # samples of one micro-batch on this rank
        self.notes: list[str] = []  # what a resume (load_state_dict) cannot make as it was
        self.loader: DataLoader[Any] = DataLoader(
            fetched,
            batch_size=self.micro_batch,
            sampler=PlacedSampler(self.sampler),
            drop_last=True,
            num_workers=num_workers,
            pin_memory=self.pin_memory,
            # its own generator: the loader draws a seed per epoch (for workers), and torch's global RNG
            # is shared by in-memory ranks (threads), one of which may be building its model meanwhile
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.offset = 0  # samples of this epoch consumed over all ranks
        self._batches: Iterator[Any] | None = None
        self._last = (0, 0)  # (epoch, offset) of the step last fetched

    def next_micro_batches(self) -> list[Any]:
        """This rank's micro-batches of the next step, on the device; advances the position."""
        if self.offset >= self.steps_per_epoch * self.global_batch_size:
            self.epoch, self.offset, self._batches = self.epoch + 1, 0, None
        if self._batches is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start_at(self.offset)
            self._batches = iter(self.loader)
        self._last = (self.epoch, self.offset)
        micro = []
        for k in range(self.accumulation_steps):
            try:
                batch = next(self._batches)
            except Exception as exc:  # the dataset's own __getitem__ (or collate) failed: name the samples
                self._batches = None  # a loader that raised does not resume; the next call starts anew
                raise DataError(
                    f"rank {self.rank}: reading samples {self.step_indices(k)} of the training data "
                    f"({self.num_samples} samples) raised {type(exc).__name__}: {exc}; fix the dataset's "
                    "__getitem__ (or __getitems__, __len__)"
                ) from exc
            micro.append(self.to_device(batch))
        self.offset += self.global_batch_size
        return micro

    def step_indices(self, micro: int) -> list[int]:
        """The dataset indices of this rank's micro-batch ``micro`` of the step last fetched (for error
        messages: the sampler's order is rebuilt, the loader's iteration is not touched)."""
        epoch, offset = self._last
        sampler = DistributedSampler(
            self.dataset, self.world_size, self.rank, shuffle=self.shuffle, seed=self.seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        order = list(sampler)
        size = self.global_batch_size // (self.world_size * self.accumulation_steps)
        start = offset // self.world_size + micro * size
        return [int(i) for i in order[start : start + size]]

    def held_out(self, data: Any, rows: torch.Tensor) -> Any:
        """The batch of held-out ``data`` at ``rows`` (evaluation), each row's draws seeded by
        ``train.seed`` and its index (``worker_draws.held_out_batch``)."""
        return held_out_batch(data, rows, self.seed, shared=self.threads)

    def to_device(self, batch: Any) -> Any:
        """Every tensor of ``batch`` on this rank's device."""
        return tree_map(
            lambda t: t.to(self.device, non_blocking=self.pin_memory) if isinstance(t, torch.Tensor) else t,
            batch,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "ranks": self.world_size,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"the saved data position is for {state['num_samples']} samples but this dataset has "
                f"{self.num_samples}; resume with the same data settings"
            )
        offset = int(state["offset"])
        if offset % self.global_batch_size:
            raise ValueError(
                f"the saved data position (offset {offset}) is not a whole number of global batches of "
                f"{self.global_batch_size}; resume with the same data.global_batch_size"
            )
        shuffled = state.get("shuffle", self.shuffle)  # absent: saved before it was recorded
        if 0 < offset < self.steps_per_epoch * self.global_batch_size and shuffled != self.shuffle:
            was, now = str(shuffled).lower(), str(self.shuffle).lower()
            raise ValueError(
                f"the saved data position is {offset} samples into epoch {state['epoch']} of an order with "
                f"data.shuffle={was}, this run has data.shuffle={now}: the rest of the epoch would come "
                f"from another order (samples seen twice, others skipped); resume with data.shuffle={was}, "
                "or from a checkpoint at an epoch's end"
            )
        layout = (state.get("ranks"), state.get("micro_batch"))  # absent: saved before it was recorded
        if self.batched and None not in layout and layout != (self.world_size, self.micro_batch):
            self.notes.append(
                f"the training data fetches a batch at once (its __getitems__), each batch's random draws "
                f"seeded by its first sample: its micro-batches here (ranks x samples: "
                f"{self.world_size} x {self.micro_batch}) are not "
                f"the saved run's ({layout[0]} x {layout[1]}), so what __getitems__ draws "
                "(an augmentation) differs from the uninterrupted run; resume with the same "
                "data-parallel size and data.accumulation_steps, or give the dataset __getitem__ "
                "only (each sample seeded by its place in the epoch, the same at any world size)"
            )
        self.epoch, self.offset, self.seed = int(state["epoch"]), offset, int(state["seed"])
        self.sampler.seed = self.seed
        self._batches = None
