"""The same `dtlab train` config under real launchers: torchrun (gloo) and mpiexec (MPI), 2 processes;
both with a dataset drawing in ``__getitem__`` from torch's, Python's and NumPy's global generators
(each sample's draws seeded by its place in the epoch, as on in-memory ranks and in workers: the two
launched runs and the same config on in-memory ranks give bitwise the same losses);
and dropout under tensor parallelism under torchrun: each process seeds its dropout from ``train.seed``
(torch seeds every process at random, so the tp ranks drew other masks where the model is not split,
their copies of the whole parameters got other gradients, and the run was refused at the first step);
a checkpoint resumed at another tp keeps that seeding rather than restoring each rank's own state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from processes import run_group, run_groups

from dtlab.config import load_config
from dtlab.testing import TINY_LM
from dtlab.trainers import run_training

BIN = Path(sys.executable).parent
LAUNCHERS = ("torchrun", "mpiexec")
SETS = [
    "train.steps=6",
    *TINY_LM,
    "train.eval_every=3",
    "logging.log_every=3",
    "logging.plot=false",  # no loss.png: matplotlib, seconds per run (tests/test_run_logging.py checks it)
]


#: bytes with a token of each sample replaced by draws of torch's, Python's and NumPy's generators
AUGMENTED = textwrap.dedent(
    """
    import random

    import numpy as np
    import torch
    from torch.utils.data import Dataset

    class Augmented(Dataset):
        def __init__(self):
            self.tokens = torch.randint(0, 64, (256, 33), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.tokens)

        def __getitem__(self, i):
            t = self.tokens[i].clone()
            t[int(torch.randint(0, 33, ()))] = random.randrange(64)
            t[int(np.random.randint(33))] = int(torch.randint(0, 64, ()))
            return t[:-1], t[1:]

    def data():
        return Augmented()
    """
)


def _losses(run_dir: Path, key: str = "loss") -> list[Any]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[key] for r in map(json.loads, lines) if key in r]


def _command(tmp: Path, launcher: str) -> list[str]:
    exe = BIN / launcher
    sets = [*SETS, f"logging.run_dir={tmp / launcher}", f"checkpoint.dir={tmp / launcher / 'ck'}"]
    if launcher == "torchrun":
        cmd = [str(exe), "--standalone", "--nproc-per-node", "2", "-m", "dtlab", "train"]
    else:
        cmd = [str(exe), "-n", "2", sys.executable, "-m", "dtlab", "train"]
        sets.append("backend.name=mpi")
    return cmd + [a for s in sets for a in ("--set", s)]


def _losses_of(tmp: Path, launcher: str, proc: subprocess.CompletedProcess[str]) -> list[float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    backend = "GlooBackend x 2" if launcher == "torchrun" else "MPIBackend x 2"
    assert proc.stdout.count("dtlab train: summary") == 1 and backend in proc.stdout  # rank 0 prints
    step = tmp / launcher / "ck" / "step_00000006"
    assert sorted(p.name for p in step.iterdir() if p.name.startswith("model_")) == [
        "model_rank00000.safetensors",
        "model_rank00001.safetensors",
    ]
    return _losses(tmp / launcher)


def _in_memory(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """The launched runs' config on 2 in-memory ranks (threads of this process): every step's losses,
    the eval losses."""
    monkeypatch.syspath_prepend(str(tmp))
    sets = [*SETS, "data.factory=dtlab_augmented:data", "backend.name=inmemory", "backend.world_size=2"]
    sets += [f"logging.run_dir={tmp / 'inmemory'}", "logging.progress=false"]
    try:
        run_training(load_config(overrides=sets))
    finally:
        sys.modules.pop("dtlab_augmented", None)
    return _losses(tmp / "inmemory", "losses"), _losses(tmp / "inmemory", "eval_loss")


def test_same_config_under_torchrun_and_mpiexec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and on in-memory ranks: each sample's draws in ``__getitem__`` are seeded by its place in the
    epoch everywhere (with ``data.num_workers=0`` too), so the three give bitwise the same losses."""
    missing = [x for x in ("torchrun", "mpiexec") if not (BIN / x).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed next to {sys.executable}")
    (tmp_path / "dtlab_augmented.py").write_text(AUGMENTED)
    in_memory, in_memory_evals = _in_memory(tmp_path, monkeypatch)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    cmds = {x: [*_command(tmp_path, x), "--set", "data.factory=dtlab_augmented:data"] for x in LAUNCHERS}
    # both launches at once: each waits on its launcher and its rendezvous part of the time
    procs = run_groups(cmds, timeout=180, envs={x: env for x in LAUNCHERS})
    gloo = _losses_of(tmp_path, "torchrun", procs["torchrun"])
    mpi = _losses_of(tmp_path, "mpiexec", procs["mpiexec"])
    assert len(gloo) == 2 and all(v == v for v in gloo)
    assert gloo == mpi  # the same config and seed: the same losses (and draws) on both engines
    # and as the in-memory run of that config: training and held-out samples drawn alike, bitwise
    for launcher in LAUNCHERS:
        assert _losses(tmp_path / launcher, "losses") == in_memory, launcher  # every step's
        assert _losses(tmp_path / launcher, "eval_loss") == in_memory_evals, launcher
    assert len(in_memory_evals) == 2


def test_dropout_at_tp2_under_torchrun_draws_the_same_masks_on_both_tp_ranks(tmp_path: Path) -> None:
    """A dp=2 run's checkpoint resumed at tp=2 (the same 2 processes): the ranks' saved RNG states
    differ (each dp replica draws its own masks), so they are not restored at another tp; the
    launcher's seeding gives both tp ranks the same. Before, both runs were refused at the first
    step of tp=2 (torch seeds each process at random; a restore gave each rank its own state)."""
    if not (BIN / "torchrun").exists():
        pytest.skip(f"torchrun not installed next to {sys.executable}")
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "dtlab", "train"]
    sets = [*TINY_LM, "train.eval_every=0", "logging.progress=false", "logging.plot=false"]
    sets.append("model.dropout=0.1")
    runs = [
        ["train.steps=2", "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}"],
        ["train.steps=3", "parallel.tp=2", f"checkpoint.resume={tmp_path / 'ck' / 'step_00000002'}"],
    ]
    for i, run in enumerate(runs):
        args = [*sets, *run, f"logging.run_dir={tmp_path / str(i)}"]
        proc = run_group(cmd + [a for s in args for a in ("--set", s)], timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(tmp_path / "1")) == 1  # step 3, at tp=2
