"""``init_backend`` / ``detect_launcher``: each launcher's environment, and the errors for broken ones."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from processes import run_groups

from dtlab.backends import InMemoryBackend, detect_launcher, init_backend
from dtlab.backends.init import choose_backend
from dtlab.errors import BackendInitError

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
}


def test_plain_python_gives_one_in_memory_rank() -> None:
    info = detect_launcher({"MASTER_ADDR": "somewhere"})  # MASTER_* alone is not a launch
    assert info.launcher == "none" and choose_backend(info) == "inmemory"
    b = init_backend(env={})
    assert isinstance(b, InMemoryBackend) and (b.rank, b.world_size) == (0, 1)
    assert init_backend("inmemory", env={}, timeout=5).world_size == 1


def test_torchrun_environment() -> None:
    info = detect_launcher(TORCHRUN)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 1, 4, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29500)
    assert choose_backend(info, cuda_available=True) == "nccl"
    assert choose_backend(info, cuda_available=False) == "gloo"


@pytest.mark.parametrize(
    "env,rank,size",
    [
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, 2, 4),  # MPICH / Intel MPI (Hydra)
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "3"}, 3, 4),  # Open MPI
        ({"PMIX_RANK": "1"}, 1, None),  # PMIx alone: the size comes from MPI
    ],
)
def test_mpi_launcher_environments(env: dict[str, str], rank: int, size: int | None) -> None:
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size) == ("mpi", rank, size)
    assert choose_backend(info, cuda_available=True) == "mpi"


@pytest.mark.parametrize(
    "env,needed",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "missing MASTER_ADDR, MASTER_PORT"),
        ({"RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "missing WORLD_SIZE"),
        ({**TORCHRUN, "RANK": "4"}, "0 <= RANK < WORLD_SIZE (got RANK=4, WORLD_SIZE=4)"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT in 0..65535"),
        ({**TORCHRUN, "LOCAL_RANK": "9"}, "LOCAL_RANK"),
        ({**TORCHRUN, "MASTER_ADDR": " "}, "a non-empty MASTER_ADDR"),
        ({**TORCHRUN, "PMI_RANK": "0", "PMI_SIZE": "4"}, "MPI's rank 0 and size 4 to match"),
        ({"PMI_RANK": "0"}, "needed both PMI_RANK and PMI_SIZE"),
        ({"PMI_RANK": "5", "PMI_SIZE": "4"}, "0 <= rank < size"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
            "disagree",
        ),
    ],
)
def test_broken_environments_are_one_clear_error(env: dict[str, str], needed: str) -> None:
    with pytest.raises(BackendInitError) as info:
        init_backend("auto", env=env)
    text = str(info.value)
    assert needed in text, text
    assert "found" in text and any(f"{k}=" in text for k in env)  # it lists what it found


def test_bad_names_and_impossible_choices() -> None:
    with pytest.raises(ValueError, match="unknown backend 'tcp'"):
        init_backend("tcp", env={})
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        init_backend(env={}, timeout=0)
    with pytest.raises(BackendInitError, match="runs one rank, but the launcher started 4"):
        init_backend("inmemory", env=TORCHRUN)
    with pytest.raises(BackendInitError, match="torchrun starts no MPI ranks") as mpi:
        init_backend("mpi", env=TORCHRUN)  # before MPI starts: each process a world of 1, alone
    assert "mpiexec -n 4" in str(mpi.value) and "'auto'" in str(mpi.value)
    with pytest.raises(BackendInitError, match="needs torchrun's RANK"):
        init_backend("gloo", env={"PMI_RANK": "0", "PMI_SIZE": "2"})
    if not _cuda():
        with pytest.raises(BackendInitError, match="needs CUDA"):
            init_backend("nccl", env=TORCHRUN)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


SCRIPT = """
import os, sys, torch
torch.set_num_threads(1)
from dtlab.backends import GlooBackend, init_backend
if sys.argv[1:] == ["own"]:  # the script makes the group itself, after importing dtlab
    import torch.distributed as dist
    dist.init_process_group("gloo")
    b = GlooBackend(timeout=60)
else:
    b = init_backend(timeout=60, check_collectives=True if sys.argv[1:] == ["checked"] else None)
import torch.distributed.nn.functional  # what building a torch.optim optimizer imports (torch._dynamo)
g = b.new_group(list(range(b.world_size)))  # a sub-group, still referenced after its close()
g.barrier()
t = torch.ones(3) * (b.rank + 1)
b.all_reduce(t)
line = f"{type(b).__name__} rank={b.rank} size={b.world_size} sum={t[0].item():g}"
print(line + f" checked={b.check_collectives}", flush=True)
g.close()
b.close()


def name(task):
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read()
    except OSError:  # the thread ended meanwhile
        return ""


left = [n for n in map(name, os.listdir("/proc/self/task")) if "gloo" in n]
print(f"rank={b.rank} gloo threads after close: {len(left)}", flush=True)
if type(g).__name__ == "GlooBackend":
    try:
        g.barrier()
    except Exception as exc:
        print(f"closed group: {type(exc).__name__}: {exc}", flush=True)
"""


def test_one_script_three_launchers(tmp_path: Path) -> None:
    """The same file under python, torchrun and mpiexec picks in-memory, gloo and MPI by itself; checked
    mode comes from init_backend's argument (torchrun), the environment (mpiexec) or is off (python
    with DTLAB_CHECK_COLLECTIVES=0: the in-memory world checks every call anyway). After ``close()``
    no gloo thread is left, though the script still holds a closed sub-group and imported, after the
    default group was made, the torch module whose defaults bind it (as building an optimizer does)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    bindir = Path(sys.executable).parent
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # torchrun on CPU: auto must pick gloo
    env["DTLAB_CHECK_COLLECTIVES"] = "0"
    runs = {
        "python": [sys.executable, str(script)],
        "torchrun": [
            str(bindir / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            "checked",
        ],
        "mpiexec": [str(bindir / "mpiexec"), "-n", "2", sys.executable, str(script)],
        "own group": [str(bindir / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script), "own"],
    }
    want = {
        "python": {"InMemoryBackend rank=0 size=1 sum=1 checked=True"},
        "torchrun": {
            "GlooBackend rank=0 size=2 sum=3 checked=True",
            "GlooBackend rank=1 size=2 sum=3 checked=True",
        },
        "mpiexec": {
            "MPIBackend rank=0 size=2 sum=3 checked=True",
            "MPIBackend rank=1 size=2 sum=3 checked=True",
        },
        "own group": {
            "GlooBackend rank=0 size=2 sum=3 checked=False",
            "GlooBackend rank=1 size=2 sum=3 checked=False",
        },
    }
    envs = {name: {**env, "DTLAB_CHECK_COLLECTIVES": "1"} if name == "mpiexec" else env for name in runs}
    done = run_groups(runs, timeout=240, envs=envs)  # all four at once, each its own process group
    for name, proc in done.items():
        lines = set(
            re.findall(r"\w+Backend rank=\d+ size=\d+ sum=\d+ checked=(?:True|False)", proc.stdout)
        )  # ranks' lines may interleave
        assert proc.returncode == 0 and lines == want[name], (name, proc.stdout[-2000:], proc.stderr[-2000:])
        # close() ended the process group: no gloo thread is left for the interpreter's teardown
        left = re.findall(r"gloo threads after close: (\d+)", proc.stdout)
        assert left == ["0"] * len(want[name]), (name, proc.stdout[-2000:])
        if name == "torchrun":  # a closed torch.distributed group says so instead of running
            assert proc.stdout.count("closed group: BackendInitError: GlooBackend(rank=") == 2, proc.stdout
