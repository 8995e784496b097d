"""``init_backend``: one call that starts the right backend for however the script was launched.

    backend = init_backend()        # python train.py                      -> in-memory, 1 rank
                                    # torchrun --nproc-per-node 4 train.py -> nccl (CUDA) or gloo
                                    # mpiexec -n 4 python train.py         -> mpi
                                    # srun -n 4 python train.py            -> nccl (CUDA) or gloo
                                    # srun --mpi=pmix -n 4 python train.py -> mpi

"auto" reads the launcher's environment (:func:`detect_launcher`): torchrun's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK`` for the CUDA device); an MPI
launcher's ``PMI_RANK``/``PMI_SIZE`` (MPICH, Intel MPI), ``OMPI_COMM_WORLD_RANK``/``_SIZE`` (Open MPI)
or ``PMIX_RANK`` (PMIx); Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` in a task
``srun`` started (the first node of the step as rendezvous: ``backends/_slurm.py``). A missing or
inconsistent variable is one :class:`BackendInitError` listing what was found and what is needed.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from dtlab.backends._mpi_wait import DEFAULT_WATCHDOG_S
from dtlab.backends._run_args import check_timeout
from dtlab.backends._slurm import SLURM_VARS, slurm_task
from dtlab.backends.base import CommunicationBackend
from dtlab.errors import ArgumentError, ArgumentTypeError, BackendInitError

__all__ = ["BACKEND_NAMES", "LaunchInfo", "choose_backend", "detect_launcher", "init_backend"]

BackendName = Literal["auto", "inmemory", "mpi", "gloo", "nccl"]
BACKEND_NAMES: tuple[str, ...] = ("auto", "inmemory", "mpi", "gloo", "nccl")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# (rank variable, size variable or None, launcher family)
MPI_VARS = (
    ("PMI_RANK", "PMI_SIZE", "MPICH/Hydra (PMI)"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMIX_RANK", None, "PMIx"),
)
DEFAULT_TIMEOUT = {"inmemory": 60.0, "gloo": 300.0, "nccl": 600.0}


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about the launch: ``launcher`` is "torchrun", "mpi", "slurm" (a task
    ``srun`` started, without an MPI library's variables) or "none"."""

    launcher: Literal["torchrun", "mpi", "slurm", "none"]
    rank: int = 0
    world_size: int | None = 1
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    found: dict[str, str] = field(default_factory=dict)


def _found_text(found: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(found.items())) or "none"


