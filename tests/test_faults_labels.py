"""A class label outside the model's output range: named before any rank starts when the dataset is
small enough to scan (every target), else at the first batch that holds it, with the rank, the sample
index in the dataset and the range, exit 2; never torch's bare ``IndexError: Target 300 is out of
bounds.``"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtlab.config import load_config
from dtlab.core.rng import seeded_init
from dtlab.errors import DataError, RankFailedError
from dtlab.trainers import run_training
from dtlab.trainers.labels import SCAN_ALL, first_bad_label

BASE = ["backend.name=inmemory", "backend.world_size=2", "logging.progress=false", "logging.run_dir=null"]
BASE += ["train.eval_every=0", "optimizer.warmup_steps=0", "data.shuffle=false"]


def _data(n: int, bad: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    y = torch.arange(n) % 10
    y[bad] = 300
    return torch.utils.data.TensorDataset(x, y)


def _model() -> nn.Module:
    with seeded_init(0):
        return nn.Linear(4, 10)


def test_first_bad_label() -> None:
    assert first_bad_label(torch.tensor([0, 9, -100, 3]), 10) is None  # -100: ignored by cross entropy
    assert first_bad_label(torch.tensor([[0, 1], [2, 10], [-1, 0]]), 10) == (1, 10)
    assert first_bad_label(torch.tensor([0, -3]), 10) == (1, -3)
    assert first_bad_label(torch.tensor([0.5, 99.0]), 10) is None  # regression targets are not labels


def test_a_small_dataset_is_scanned_before_any_rank_starts() -> None:
    cfg = load_config(overrides=[*BASE, "data.global_batch_size=16", "train.steps=2"])
    data = _data(1000, bad=757)  # the pre-flight used to look at 3 samples
    with pytest.raises(
        DataError, match=r"training data sample 757 has target 300, outside the model's 10 outputs"
    ):
        run_training(cfg, model=_model(), train_data=data, loss_fn="cross_entropy")


def test_a_large_dataset_names_the_sample_at_the_first_batch_that_has_it() -> None:
    n = SCAN_ALL + 1000
    bad = SCAN_ALL + 2  # past what the pre-flight scans; even: rank 0's 2049th sample with shuffle off
    cfg = load_config(overrides=[*BASE, "data.global_batch_size=500", "train.steps=9"])  # step 9 has it
    with pytest.raises(RankFailedError) as info:
        run_training(cfg, model=_model(), train_data=_data(n, bad), loss_fn="cross_entropy")
    cause = info.value.__cause__
    assert isinstance(cause, DataError), info.value
    msg = str(cause)
    assert msg.startswith(
        f"rank 0: sample {bad} of the training data has target 300, outside the model's 10 outputs"
    )
    assert "classes 0..9" in msg and "IndexError" in msg
