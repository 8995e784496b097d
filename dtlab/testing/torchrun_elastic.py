"""``TorchrunJob``: torchrun elastic agents of one job on this machine, started, killed and restarted
by PID, for tests and the elastic benchmark.

Every agent runs ``python -m torch.distributed.run --nnodes=MIN:MAX --nproc-per-node=1
--max-restarts=N --rdzv-backend=c10d`` with the rendezvous on ``127.0.0.1`` at a free port. The
rendezvous store is hosted by this process (``is_host=false`` for every agent, as with an external
etcd/TCPStore in production), so any agent may die without taking the rendezvous with it. An agent
whose heartbeat is older than ``keep_alive`` = (interval, attempts) seconds x attempts is taken for
dead: that is how long the survivors wait before they rebuild, and it must exceed any stall of a
live agent's heartbeat thread, or a newcomer takes a live agent for dead and starts a world of its
own (seen at 1 s x 2 on a loaded 2-core machine; the default here is 1 s x 8). Two
settings work around torchrun's own limits on one machine: ``--local-addr=127.0.0.1`` (no hostname
lookup) and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the agent's store shared with the workers,
a node that joins a running job waits forever for a ``MASTER_ADDR`` key the old rank-0 agent never
writes again). ``kill`` stops an agent and its workers with SIGKILL (a lost node); ``close`` kills
whatever is left. Every wait is bounded.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["TorchrunJob", "read_metrics"]


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (torchrun starts each worker in a session of its own)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return (Path("/proc") / str(pid) / "stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a metrics file written so far (a line being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


class TorchrunJob:
    """Agents of one torchrun elastic job running ``worker`` (a script path or ``-m module`` and its
    arguments); use as a context manager so every process is killed at the end."""

    def __init__(
        self,
        worker: Sequence[str],
        workdir: str | Path,
        *,
        nnodes: str = "1:3",
        max_restarts: int = 3,
        monitor_interval: float = 0.5,
        keep_alive: tuple[int, int] = (1, 8),
        env: dict[str, str] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
        self.port = int(self.store.port)
        self.run_id = f"dtlab-{uuid.uuid4().hex[:8]}"
        self.worker = list(worker)
        self.nnodes, self.max_restarts, self.monitor_interval = nnodes, max_restarts, monitor_interval
        self.keep_alive = keep_alive
        self.env = dict(os.environ)
        paths = [p or os.getcwd() for p in sys.path]
        self.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, self.env.get("PYTHONPATH", "")]))
        self.env.update(
            {
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "GLOO_SOCKET_IFNAME": "lo",  # the workers' gloo pairs on the loopback interface only
                "OMP_NUM_THREADS": "1",
                "LOGLEVEL": "INFO",
            }
        )
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(var, None)
        self.env.update(env or {})
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def command(self, extra: Sequence[str] = ()) -> list[str]:
        interval, attempts = self.keep_alive
        conf = (
            f"is_host=false,last_call_timeout=1,join_timeout=60,keep_alive_interval={interval},"
            f"keep_alive_max_attempt={attempts}"
        )
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            "--local-addr=127.0.0.1",
            f"--monitor-interval={self.monitor_interval}",
            *self.worker,
            *extra,
        ]

    def start(self, name: str, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start agent ``name`` (its output goes to ``workdir/<name>.log``, appended)."""
        log = open(self.workdir / f"{name}.log", "ab")
        self._logs.append(log)
        proc = subprocess.Popen(self.command(extra), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.agents[name] = proc
        return proc

    def workers(self, name: str) -> list[int]:
        return _children(self.agents[name].pid)

    def kill(self, name: str) -> float:
        """SIGKILL agent ``name`` and its workers (a lost node); returns the time (``time.time()``)."""
        proc = self.agents[name]
        victims = [*self.workers(name), proc.pid]
        t = time.time()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
        return t

    def wait(self, name: str, timeout: float) -> int:
        return self.agents[name].wait(timeout)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                for pid in [*_children(proc.pid), proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(10)
        for log in self._logs:
            log.close()
        del self.store

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.02) -> Any:
    """Poll ``check()`` until it returns something truthy; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g}s for {what}")
        time.sleep(poll)


def shrink_and_grow(
    job: TorchrunJob,
    metrics: Path,
    args: dict[str, list[str]],
    lost_disk: Path | None,
    kill_after: int,
    timeout: float,
) -> dict[str, Any]:
    """The two-agent scenario: agents ``a`` and ``b`` train together; once step ``kill_after`` is
    logged, ``b`` is killed with its workers (and ``lost_disk``, its node-local directory, deleted);
    ``a`` restarts alone and resumes; then ``b`` is started again and the job grows back to two.

    Returns the timeline (``time.time()`` seconds) and what the metrics file says: the restore
    records, the last step logged in the world each replaced, the agents' exit codes and every
    logged record."""

    def logged() -> list[dict[str, Any]]:
        return read_metrics(metrics)

    def last_step(records: list[dict[str, Any]]) -> int:
        return max((r["step"] for r in records if "loss" in r), default=0)

    def restores(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r["elastic"] for r in records if "elastic" in r]

    t0 = time.time()
    job.start("a", args["a"])
    job.start("b", args["b"])
    wait_for(f"step {kill_after} in {metrics}", lambda: last_step(logged()) >= kill_after, timeout)
    survivor = job.workers("a")
    before_kill = last_step(logged())
    t_kill = job.kill("b")
    if lost_disk is not None:
        import shutil

        shutil.rmtree(lost_disk, ignore_errors=True)
    gone = lambda: not any(_alive(p) for p in survivor)  # noqa: E731
    wait_for("the survivor's worker to notice and exit", gone, timeout)
    t_detect = time.time()
    first = wait_for("the restore on the survivor alone", lambda: restores(logged()), timeout)[0]
    t_restart = time.time()
    job.start("b", args["b"])
    second = wait_for("the restore after the job grows back", lambda: restores(logged())[1:], timeout)[0]
    rc = {name: job.wait(name, timeout) for name in ("a", "b")}
    records = logged()
    # the last step logged in the world each restore replaced (since the previous restore record):
    # minus the restored step, the work that restore redoes
    before: list[int] = []
    since = 0
    for i, r in enumerate(records):
        if "elastic" in r:
            before.append(last_step(records[since:i]))
            since = i
    return {
        "t_start": t0,
        "t_kill": t_kill,
        "t_detect": t_detect,
        "t_restart_b": t_restart,
        "last_step_before_kill": before_kill,
        "restores": [first, second],
        "last_step_before_restore": before,
        "exit_codes": rc,
        "records": records,
    }
