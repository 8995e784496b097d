"""The held-out loss covers every held-out sample: those after the last whole global batch run as one
more batch whose padding rows' targets are -100 (counted 0), so the default loss's held-out mean is one
process's over the whole held-out set, on one rank, under DDP and ZeRO-3. In-memory ranks, a tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlab.config import load_config
from dtlab.core import seeded_init
from dtlab.trainers import run_training

V, T = 16, 6


def _build() -> nn.Module:
    return nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V))


def _data(rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (rows, T), generator=gen), torch.randint(0, V, (rows, T), generator=gen)
    y[torch.rand(rows, T, generator=gen) < 0.3] = -100
    return list(zip(x, y, strict=True))


@pytest.mark.parametrize(
    "layout",
    [["backend.world_size=1"], ["backend.world_size=2"], ["backend.world_size=2", "strategy.model=zero3"]],
)
def test_the_held_out_loss_covers_the_samples_after_the_last_whole_batch(layout: list[str]) -> None:
    # 11 held-out samples, global batch 8: only the first 8 were evaluated (3 of 11 left out)
    train, held_out = _data(16, 0), _data(11, 1)
    sets = ["backend.name=inmemory", "logging.progress=false", "logging.run_dir=null", "train.steps=1"]
    sets += ["train.eval_every=1", "data.global_batch_size=8", "optimizer.lr=1e-12", *layout]
    result = run_training(load_config(overrides=sets), model=_build, train_data=train, eval_data=held_out)
    with seeded_init(0), torch.no_grad():  # the model the run starts from (lr 1e-12: the one it evaluates)
        x, y = (torch.stack(t) for t in zip(*held_out, strict=True))
        want = F.cross_entropy(_build()(x).flatten(0, 1), y.flatten()).item()
    got = result[0].evals[-1][1]["eval_loss"]
    assert abs(got - want) <= 1e-6 * want, (got, want)
