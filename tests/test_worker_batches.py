"""A dataset that fetches a batch at once (its ``__getitems__``, which torch's loader calls with the
batch's indices: Hugging Face's datasets) keeps doing so in ``DataLoader`` workers
(``data.num_workers > 0``, ``trainers/worker_draws.py``): its draws, made for the whole batch in one
call, are seeded per batch, so a resume with the same micro-batches draws what the uninterrupted run
drew with any number of workers; a resume at another layout is noted."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset, StackDataset, Subset

from dtlab.config import load_config
from dtlab.trainers import run_training
from dtlab.trainers.feed import DataFeed

Sample = tuple[torch.Tensor, torch.Tensor]


class _Batched(Dataset[Sample]):
    """One noise draw per call for the whole batch (a batch-level augmentation); ``__getitem__``, which
    torch's loader does not call when ``__getitems__`` exists, marks its samples with target -1."""

    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Sample:
        return self.x[i], torch.tensor(-1)

    def __getitems__(self, indices: list[int]) -> list[Sample]:
        noise = torch.rand(len(indices), 3)
        return [(self.x[i] + noise[k], torch.tensor(i)) for k, i in enumerate(indices)]


class _PerSample(_Batched):
    __getitems__ = None  # type: ignore[assignment]  # torch's loader then fetches sample by sample


def _batches(feed: DataFeed, steps: int) -> list[Sample]:
    return [(x, y) for _ in range(steps) for x, y in feed.next_micro_batches()]


def _equal(a: list[Sample], b: list[Sample]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b, strict=True)
    )


def test_workers_fetch_a_batch_at_once_and_a_resume_draws_the_same() -> None:
    data = _Batched(40)  # 5 steps of 8 per epoch: 7 steps cross into the second epoch
    whole = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=2)
    first = _batches(whole, 3)
    saved = whole.state_dict()
    rest = _batches(whole, 4)
    assert all((y >= 0).all() for _, y in first + rest)  # every sample came through __getitems__
    assert (first[0][0] != first[0][0].round()).all()  # the noise was drawn
    for workers in (2, 1):  # the same draws with another number of workers
        again = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=workers)
        again.load_state_dict(saved)
        assert _equal(_batches(again, 4), rest) and again.notes == [], workers
    assert _equal(_batches(DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=1), 3), first)


def test_a_resume_at_another_micro_batch_layout_is_noted_where_batches_are_seeded() -> None:
    saved = DataFeed(_Batched(40), 8, 2, 1, 2, seed=3, num_workers=2).state_dict()
    # 4 samples a micro-batch, not 2: in workers, and without (seeded per batch on the rank alike)
    for other in (
        DataFeed(_Batched(40), 8, 2, 1, 1, seed=3, num_workers=2),
        DataFeed(_Batched(40), 8, 2, 1, 1),
    ):
        other.load_state_dict(saved)
        assert len(other.notes) == 1 and "(ranks x samples: 2 x 4)" in other.notes[0]
        assert "saved run's (2 x 2)" in other.notes[0] and "__getitem__ only" in other.notes[0]
    feed = DataFeed(_PerSample(40), 8, 2, 1, 1, seed=3, num_workers=2)
    feed.load_state_dict(saved)  # seeded per sample: the same at any layout
    assert feed.notes == []


def test_subsets_and_stacks_fetch_batches_only_where_what_they_hold_does() -> None:
    from dtlab.trainers.worker_draws import fetches_batches

    batched, single = _Batched(8), _PerSample(8)
    assert fetches_batches(batched) and not fetches_batches(single)
    assert fetches_batches(Subset(batched, range(4))) and not fetches_batches(Subset(single, range(4)))
    assert fetches_batches(StackDataset(single, batched)) and not fetches_batches(StackDataset(a=single))
    held_out = Subset(Subset(single, range(6)), range(3))  # the Trainer's hold-out of a Subset
    assert not fetches_batches(held_out)


class _Regression(Dataset[Sample]):
    """Inputs and targets for a model of 3 features, fetched a batch at once."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Sample:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> list[Sample]:
        return [(self.x[i], self.y[i]) for i in indices]


def test_the_trainer_notes_a_resume_at_another_layout(tmp_path: Path) -> None:
    sets = ["backend.name=inmemory", "backend.world_size=1", "train.eval_every=0", "data.num_workers=1"]
    sets += ["data.global_batch_size=8", "logging.progress=false", f"logging.run_dir={tmp_path / 'run'}"]
    sets += [f"checkpoint.dir={tmp_path / 'ck'}", "optimizer.warmup_steps=0"]
    run = {"model": lambda: torch.nn.Linear(3, 1), "train_data": _Regression(), "loss_fn": "mse"}
    run_training(load_config(overrides=[*sets, "train.steps=1", "data.accumulation_steps=2"]), **run)
    resumed = run_training(load_config(overrides=[*sets, "train.steps=2", "checkpoint.resume=true"]), **run)
    assert any("(ranks x samples: 1 x 8)" in n for n in resumed[0].resume_notes), resumed[0].resume_notes
