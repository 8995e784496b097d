"""A one-rank in-memory run (``run_training`` with ``backend.world_size=1``) draws as each rank of a
world of several does: its dropout from a generator of its own seeded from ``train.seed``, its
dataset's draws seeded per sample as in ``DataLoader`` workers, whatever state the process's torch,
Python and NumPy generators are in. Before, it drew from whatever state those were left in: two
identical calls in one process trained differently."""

from __future__ import annotations

from pathlib import Path

from test_thread_fetch_draws import Augmented
from torch import nn

from dtlab.config import TrainConfig, load_config
from dtlab.trainers import run_training


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))


def _cfg(tmp: Path, *extra: str) -> TrainConfig:
    sets = ["backend.name=inmemory", "backend.world_size=1", "train.eval_every=2", "train.steps=4"]
    sets += ["data.global_batch_size=8", "optimizer.warmup_steps=0", "logging.progress=false"]
    sets += ["logging.run_dir=null", f"checkpoint.dir={tmp / 'ck'}", "checkpoint.every=2"]
    return load_config(overrides=[*sets, *extra])


def _run(config: TrainConfig) -> tuple[list[tuple[int, float]], list[tuple[int, dict[str, float]]]]:
    res = run_training(config, model=_model, train_data=Augmented(), loss_fn="mse")
    return res[0].losses, res[0].evals


def test_one_in_memory_rank_draws_alike_in_every_call_and_resumes_exactly(tmp_path: Path) -> None:
    # the first call leaves the process's generators elsewhere (its checks and loaders draw): the
    # second still draws what the first drew
    first, second = _run(_cfg(tmp_path / "a")), _run(_cfg(tmp_path / "b"))
    assert first == second  # bitwise: dropout and augmentation drew the same
    resume = f"checkpoint.resume={tmp_path / 'a' / 'ck' / 'step_00000002'}"
    losses, evals = _run(_cfg(tmp_path / "c", resume))
    assert losses == first[0][2:] and evals == first[1][1:]
