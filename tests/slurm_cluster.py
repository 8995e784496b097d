"""A one-node Slurm cluster for tests: munge, slurmctld and slurmd started from a generated
slurm.conf in a temporary directory, stopped by PID. ``start_cluster`` returns None and a reason
when the packages are missing or the daemons do not come up (the test then skips saying why)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
# MinJobAge=0: finished jobs' records are kept (the cluster lives for one test module), so `sbatch
# --wait` polls every 2 s; with records purged after MinJobAge (300 s by default) it backs off to 8 s
# and then 32 s, and a job done after 10 s was seen done only at 42 s
CONF = """ClusterName=dtlabtest
FirstJobId={first_job}
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MinJobAge=0
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged: by the PIDs started here
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self) -> str:
        out = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.is_file():
                out.append(f"{name}: " + " | ".join(p.read_text(errors="replace").splitlines()[-3:]))
        return "; ".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cluster(timeout: float = 60.0) -> tuple[Cluster | None, str]:
    """(cluster, "") or (None, why not)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return None, (
            f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge "
            "(test.sh does it where it runs as root with apt-get)"
        )
    if os.geteuid() != 0:
        return None, "a test Slurm node needs root (slurmd runs jobs as their user)"
    root = Path(tempfile.mkdtemp(prefix="dtlab-slurm-"))
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        # job ids differ from run to run: MPICH names its shared memory after the job step, and a
        # killed job of an earlier test cluster may have left a segment under the same name
        CONF.format(
            host=host,
            root=root,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            first_job=random.randrange(1000, 10_000_000),
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in [k for k in env if k.startswith(("SLURM_", "PMI", "OMPI_"))] + ["RANK", "WORLD_SIZE"]:
        if var != "SLURM_CONF":
            env.pop(var, None)
    cluster = Cluster(root, env)
    m = root / "munge"
    commands = [
        ["munged", "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
         f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf)],
    ]  # fmt: skip
    try:
        for cmd in commands:
            cluster.procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            time.sleep(0.5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [c[0] for c, p in zip(commands, cluster.procs, strict=False) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited at start")
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=20
            ).stdout.strip()
            if state == "idle":
                return cluster, ""
            time.sleep(1)
        raise RuntimeError(f"the node did not become idle in {timeout:.0f} s")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        why = f"a one-node Slurm did not start: {exc}; {cluster.log_tail()}"
        cluster.stop()
        return None, why
