"""The Trainer on a mesh (``parallel.tp`` / ``parallel.pp``): the embedded transformer trains to the same
losses as data parallelism alone on the same dp split of the global batch (the model-parallel
strategies run ``model.train_step``, sample by dp rank and average the loss over dp)."""

from __future__ import annotations

from typing import Any

import pytest

from dtlab.config import load_config
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training

TINY = [
    "backend.name=inmemory",
    *TINY_LM,
    "model.n_layers=2",
    "data.shuffle=false",
    "optimizer.warmup_steps=1",
    "train.steps=3",
    "train.eval_every=3",
    "logging.progress=false",
    "logging.run_dir=null",
]


def _run(*overrides: str) -> tuple[list[float], float, Any]:
    results = run_training(load_config(overrides=[*TINY, *overrides]))
    losses = [v for _, v in results[0].losses]
    for r in results[1:]:  # every rank reports the same dp-averaged loss and evaluation
        assert [v for _, v in r.losses] == losses and r.evals == results[0].evals
    return losses, results[0].evals[-1][1]["eval_loss"], results[0].summary


def test_tensor_and_pipeline_meshes_train_like_data_parallel() -> None:
    ref, ref_eval, _ = _run("backend.world_size=2")
    runs = {
        "tp2": _run("backend.world_size=4", "parallel.tp=2", "parallel.sequence_parallel=true"),
        "pp2": _run("backend.world_size=4", "parallel.pp=2", "parallel.micro_batches=4"),
        "tensor zero1": _run(
            "backend.world_size=4", "parallel.tp=2", "strategy.model=tensor", "strategy.optimizer=zero1"
        ),
    }
    for name, (losses, ev, summary) in runs.items():
        assert losses == pytest.approx(ref, rel=1e-5), name
        assert ev == pytest.approx(ref_eval, rel=1e-5), name
        assert "dp 2" in summary["mesh"], (name, summary["mesh"])
