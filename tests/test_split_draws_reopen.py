"""A tensor-parallel split region (``models/tensor/_split_draws.py``: dropout between a column-parallel
layer and its row-parallel partner draws this tp rank's own masks) whose first training pass drew
nothing opens again once the model's settings change: dropout raised after a warm-up, a dropout set to
train() later, a dropout added. Before, such a region stayed closed for good, so its dropout drew the
replicated stream's masks: the same mask for different hidden units on the two tp ranks, silently.
Now its masks are bitwise those a run that dropped from the start drew first."""

from __future__ import annotations

from collections.abc import Callable

import torch
from test_tensor_split_draws import Masks
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.rng import seeded_init
from dtlab.models import TensorParallelModel
from dtlab.testing import run_world
from dtlab.trainers.rank_draws import RankDraws

SEED = 7


def _turn_on(how: str) -> tuple[nn.Module, Callable[[nn.Sequential], None]]:
    """The middle module of the MLP before, and how it is turned on before the third pass."""
    if how == "p":
        return nn.Dropout(0.0), lambda mlp: setattr(mlp[2], "p", 0.5)
    if how == "train":
        return nn.Dropout(0.5).eval(), lambda mlp: mlp[2].train()
    if how == "added":
        return nn.Identity(), lambda mlp: mlp.__setitem__(2, nn.Dropout(0.5))
    return nn.Dropout(0.5), lambda _mlp: None  # dropping from the start


def _passes(backend: CommunicationBackend) -> dict[str, list[list[torch.Tensor]]]:
    out: dict[str, list[list[torch.Tensor]]] = {}
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    for how in ("start", "p", "train", "added"):
        middle, turn_on = _turn_on(how)
        with seeded_init(0):
            mlp = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), middle, nn.Linear(64, 8))
        model = TensorParallelModel(mlp, backend, plan={"0": "colwise", "3": "rowwise"})
        draws = RankDraws(SEED, backend.rank, 2, model)
        masks = out[how] = []
        for k in range(4):
            if k == 2:
                turn_on(mlp)
            rec = Masks()
            with rec, draws():
                model(x).sum().backward()
            masks.append(rec.masks)
    return out


def test_a_quiet_region_opens_again_when_the_models_settings_change() -> None:
    rank0, rank1 = run_world(2, _passes, timeout=120)
    for res in (rank0, rank1):
        first = res["start"][0]
        assert len(first) == 1 and first[0].shape == (16, 32)  # this rank's 32 of the 64 hidden units
        for how in ("p", "train", "added"):
            assert res[how][:2] == [[], []], how
            # the masks of a run dropping from the start, in the same order
            assert all(torch.equal(a[0], b[0]) for a, b in zip(res[how][2:], res["start"], strict=False)), how
    for how in ("start", "p", "train", "added"):
        agree = (rank0[how][2][0] == rank1[how][2][0]).float().mean().item()
        assert 0.38 < agree < 0.62, (how, agree)  # each tp rank its own masks (1.0: the same)
