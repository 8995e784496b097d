"""Checkpoints written by the Trainer load under every other data-parallel strategy at another world
size (ZeRO-1, ZeRO-3 and FSDP at 4 ranks -> DDP, ZeRO-1/2/3, FSDP at 2 ranks), and bf16 autocast is
really applied to the forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dtlab.backends.base import CommunicationBackend
from dtlab.checkpoint import full_tensors_from_shards, read_checkpoint
from dtlab.config import TrainConfig, load_config
from dtlab.testing import TINY_LM, run_world
from dtlab.trainers import Trainer, build_task, run_training
from dtlab.trainers.tasks import Task, cross_entropy_loss

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=2",
    "optimizer.warmup_steps=1",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.run_dir=null",
]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def _load_and_continue(
    backend: CommunicationBackend, config: TrainConfig
) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]]:
    trainer = Trainer(config, backend)  # resumes at construction
    return trainer.model.full_state_dict(), trainer.fit().losses


@pytest.mark.parametrize("saver", ["zero1", "zero3", "fsdp"])
def test_checkpoint_loads_under_every_other_strategy_at_another_world_size(
    saver: str, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    saved_cfg = load_config(
        overrides=[
            *TINY,
            f"strategy.model={saver}",
            "train.steps=3",
            f"checkpoint.dir={ck}",
            "checkpoint.every=2",
        ]
    )
    reference = run_training(saved_cfg)[0].losses  # 4 ranks, uninterrupted
    saved = full_tensors_from_shards(read_checkpoint(ck / "step_00000002").model)
    for loader in STRATEGIES:
        if loader == saver:
            continue
        cfg = load_config(
            overrides=[
                *TINY,
                f"strategy.model={loader}",
                "backend.world_size=2",
                "train.steps=3",
                f"checkpoint.resume={ck / 'step_00000002'}",
            ]
        )
        state, losses = run_world(2, _load_and_continue, cfg)[0]
        assert state.keys() == saved.keys(), (saver, loader)
        for k in saved:  # identical full parameters after loading
            assert torch.equal(state[k], saved[k]), (saver, loader, k)
        # the optimizer state came along: step 3 matches the uninterrupted 4-rank run
        assert [s for s, _ in losses] == [3]
        assert losses[0][1] == pytest.approx(reference[2][1], rel=1e-4), (saver, loader)


def test_bf16_autocast_applies_to_the_forward() -> None:
    for precision, want in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        cfg = load_config(overrides=[*TINY, "train.steps=2", f"train.precision={precision}"])
        base = build_task(cfg)
        seen: list[torch.dtype] = []

        def loss_fn(
            logits: torch.Tensor, targets: torch.Tensor, seen: list[torch.dtype] = seen
        ) -> torch.Tensor:
            seen.append(logits.dtype)
            return cross_entropy_loss(logits, targets)

        task = Task(base.build_model, base.train_data, base.eval_data, loss_fn=loss_fn, name=base.name)
        results: list[Any] = run_training(cfg, task=task)
        assert seen and set(seen) == {want}, precision  # every rank, every step
        assert all(torch.isfinite(torch.tensor([v for _, v in r.losses])).all() for r in results)
