"""A dataset's random draws (an augmentation) on in-memory ranks without workers (``data.num_workers=0``,
``trainers/worker_draws.py: ThreadFetch``): the ranks are threads sharing torch's, Python's and NumPy's
generators, so each micro-batch is fetched alone in the process, each sample seeded from its place in
the epoch as in ``DataLoader`` workers, and the generators are put back after. Two runs, a run and its
resume mid-epoch, and the same run with workers draw the same, bitwise; so do evaluations of augmented
held-out samples (each row seeded by its index). A launched rank (a process of its own) fetches alike,
without the lock: it draws as in-memory ranks and workers do, also resumed at another world size."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtlab.config import TrainConfig, load_config
from dtlab.trainers import run_training
from dtlab.trainers.feed import DataFeed

Sample = tuple[torch.Tensor, torch.Tensor]


class Augmented(Dataset[Sample]):
    """Each sample's input plus a draw of torch's, Python's and NumPy's global generators."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Sample:
        return self.x[i] + torch.rand(4) + random.random() + float(np.random.rand()), self.y[i]


class _Batched(Augmented):
    """One draw for the whole batch (its ``__getitems__``: Hugging Face's datasets fetch so)."""

    def __getitems__(self, indices: list[int]) -> list[Sample]:
        noise = torch.rand(len(indices), 4) + random.random() + float(np.random.rand())
        return [(self.x[i] + noise[k], self.y[i]) for k, i in enumerate(indices)]


def _states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1]


def _same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and bool((a[2] == b[2]).all())


def _cfg(tmp: Path, name: str, *extra: str) -> TrainConfig:
    sets = ["backend.name=inmemory", "backend.world_size=2", "train.eval_every=2", "train.steps=5"]
    sets += ["data.global_batch_size=8", "data.accumulation_steps=2", "optimizer.warmup_steps=0"]
    sets += ["logging.progress=false", f"logging.run_dir={tmp / 'run'}", f"checkpoint.dir={tmp / name}"]
    return load_config(overrides=[*sets, *extra])


def _run(config: TrainConfig) -> tuple[list[tuple[int, float]], list[tuple[int, dict[str, float]]]]:
    """The losses and evaluations (the last ``data.eval_fraction`` held out: augmented too)."""
    res = run_training(config, model=lambda: torch.nn.Linear(4, 1), train_data=Augmented(), loss_fn="mse")
    return res[0].losses, res[0].evals


def test_in_memory_ranks_draw_as_workers_do_and_resume_mid_epoch_exactly(tmp_path: Path) -> None:
    # 5 steps an epoch (the last 5% of the 48 samples held out): step 2 is mid-epoch
    losses, evals = _run(_cfg(tmp_path, "whole", "checkpoint.every=2", "checkpoint.keep_last=3"))
    assert len(losses) == 5 and len(evals) == 3
    assert _run(_cfg(tmp_path, "again")) == (losses, evals)  # bitwise, whatever the threads' timing
    resume = f"checkpoint.resume={tmp_path / 'whole' / 'step_00000002'}"
    assert _run(_cfg(tmp_path, "resumed", resume)) == (losses[2:], evals[1:])
    assert _run(_cfg(tmp_path, "workers", "data.num_workers=1")) == (losses, evals)  # each sample keyed


def _batches(feed: DataFeed, steps: int) -> list[Sample]:
    return [(x, y) for _ in range(steps) for x, y in feed.next_micro_batches()]


def test_a_dataset_fetching_batches_draws_per_batch_as_in_workers() -> None:
    data = _Batched(40)
    threads = DataFeed(data, 8, 2, 1, 2, seed=3, threads=True)
    workers = DataFeed(data, 8, 2, 1, 2, seed=3, num_workers=1)
    before = _states()
    a = _batches(threads, 3)
    assert _same_states(before, _states())  # the process's generators are put back
    b = _batches(workers, 3)
    assert all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b, strict=True))
    assert threads.batched and not any(torch.equal(a[0][0][0], row) for row in data.x)  # drawn


def test_a_launched_rank_draws_as_in_memory_ranks_and_workers_and_resumes_at_another_world_size() -> None:
    """A rank alone in its process (torchrun, mpiexec: ``threads=False``) without workers fetches as an
    in-memory rank does, without the lock: each sample seeded by its place, its dropout stream (the
    process's generators) put back after; a resume at another world size draws the same samples alike."""
    data = Augmented()
    before = _states()
    launched = [_batches(DataFeed(data, 8, 2, r, 2, seed=3), 3) for r in range(2)]
    assert _same_states(before, _states())  # the process's generators are put back
    for r in range(2):
        for other in (
            DataFeed(data, 8, 2, r, 2, seed=3, threads=True),
            DataFeed(data, 8, 2, r, 2, seed=3, num_workers=1),
        ):
            assert all(
                torch.equal(x, u) for (x, _), (u, _) in zip(launched[r], _batches(other, 3), strict=True)
            )
    whole = DataFeed(data, 8, 1, 0, seed=3)  # one process: the same samples' draws as the two ranks'
    first = _batches(whole, 1)[0][0]
    assert torch.equal(first, torch.stack([launched[k % 2][k // 4][0][k // 2 % 2] for k in range(8)]))
    resumed = DataFeed(data, 8, 1, 0, seed=3)
    saved = DataFeed(data, 8, 2, 0, 2, seed=3)
    _batches(saved, 1)
    resumed.load_state_dict(saved.state_dict())  # a 2-rank run's step 1, resumed by one process
    assert torch.equal(_batches(resumed, 1)[0][0], _batches(whole, 1)[0][0])
