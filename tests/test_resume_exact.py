"""A resumed run equals the uninterrupted one: the parts of the state whose restoring the other resume
tests do not reach (DataLoader workers' random draws mid-epoch)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from dtlab.trainers.feed import DataFeed


class _Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample with fresh noise from the loading process's generator (a random augmentation)."""

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + torch.rand(3), torch.tensor(i)


def _batches(feed: DataFeed, steps: int) -> list[torch.Tensor]:
    return [x for _ in range(steps) for x, _ in feed.next_micro_batches()]


def test_a_workers_augmentation_resumed_mid_epoch_draws_what_the_uninterrupted_run_drew() -> None:
    data = _Augmented(40)  # 5 steps of 8 per epoch: 7 steps cross into the second epoch
    whole = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=2)
    first = _batches(whole, 3)
    saved = whole.state_dict()
    rest = _batches(whole, 4)
    for workers in (2, 1):  # the same draws with another number of workers
        again = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=workers)
        again.load_state_dict(saved)
        resumed = _batches(again, 4)
        assert all(torch.equal(a, b) for a, b in zip(resumed, rest, strict=True)), workers
    fresh = _batches(DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=1), 3)
    assert all(torch.equal(a, b) for a, b in zip(fresh, first, strict=True))
    assert (first[0] != first[0].round()).all()  # the noise was drawn