def _int(env: Mapping[str, str], name: str, found: Mapping[str, str], need: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise BackendInitError(
            f"{name}={env[name]!r} is not an integer; found: {_found_text(found)}; needed: {need}"
        ) from None


def _mpi_launch(env: Mapping[str, str], found: dict[str, str]) -> tuple[int, int | None] | None:
    """(rank, size) from the MPI launcher variables, or None when there are none."""
    seen: list[tuple[str, int, int | None]] = []
    for rank_var, size_var, family in MPI_VARS:
        has_rank, has_size = rank_var in env, size_var is not None and size_var in env
        if not (has_rank or has_size):
            continue
        if size_var is not None and has_rank != has_size:
            raise BackendInitError(
                f"incomplete {family} launch variables: found {_found_text(found)}; needed both "
                f"{rank_var} and {size_var} (start the script with mpiexec/mpirun)"
            )
        need = f"{rank_var}{' and ' + size_var if size_var else ''} as integers"
        rank = _int(env, rank_var, found, need)
        size = _int(env, size_var, found, need) if size_var is not None else None
        if rank < 0 or (size is not None and not (size >= 1 and rank < size)):
            raise BackendInitError(
                f"inconsistent {family} launch variables {rank_var}={rank}, {size_var}={size}: needed "
                f"0 <= rank < size; found {_found_text(found)}"
            )
        seen.append((family, rank, size))
    if not seen:
        return None
    ranks = {r for _, r, _ in seen}
    sizes = {s for _, _, s in seen if s is not None}
    if len(ranks) > 1 or len(sizes) > 1:
        raise BackendInitError(
            f"MPI launch variables disagree ({', '.join(f'{f}: rank {r}, size {s}' for f, r, s in seen)}); "
            f"found {_found_text(found)}; needed one consistent rank and size"
        )
    return seen[0][1], (sizes.pop() if sizes else None)


def _check_env(who: str, env: object) -> None:
    if env is not None and not isinstance(env, Mapping):  # a string would be searched for 'RANK' as text
        raise ArgumentTypeError(f"{who}: env must be a mapping such as os.environ (or None), got {env!r}")


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read torchrun's or an MPI launcher's variables from ``env`` (default ``os.environ``)."""
    _check_env("detect_launcher", env)
    env = os.environ if env is None else env
    names = set(TORCHRUN_VARS) | {"LOCAL_RANK"} | {v for r, s, _ in MPI_VARS for v in (r, s) if v}
    names |= set(SLURM_VARS)
    found = {k: env[k] for k in sorted(names) if k in env}
    mpi = _mpi_launch(env, found)
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in TORCHRUN_VARS if k not in env]
        if missing:
            raise BackendInitError(
                f"incomplete torchrun launch variables: found {_found_text(found)}; missing "
                f"{', '.join(missing)}; needed all of {', '.join(TORCHRUN_VARS)} (start with torchrun, "
                "or unset RANK/WORLD_SIZE to run as one process)"
            )
        need = "RANK, WORLD_SIZE, MASTER_PORT as integers"
        rank, size = _int(env, "RANK", found, need), _int(env, "WORLD_SIZE", found, need)
        port = _int(env, "MASTER_PORT", found, need)
        local = _int(env, "LOCAL_RANK", found, "LOCAL_RANK as an integer") if "LOCAL_RANK" in env else None
        problems = []
        if size < 1 or not 0 <= rank < size:
            problems.append(f"0 <= RANK < WORLD_SIZE (got RANK={rank}, WORLD_SIZE={size})")
        if not env["MASTER_ADDR"].strip():
            problems.append("a non-empty MASTER_ADDR (the host of rank 0)")
        if not 0 <= port < 65536:  # 0: torchrun --master-port 0, whose agent hosts the store
            problems.append(f"MASTER_PORT in 0..65535 (got {port})")
        if local is not None and not 0 <= local < size:
            problems.append(f"0 <= LOCAL_RANK < WORLD_SIZE (got LOCAL_RANK={local})")
        if mpi is not None and (mpi[0] != rank or mpi[1] not in (None, size)):
            problems.append(f"MPI's rank {mpi[0]} and size {mpi[1]} to match RANK and WORLD_SIZE")
        if problems:
            raise BackendInitError(
                f"inconsistent torchrun launch variables: found {_found_text(found)}; needed "
                + "; ".join(problems)
            )
        return LaunchInfo("torchrun", rank, size, local, env["MASTER_ADDR"], port, found)
    slurm = slurm_task(env)
    if mpi is not None:  # srun --mpi=pmix/pmi2 or mpiexec; under srun the rendezvous is Slurm's
        addr = env.get("MASTER_ADDR") or (slurm.master_addr if slurm else None)
        mport: int | None = int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else None
        if slurm is None:
            return LaunchInfo("mpi", mpi[0], mpi[1], None, addr, mport, found)
        msize = mpi[1] if mpi[1] is not None else slurm.world_size
        mport = slurm.master_port if mport is None else mport
        return LaunchInfo("mpi", mpi[0], msize, slurm.local_rank, addr, mport, found)
    if slurm is not None:
        s = slurm
        return LaunchInfo("slurm", s.rank, s.world_size, s.local_rank, s.master_addr, s.master_port, found)
    return LaunchInfo("none", found=found)


def choose_backend(info: LaunchInfo, cuda_available: bool | None = None) -> str:
    """The backend "auto" picks: torchrun or srun -> nccl (with CUDA) or gloo; MPI -> mpi; else inmemory."""
    if info.launcher in ("torchrun", "slurm"):
        cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
        return "nccl" if cuda else "gloo"
    return "mpi" if info.launcher == "mpi" else "inmemory"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_backend(
    name: str = "auto",
    *,
    timeout: float | None = None,
    device: str | torch.device | None = None,
    env: Mapping[str, str] | None = None,
    check_collectives: bool | None = None,
    watchdog: float | None = DEFAULT_WATCHDOG_S,
) -> CommunicationBackend:
    """Start the backend ``name`` ("auto", "inmemory", "mpi", "gloo", "nccl") for this process.

    ``timeout`` (seconds) bounds every operation; on MPI (default None) it polls every operation,
    which raises :class:`CollectiveTimeoutError` after ``timeout``.
    ``watchdog`` (MPI only; seconds, default 600, None: off): MPI's blocking calls are watched by a
    thread that ends the job, naming the operation, when one takes longer (torch's engines bound
    their waits by ``timeout``).
    ``device``: where tensors live (default: ``cuda:LOCAL_RANK`` for nccl, else ``cpu``).
    ``check_collectives``: checked mode (see ``CommunicationBackend.check_collectives``); None: the
    environment variable ``DTLAB_CHECK_COLLECTIVES`` decides.
    """
    if check_collectives is not None and not isinstance(check_collectives, bool):
        raise ArgumentTypeError(
            f"init_backend: check_collectives must be True, False or None, got {check_collectives!r}"
        )
    if watchdog is not None:
        check_timeout("init_backend", "watchdog", watchdog)
    backend = _start(name, timeout, device, env, watchdog)
    if check_collectives is not None:
        backend.check_collectives = check_collectives
    return backend


def _start(
    name: str,
    timeout: float | None,
    device: str | torch.device | None,
    env: Mapping[str, str] | None,
    watchdog: float | None,
) -> CommunicationBackend:
    if name not in BACKEND_NAMES:
        raise ArgumentError(
            f"init_backend: unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if timeout is not None:
        check_timeout("init_backend", "timeout", timeout)
    _check_env("init_backend", env)
    info = detect_launcher(env)
    chosen = choose_backend(info) if name == "auto" else name
    if chosen == "inmemory":
        if (info.world_size or 1) > 1:
            raise BackendInitError(
                f"init_backend('inmemory') runs one rank, but the launcher started {info.world_size} "
                f"processes (found {_found_text(info.found)}); use 'auto', 'gloo', 'nccl' or 'mpi'"
            )
        from dtlab.backends.inmemory import InMemoryWorld

        return InMemoryWorld(
            1, timeout=timeout or DEFAULT_TIMEOUT["inmemory"], device=device or "cpu"
        ).backend(0)
    if chosen == "mpi":
        mpi_vars = {v for r, sz, _ in MPI_VARS for v in (r, sz) if v}
        if info.launcher == "torchrun" and (info.world_size or 1) > 1 and not mpi_vars & set(info.found):
            raise BackendInitError(
                f"init_backend('mpi') under torchrun ({info.world_size} processes; found "
                f"{_found_text(info.found)}): torchrun starts no MPI ranks, so each process would be an MPI "
                f"world of its own, training alone; start with mpiexec -n {info.world_size} for 'mpi', or "
                "use 'auto' (or 'gloo', 'nccl') under torchrun"
            )
        from dtlab.backends.mpi import MPIBackend

        mpi = MPIBackend(timeout=timeout, watchdog=watchdog, device=device or "cpu")
        if info.launcher == "slurm" and mpi.world_size != info.world_size:
            mpi.close()
            raise BackendInitError(
                f"srun started {info.world_size} tasks but MPI sees a world of {mpi.world_size}: srun "
                "did not hand MPI the world; start with srun --mpi=pmix (or --mpi=pmi2, whichever your "
                "MPI supports: srun --mpi=list), or use backend gloo/nccl"
            )
        return mpi
    return _init_torch_dist(chosen, info, timeout or DEFAULT_TIMEOUT[chosen], device, real_env=env is None)


def _init_torch_dist(
    name: str, info: LaunchInfo, timeout: float, device: str | torch.device | None, real_env: bool
) -> CommunicationBackend:
    import torch.distributed as dist

    from dtlab.backends.torch_dist import GlooBackend, NCCLBackend

    cls = NCCLBackend if name == "nccl" else GlooBackend
    if name == "nccl" and not torch.cuda.is_available():
        raise BackendInitError(
            "init_backend('nccl') needs CUDA, but torch.cuda.is_available() is False; use 'gloo' on CPU"
        )
    if not dist.is_available():
        raise BackendInitError(f"init_backend('{name}'): this torch build has no torch.distributed")
    if info.launcher in ("torchrun", "slurm"):
        rank, size, addr, port = info.rank, info.world_size or 1, info.master_addr, info.master_port
    elif info.launcher == "mpi" and info.master_addr and info.world_size:
        if info.master_port is None:
            raise BackendInitError(
                f"init_backend('{name}') under an MPI launcher needs MASTER_ADDR and MASTER_PORT; "
                f"found {_found_text(info.found)}"
            )
        rank, size, addr, port = info.rank, info.world_size, info.master_addr, info.master_port
    elif info.launcher == "none":
        rank, size, addr, port = 0, 1, "127.0.0.1", _free_port()
    else:
        raise BackendInitError(
            f"init_backend('{name}') needs torchrun's {', '.join(TORCHRUN_VARS)}; found "
            f"{_found_text(info.found)} (an MPI launch: use 'mpi', or set MASTER_ADDR/MASTER_PORT)"
        )
    if device is None and name == "nccl":
        local = info.local_rank if info.local_rank is not None else rank % max(torch.cuda.device_count(), 1)
        device = torch.device("cuda", local)
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        if dist.get_backend() != name:
            raise BackendInitError(
                f"torch.distributed is already initialized with {dist.get_backend()!r}, not {name!r}"
            )
        return cls(device=dev, timeout=timeout)
    # under torchrun its agent already hosts the store at MASTER_PORT: join it through env://
    method = "env://" if real_env and info.launcher == "torchrun" else None
    return cls.start(
        rank, size, addr or "127.0.0.1", port or 29500, timeout=timeout, device=dev, init_method=method
    )
