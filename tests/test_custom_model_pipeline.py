"""Your own model split from the config: ``run_training(model=...)`` with ``parallel.pp`` and
``parallel.split_points`` naming your model's modules or blocks, or ``parallel.tp`` with a
``parallel.plan`` of its layers (not the built-in transformer's), with the same losses as one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dtlab.config import load_config
from dtlab.core.rng import seeded_init
from dtlab.errors import RankFailedError
from dtlab.trainers import run_training

BASE = ["backend.name=inmemory", "logging.progress=false", "logging.run_dir=null", "optimizer.warmup_steps=0"]
BASE += ["data.global_batch_size=16", "train.steps=4", "train.eval_every=4", "optimizer.lr=0.05"]


class Trunk(nn.Module):
    """A model of your own with its own names: no ``blocks``, no ``embed``, four layers in ``trunk``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.trunk = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.trunk:
            x = torch.relu(layer(x))
        return self.out(x)


class TrunkBlocks(Trunk):
    """The same model declaring its pipeline blocks under names of its own."""

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        layers = [(f"layer{i}", nn.Sequential(t, nn.ReLU())) for i, t in enumerate(self.trunk)]
        return [("inp", self.inp), *layers, ("out", self.out)]


class ModulesNotPairs(Trunk):
    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.inp, *self.trunk, self.out]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _train(cls: type[Trunk], sets: list[str]) -> list[list[float]]:
    with seeded_init(3):
        model = cls()
    data = _data()
    results = run_training(
        load_config(overrides=[*BASE, *sets]), model=model, train_data=data, eval_data=data
    )
    return [[loss for _, loss in r.losses] + [r.evals[-1][1]["eval_loss"]] for r in results]


@pytest.mark.parametrize(
    ("cls", "sets"),
    [
        (Trunk, ["backend.world_size=2", "parallel.pp=2", "parallel.split_points=[trunk.2]"]),
        (TrunkBlocks, ["backend.world_size=2", "parallel.pp=2", "parallel.split_points=[layer2]"]),
        (
            Trunk,
            [
                "backend.world_size=4",
                "parallel.pp=2",
                "parallel.split_points=[trunk.1]",
                "strategy.model=zero3",
            ],
        ),
        (
            Trunk,
            ["backend.world_size=2", "parallel.tp=2", "parallel.plan={trunk.0: colwise, trunk.1: rowwise}"],
        ),
    ],
    ids=["module-names", "own-blocks", "pp2-dp2-zero3", "tp2-own-plan"],
)
def test_run_training_pipelines_your_model_at_its_own_split_points(cls: type[Trunk], sets: list[str]) -> None:
    (one,) = _train(cls, ["backend.world_size=1"])
    for ranks in _train(cls, sets):
        assert len(ranks) == len(one) == 5
        assert max(abs(a - b) / abs(b) for a, b in zip(ranks, one, strict=True)) < 1e-5, (ranks, one)


def test_pipeline_blocks_of_modules_instead_of_pairs_is_named() -> None:
    with pytest.raises(RankFailedError, match=r"pipeline_blocks\(\) must return \(name, block\) pairs"):
        _train(ModulesNotPairs, ["backend.world_size=2", "parallel.pp=2"])
