"""In-memory ranks draw dropout from generators of their own (``trainers/rank_draws.py``): a
``torch.utils.checkpoint`` of your own model without dtlab's replayed draws would recompute other masks
in backward than its forward drew (the generator has moved on), so it is refused naming the fixes;
with ``context_fn=ReplayedDraws()`` it trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dtlab.config import load_config
from dtlab.errors import RankFailedError
from dtlab.models.checkpointing import ReplayedDraws
from dtlab.trainers import run_training


class _Checkpointed(torch.nn.Module):
    """A dropout inside a checkpointed region of the model's own (``replayed``: with dtlab's draws)."""

    replayed = False

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def region(v: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.nn.functional.dropout(v, 0.5, self.training))

        if self.replayed:
            return checkpoint(region, x, use_reentrant=False, context_fn=ReplayedDraws())
        return checkpoint(region, x, use_reentrant=False)


class _Replayed(_Checkpointed):
    replayed = True


def test_a_checkpoint_recomputing_dropout_without_replayed_draws_is_refused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    sets = ["backend.name=inmemory", "backend.world_size=2", "train.steps=1", "train.eval_every=0"]
    sets += ["data.global_batch_size=8", "logging.progress=false", f"logging.run_dir={tmp_path}"]
    cfg = load_config(overrides=sets)
    with pytest.raises(RankFailedError, match=r"in backward: a recomputation.*context_fn=ReplayedDraws"):
        run_training(cfg, model=_Checkpointed, train_data=data, loss_fn="mse")
    assert run_training(cfg, model=_Replayed, train_data=data, loss_fn="mse")[0].final_step == 1
