"""A launcher (``torchrun``, ``mpiexec``, ``python -m dtlab``) run as its own process group, so that a
time-out ends it and every rank it started."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


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


def run_groups(
    cmds: dict[str, list[str]], timeout: float, envs: dict[str, dict[str, str]] | None = None
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command of ``cmds`` started at once, each as :func:`run_group` runs one (its own process
    group, one OpenMP thread per process; the environment ``envs[name]``, else this process's), its
    output captured in files (no pipe to fill while another is read); ``timeout`` seconds bound them
    all together: past it every group still running is killed and ``subprocess.TimeoutExpired``
    raised."""
    import tempfile
    import time

    procs: dict[str, tuple[subprocess.Popen[bytes], Any, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        for name, cmd in cmds.items():
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            env = {**(envs or {}).get(name, os.environ), "OMP_NUM_THREADS": "1"}
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
            procs[name] = (proc, out, err)
        done = {}
        for name, (proc, out, err) in procs.items():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            text = []
            for f in (out, err):
                f.seek(0)
                text.append(f.read().decode(errors="replace"))
            done[name] = subprocess.CompletedProcess(cmds[name], proc.returncode, text[0], text[1])
        return done
    finally:
        for proc, out, err in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
                proc.wait(timeout=30)
            out.close()
            err.close()
