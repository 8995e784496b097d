"""A world started by Slurm's ``srun``: rank, size, local rank and the rendezvous, from Slurm's own
environment.

``srun`` gives every task ``SLURM_PROCID`` (its rank), ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``
(the world size), ``SLURM_LOCALID`` (its rank on the node: the CUDA device) and ``SLURM_STEP_ID``.
The batch script of ``sbatch`` also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS``, but no
``SLURM_STEP_ID``: a process started there directly is not a task of a step, so it is not taken for
one. The rendezvous is the first node of the step (``SLURM_STEP_NODELIST``, else the job's) unless
``MASTER_ADDR`` is set, at ``MASTER_PORT`` or a port derived from the job id (15000-24999, the same on
every task of the job).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dtlab.errors import BackendInitError

__all__ = ["SLURM_VARS", "SlurmTask", "first_host", "slurm_task"]

#: the variables read (and listed in errors)
SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
)
_BRACKET = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class SlurmTask:
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[03-05,09],gpu1`` -> ``node03`` (what
    ``scontrol show hostnames | head -n 1`` prints, without needing ``scontrol``)."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    host = _BRACKET.sub(lambda m: re.split(r"[,-]", m.group(1))[0], first)
    if not host or "[" in host or "]" in host:
        raise BackendInitError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return host


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise BackendInitError(f"{name}={env[name]!r} is not an integer (set by srun)") from None


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """This process as a task of an ``srun`` step, or None when ``srun`` did not start it."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if size_var not in env:
        raise BackendInitError(
            "srun started this process (SLURM_PROCID, SLURM_STEP_ID) but set neither "
            "SLURM_STEP_NUM_TASKS nor SLURM_NTASKS: start it with srun -n N"
        )
    rank, size = _int(env, "SLURM_PROCID"), _int(env, size_var)
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
    if size < 1 or not 0 <= rank < size:
        raise BackendInitError(f"inconsistent Slurm variables SLURM_PROCID={rank}, {size_var}={size}")
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        nodes = next(
            (env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)),
            None,
        )
        if nodes is None:
            raise BackendInitError(
                "srun started this process but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST names the "
                "nodes; set MASTER_ADDR to the host of task 0"
            )
        addr = first_host(nodes)
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    else:
        job = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
        port = 15000 + job % 10000
    return SlurmTask(rank, size, local, addr, port)
