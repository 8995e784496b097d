"""The same ``dtlab train`` config on a mesh under real launchers, 4 processes each: tp2 x pp2 under
``mpiexec -n 4`` (MPI), dp2 x tp2 and dp2 x pp2 under ``torchrun --nproc-per-node 4`` (Gloo). Each
trains to the losses of 4 in-memory ranks (the ``parallel`` section's checks use the launcher's world
size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_group

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
    "logging.plot=false",  # no loss.png: matplotlib, seconds per run (tests/test_run_logging.py checks it)
]
MESHES = {
    "tp2 x pp2": [
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.sequence_parallel=true",
        "strategy.model=zero2",
    ],
    "dp2 x tp2": ["parallel.tp=2", "strategy.model=fsdp"],
    "dp2 x pp2": ["parallel.pp=2", "strategy.model=zero1"],
}
LAUNCHER = {"tp2 x pp2": "mpiexec", "dp2 x tp2": "torchrun", "dp2 x pp2": "torchrun"}


def _launch(launcher: str, sets: list[str], timeout: float = 420) -> subprocess.CompletedProcess[str]:
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", "-m", "dtlab", "train"]
    else:
        cmd = [str(BIN / "mpiexec"), "-n", "4", sys.executable, "-m", "dtlab", "train"]
        sets = [*sets, "backend.name=mpi"]
    cmd += [a for s in sets for a in ("--set", s)]
    return run_group(cmd, timeout)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_under_a_launcher_trains_like_in_memory(tmp_path: Path, mesh: str) -> None:
    launcher = LAUNCHER[mesh]
    if not (BIN / launcher).exists():
        pytest.skip(f"{launcher} not installed next to {sys.executable}")
    run = tmp_path / "run"
    proc = _launch(launcher, [*SETS, *MESHES[mesh], f"logging.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    pp, dp, tp = (2 if f"{axis}2" in mesh else 1 for axis in ("pp", "dp", "tp"))
    assert f"pp {pp} x dp {dp} x tp {tp}" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    launched = [r["loss"] for r in records if "loss" in r]
    overrides = [
        *SETS,
        *MESHES[mesh],
        "backend.name=inmemory",
        "backend.world_size=4",
        "logging.run_dir=null",
    ]
    in_memory = [v for _, v in run_training(load_config(overrides=overrides))[0].losses]
    assert len(launched) == 2 and launched == pytest.approx(in_memory, rel=1e-5)
