"""Slurm: ``init_backend`` recognises a world ``srun`` started (gloo/nccl, and MPI with
``srun --mpi=pmi2``); on a real one-node Slurm (started here) ``dtlab train`` via ``srun`` and via
``sbatch`` trains exactly as the same world under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtlab.backends._slurm import first_host
from dtlab.backends.init import choose_backend, detect_launcher
from dtlab.errors import BackendInitError
from dtlab.testing import TINY_LM
from tests.slurm_cluster import Cluster, start_cluster

ROOT = Path(__file__).resolve().parent.parent
SRUN_ENV = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "123456",
}


def test_srun_environment_is_a_world() -> None:
    info = detect_launcher(SRUN_ENV)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 3, 4, 1)
    assert (info.master_addr, info.master_port) == ("gpu07", 15000 + 123456 % 10000)
    assert choose_backend(info, cuda_available=False) == "gloo"
    assert choose_backend(info, cuda_available=True) == "nccl"
    given = detect_launcher({**SRUN_ENV, "MASTER_ADDR": "head", "MASTER_PORT": "29600"})
    assert (given.master_addr, given.master_port) == ("head", 29600)
    # the batch script itself (SLURM_PROCID=0, no step): one process, not a world
    batch = {k: v for k, v in SRUN_ENV.items() if k not in ("SLURM_STEP_ID", "SLURM_PROCID")}
    assert detect_launcher({**batch, "SLURM_PROCID": "0"}).launcher == "none"
    # torchrun started by srun (one task per node): torchrun's variables win
    torchrun = {**SRUN_ENV, "RANK": "5", "WORLD_SIZE": "16", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert (detect_launcher(torchrun).launcher, detect_launcher(torchrun).rank) == ("torchrun", 5)
    # srun --mpi=pmix / pmi2: MPI, with Slurm's rendezvous for gloo/nccl
    pmix = detect_launcher({**SRUN_ENV, "PMIX_RANK": "3"})
    assert (pmix.launcher, pmix.rank, pmix.world_size, pmix.master_addr) == ("mpi", 3, 4, "gpu07")
    with pytest.raises(BackendInitError, match="SLURM_PROCID=5, SLURM_STEP_NUM_TASKS=4"):
        detect_launcher({**SRUN_ENV, "SLURM_PROCID": "5"})
    with pytest.raises(BackendInitError, match="'x' is not an integer"):
        detect_launcher({**SRUN_ENV, "SLURM_LOCALID": "x"})


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("vm", "vm"),
        ("node[03-05,09],gpu1", "node03"),
        ("gpu-a1,gpu-b[1-2]", "gpu-a1"),
        ("rack[2-3]-n[010-012]", "rack2-n010"),
        ("n[7,2]", "n7"),
    ],
)
def test_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


# ------------------------------------------------------------------------------------ a real Slurm
# no loss.png: four runs' matplotlib on two cores, seconds; tests/test_run_logging.py checks the plot
SETS = [*TINY_LM, "train.steps=4", "train.eval_every=0", "logging.log_every=1", "logging.progress=false",
        "logging.plot=false"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started, why = start_cluster()
    if started is None:
        pytest.skip(why)
    try:
        yield started
    finally:
        started.stop()


def _train_args(run: Path, *extra: str) -> list[str]:
    sets = [*SETS, f"logging.run_dir={run}", *extra]
    return ["-m", "dtlab", "train", *[a for s in sets for a in ("--set", s)]]


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [rec["loss"] for rec in map(json.loads, lines) if "loss" in rec]


@pytest.mark.timeout(600)  # four 2-process launches on 2 cores: about 100 s under load
def test_dtlab_train_under_srun_and_sbatch_equals_torchrun(cluster: Cluster, tmp_path: Path) -> None:
    env = {
        **cluster.env,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    py = sys.executable
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --time=5\n"
        f"#SBATCH --output={tmp_path / 'job.out'}\n"
        f"srun {py} {' '.join(_train_args(tmp_path / 'sbatch'))}\n"
    )
    runs = {  # started together: 8 processes, the 2 cores shared
        "srun": ["srun", "-n", "2", "--time=5", py, *_train_args(tmp_path / "srun")],
        "sbatch": ["sbatch", "--wait", str(script)],
        "srun_mpi": ["srun", "-n", "2", "--mpi=pmi2", "--time=5", py,
                     *_train_args(tmp_path / "srun_mpi", "backend.name=mpi")],
        "torchrun": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     *_train_args(tmp_path / "torchrun")],
    }  # fmt: skip
    torchrun_env = {k: v for k, v in env.items() if k != "SLURM_CONF"}
    procs = {
        name: subprocess.Popen(
            cmd,
            env=torchrun_env if name == "torchrun" else env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, cmd in runs.items()
    }
    outputs = {}
    deadline = time.monotonic() + 420
    for name, proc in procs.items():
        try:
            outputs[name] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name} did not finish in 420 s")
    job_out = tmp_path / "job.out"
    for name, proc in procs.items():
        extra = job_out.read_text() if name == "sbatch" and job_out.exists() else ""
        assert proc.returncode == 0, f"{name}: {outputs[name][-3000:]} {extra[-3000:]}"
    job = job_out.read_text()
    assert "GlooBackend x 2" in outputs["srun"] and "GlooBackend x 2" in job
    assert "MPIBackend x 2" in outputs["srun_mpi"]
    reference = _losses(tmp_path / "torchrun")
    assert len(reference) == 4 and reference[-1] < reference[0]
    assert _losses(tmp_path / "srun") == reference  # the same world, the same engine: bitwise
    assert _losses(tmp_path / "sbatch") == reference
    assert _losses(tmp_path / "srun_mpi") == pytest.approx(reference, rel=1e-5)  # MPI's own sums
