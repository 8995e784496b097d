"""In-memory ranks' own generators (``trainers/rank_draws.py``) for a model that starts drawing after a
first micro-batch that drew nothing: dropout raised after a warm-up, a dropout set to train() later, a
dropout added to the model. Its masks come from the rank's own generator, bitwise the same in every run
and the masks a run whose dropout was on from the start draws first (what the rank's process draws
under a launcher); draws that begin without any change dtlab sees are refused, not taken from the RNG
the threads share."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.config import TrainConfig, load_config
from dtlab.errors import RankFailedError, StrategyError
from dtlab.testing import run_world
from dtlab.trainers import Trainer

STEPS = 4


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))


def _net(middle: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(4, 16), middle(), nn.Linear(16, 1))


def _dropout_at(p: float, training: bool = True) -> Callable[[], nn.Module]:
    return lambda: nn.Dropout(p).train(training)


class _Listed(nn.Module):
    """A dropout whose probability lives in a list (not a setting dtlab watches)."""

    def __init__(self) -> None:
        super().__init__()
        self.schedule = [0.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.schedule[0], self.training)


def _run(
    backend: CommunicationBackend, config: TrainConfig, middle: Callable[[], nn.Module], turn_on: str
) -> dict[str, Any]:
    """``STEPS`` steps; before step 2 the middle module is turned on (``turn_on``: how)."""
    trainer = Trainer(config, backend, model=_net(middle), train_data=_data(), loss_fn="mse")
    masks: list[torch.Tensor] = []

    def record(module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        if module.training and getattr(module, "p", 0) > 0:
            masks.append((out == 0).clone())

    seq = next(m for m in trainer.model.modules() if isinstance(m, nn.Sequential))
    seq[1].register_forward_hook(record)
    losses = []
    for step in range(STEPS):
        if step == 2:
            if turn_on == "p":
                seq[1].p = 0.5
            elif turn_on == "train":
                seq[1].train()
            elif turn_on == "added":
                seq[1] = nn.Dropout(0.5)
                seq[1].register_forward_hook(record)
            elif turn_on == "listed":
                seq[1].schedule[0] = 0.5
        losses.append(trainer.train_step()[1])
        trainer.step += 1
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return {"losses": losses, "masks": masks, "params": params, "drawing": trainer.draws.active}


def _cfg(tmp: Path) -> TrainConfig:
    sets = ["backend.name=inmemory", "backend.world_size=2", "train.eval_every=0", f"train.steps={STEPS}"]
    sets += ["data.global_batch_size=8", "logging.progress=false", f"logging.run_dir={tmp}"]
    return load_config(overrides=sets)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["losses"] == b["losses"]
        and len(a["masks"]) == len(b["masks"])
        and all(torch.equal(x, y) for x, y in zip(a["masks"], b["masks"], strict=True))
        and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    )


def test_dropout_turned_on_after_a_warm_up_draws_each_ranks_own_masks(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    early = run_world(2, _run, cfg, _dropout_at(0.5), "", timeout=120)
    for middle, turn_on in (
        (_dropout_at(0.0), "p"),  # p raised after a warm-up
        (_dropout_at(0.5, training=False), "train"),  # set to train() later
        (nn.Identity, "added"),  # a dropout added to the model
    ):
        late = run_world(2, _run, cfg, middle, turn_on, timeout=120)
        again = run_world(2, _run, cfg, middle, turn_on, timeout=120)
        for rank in (0, 1):
            assert _same(late[rank], again[rank]), (turn_on, rank)  # bitwise, whatever the threads did
            assert late[rank]["drawing"]
            masks = late[rank]["masks"]
            assert len(masks) == 2, turn_on  # steps 2 and 3
            # the rank's generator from its start: the masks a run dropping from step 0 drew first
            first = early[rank]["masks"][:2]
            assert all(torch.equal(m, e) for m, e in zip(masks, first, strict=True)), (turn_on, rank)
        assert not torch.equal(late[0]["masks"][0], late[1]["masks"][0])  # each rank its own


def test_a_model_that_draws_nothing_keeps_the_ranks_generators_off(tmp_path: Path) -> None:
    quiet = run_world(2, _run, _cfg(tmp_path), _dropout_at(0.0), "", timeout=120)
    assert [r["drawing"] for r in quiet] == [False, False] and quiet[0]["masks"] == []


def test_draws_that_begin_without_a_change_dtlab_sees_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError, match=r"began drawing.*micro-batch 3.*global RNG.*mpiexec") as err:
        run_world(2, _run, _cfg(tmp_path), _Listed, "listed", timeout=120)
    assert isinstance(err.value.__cause__, StrategyError)


class _Decoded(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``_data()`` at 1 ms a sample (a decode): one rank's fetch overlaps another's micro-batch."""

    def __init__(self) -> None:
        self.data = _data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.001)
        return self.data[i]


def _probed(backend: CommunicationBackend, config: TrainConfig) -> list[int]:
    trainer = Trainer(config, backend, model=_net(nn.Identity), train_data=_Decoded(), loss_fn="mse")
    probed: list[int] = []
    probe = trainer.draws._probed
    trainer.draws._probed = lambda: (probed.append(trainer.draws.micro), probe())[1]
    for _ in range(12):
        trainer.train_step()
        trainer.step += 1
    return probed


def test_another_ranks_seeded_fetch_is_not_taken_for_draws(tmp_path: Path) -> None:
    """Before: another rank's fetch (data.num_workers=0: the samples' draws seeded on torch's shared
    generator, put back after) overlapping this rank's micro-batch looked like draws of its model, so
    the next micro-batch ran under the mode (7 and 11 of 40 micro-batches at 0.5 ms a sample). Now the
    shared generator is read when no fetch is seeding it: a model that draws nothing is probed once."""
    assert run_world(2, _probed, _cfg(tmp_path), timeout=120) == [[1], [1]]
