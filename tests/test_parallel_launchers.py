"""The same ``dtlab train`` config on a mesh under a launcher: 4 MPI processes (``mpiexec -n 4``) at
tp2 x pp2 train to the losses of 4 in-memory ranks (the checks of the ``parallel`` section use the
launcher's world size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.config import load_config
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training

BIN = Path(sys.executable).parent
SETS = [
    *TINY_LM,
    "model.n_layers=2",
    "data.shuffle=false",
    "optimizer.warmup_steps=1",
    "train.steps=2",
    "train.eval_every=0",
    "logging.progress=false",
    "logging.log_every=1",
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.sequence_parallel=true",
    "strategy.model=zero2",
]


@pytest.mark.skipif(not (BIN / "mpiexec").exists(), reason="mpiexec not installed")
def test_tp2_x_pp2_under_mpiexec_trains_like_in_memory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = [*SETS, "backend.name=mpi", f"logging.run_dir={run}"]
    cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, "-m", "dtlab", "train"]
    proc = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pp 2 x dp 1 x tp 2 (hybrid)" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    launched = [r["loss"] for r in records if "loss" in r]
    config = load_config(
        overrides=[*SETS, "backend.name=inmemory", "backend.world_size=4", "logging.run_dir=null"]
    )
    in_memory = [v for _, v in run_training(config)[0].losses]
    assert launched == pytest.approx(in_memory, rel=1e-5)
