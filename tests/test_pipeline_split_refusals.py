"""PipelineParallelModel's split of a model into stages (balanced split, split points) and every refused
input: modules and splits, schedules, meshes, batches, losses, a forward the meta device cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pipeline_cases import make_lm, make_mlp, mlp_data
from torch import nn

from dtlab.backends import Mesh
from dtlab.errors import ArgumentError, RankFailedError, StrategyError
from dtlab.models import PipelineParallelModel
from dtlab.models.pipeline._split import balanced_split, module_blocks, split_blocks
from dtlab.testing import run_world


def test_balanced_split_and_split_points() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5]
    assert balanced_split([5, 0, 0, 5], 2) == [0, 3]  # a parameterless block stays behind
    # as many stages as a deep model's blocks (no recursion: any number of stages)
    many = balanced_split([1] * 1201, 1200)
    ends = [*many[1:], 1201]
    assert many[0] == 0 and max(b - a for a, b in zip(many, ends, strict=True)) == 2
    assert all(b > a for a, b in zip(many, ends, strict=True))
    blocks = module_blocks(make_mlp(4))
    stages = split_blocks(blocks, 2, None)
    assert [s.names for s in stages] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    stages = split_blocks(blocks, 3, ["2", "6"])
    assert [s.names for s in stages] == [["0", "1"], ["2", "3", "4", "5"], ["6", "7"]]
    lm = [n for n, _ in module_blocks(make_lm())]
    assert lm == ["embed", "blocks.0", "blocks.1", "head"]


class _SharedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
        self.b.running_mean = self.a.running_mean

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        return [("a", self.a), ("b", self.b)]


class _Partial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.extra = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        return [("a", self.a), ("b", self.b)]


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x


@pytest.mark.parametrize(
    ("make", "kwargs", "words"),
    [
        (lambda: nn.Linear(2, 2), {}, "is no nn.Sequential; name the module where each of stages 1..3"),
        (_SharedBuffer, {}, "a buffer is used by pipeline blocks 'a' and 'b'"),
        (_Partial, {}, "belong to no pipeline block and would be dropped: ['extra.weight', 'extra.bias']"),
        (lambda: make_mlp(1), {}, "has 2 pipeline blocks (['0', '1']) but the pipeline needs 4 stages"),
        (lambda: make_mlp(4), {"split_points": ["2"]}, "4 pipeline stages need 3 split points"),
        (lambda: make_mlp(4), {"split_points": ["2", "4", "9"]}, "split points ['9'] name no pipeline block"),
        (lambda: make_mlp(4), {"split_points": ["4", "2", "6"]}, "in order, each once"),
        (lambda: make_mlp(4), {"split_points": ["0", "2", "6"]}, "after the first"),
        (lambda: make_mlp(4), {"split_points": ["1", "2", "4"]}, "with no trainable parameters"),
    ],
)
def test_refused_modules_and_splits(make: Any, kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(
            4, lambda b: PipelineParallelModel(make(), b, "gpipe", micro_batches=4, **kwargs), timeout=20
        )
    assert isinstance(info.value.__cause__, StrategyError)
    assert words in str(info.value.__cause__)


def test_refused_schedules_meshes_and_batches() -> None:
    def build(b: Any, **kw: Any) -> Any:
        return PipelineParallelModel(make_mlp(), b, **kw)

    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        (
            {"schedule": "interleaved_1f1b", "micro_batches": 3, "stages_per_rank": 2},
            ArgumentError,
            "multiple of",
        ),
        ({"schedule": "1f1b", "stages_per_rank": 2}, ArgumentError, "runs one stage per rank"),
        ({"schedule": "dualpipe"}, ArgumentError, "unknown pipeline schedule 'dualpipe'"),
        ({"micro_batches": 0}, ArgumentError, "micro_batches must be an integer >= 1"),
    ]
    for kw, exc, words in cases:
        with pytest.raises(RankFailedError) as info:
            run_world(2, build, timeout=20, **kw)
        assert isinstance(info.value.__cause__, exc) and words in str(info.value.__cause__), kw
    with pytest.raises(RankFailedError, match="needs a mesh with a 'pp' axis"):
        run_world(2, lambda b: PipelineParallelModel(make_mlp(), Mesh(b, {"dp": 2})), timeout=20)
    with pytest.raises(RankFailedError, match=r"takes a dtlab\.backends\.Mesh"):
        run_world(1, lambda b: PipelineParallelModel(make_mlp(), {"pp": 1}), timeout=20)

    def bad_batch(b: Any) -> None:
        model = PipelineParallelModel(make_mlp(), b, micro_batches=4)
        xs, ys = mlp_data(6)
        model.train_step((xs[0], ys[0]), F.mse_loss)

    with pytest.raises(
        RankFailedError, match=r"batch of 6 samples \(inputs\) does not split into micro_batches=4"
    ):
        run_world(2, bad_batch, timeout=20)

    def bad_loss(b: Any) -> None:
        model = PipelineParallelModel(make_mlp(), b, micro_batches=2)
        xs, ys = mlp_data(4)
        model.train_step((xs[0], ys[0]), lambda out, y: (out - y) ** 2)

    with pytest.raises(RankFailedError, match="loss_fn must return a scalar tensor"):
        run_world(2, bad_loss, timeout=20)

    def not_static(b: Any) -> None:
        model = PipelineParallelModel(nn.Sequential(nn.Linear(6, 6), _DataDependent(), nn.Linear(6, 6)), b)
        xs, ys = mlp_data(4)
        model.train_step((xs[0], ys[0]), F.mse_loss)

    with pytest.raises(RankFailedError, match="could not be computed by a forward on the meta device"):
        run_world(2, not_static, timeout=20)
