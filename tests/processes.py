"""A launcher (``torchrun``, ``mpiexec``, ``python -m dtlab``) run as its own process group, so that a
time-out ends it and every rank it started."""

from __future__ import annotations

import os
import signal
import subprocess


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``cmd`` with one OpenMP thread per process, its output captured; past ``timeout`` seconds the
    whole group is killed and ``subprocess.TimeoutExpired`` raised."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started, by process group
        proc.communicate(timeout=30)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
